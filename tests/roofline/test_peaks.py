"""The roofline peaks' cache file: written with the atomic helper (echotrain/atomic.py), under the
ground floor's cache folder (echotrain/cache.py)."""

import json
import os

import torch

from echotrain.roofline import peaks as peaks_mod


def _fixed_measurements(monkeypatch):
    monkeypatch.delenv(peaks_mod.PEAKS_ENV, raising=False)
    monkeypatch.setattr(peaks_mod, "measure_gemm", lambda dtype, device: 2e9)
    monkeypatch.setattr(peaks_mod, "measure_bandwidth", lambda device: 3e9)


def test_a_failed_cache_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """The rename onto the cache file fails: the figures are still returned, the source says the
    cache was not writable, and the folder holds nothing (the temporary file is removed)."""
    _fixed_measurements(monkeypatch)

    def no_rename(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_rename)
    got = peaks_mod.machine_peaks(torch.float32, torch.device("cpu"), threads=1, cache_dir=tmp_path)
    assert (got.gemm_flops_per_s, got.mem_bytes_per_s) == (2e9, 3e9) and "not writable" in got.source
    assert list((tmp_path / "roofline").iterdir()) == []


def test_the_cache_folder_comes_from_echotrain_cache(tmp_path, monkeypatch):
    """Without ``cache_dir``: ``$ECHOTRAIN_CACHE/roofline/<machine>-float32-t1.json``, the one
    file in the folder, as JSON with a trailing newline."""
    _fixed_measurements(monkeypatch)
    monkeypatch.setenv("ECHOTRAIN_CACHE", str(tmp_path / "c"))
    got = peaks_mod.machine_peaks(torch.float32, torch.device("cpu"), threads=1)
    (path,) = (tmp_path / "c" / "roofline").iterdir()
    assert path.name == f"{got.machine}-float32-t1.json" and str(path) in got.source
    text = path.read_text()
    assert text.endswith("}\n") and json.loads(text)["gemm_flops_per_s"] == 2e9
