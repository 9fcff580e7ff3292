"""echotrain/atomic.py: a folder swapped into place is never absent while the old one is removed
(the testbed and GGUF caches), and a failed swap keeps the old folder."""

from __future__ import annotations

import os
import sys

import pytest

from echotrain import atomic


def _folder(path, text):
    path.mkdir()
    (path / "f.txt").write_text(text)
    return path


def test_exchange_swaps_two_folders_in_one_step(tmp_path):
    a, b = _folder(tmp_path / "a", "new"), _folder(tmp_path / "b", "old")
    if not sys.platform.startswith("linux"):
        assert atomic.exchange_paths(a, b) is False
        return
    assert atomic.exchange_paths(a, b) is True
    assert (a / "f.txt").read_text() == "old" and (b / "f.txt").read_text() == "new"
    with pytest.raises(FileNotFoundError):
        atomic.exchange_paths(tmp_path / "missing", b)


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "rename-aside"])
def test_replace_dir_never_removes_the_live_folder(tmp_path, monkeypatch, exchange):
    """Every removal and rename of the swap finds ``dst`` complete (old or new content) except,
    without the exchange, the one rename that brings the new folder in; nothing is left over."""
    if exchange and not sys.platform.startswith("linux"):
        pytest.skip("renameat2 is Linux's")
    if not exchange:
        monkeypatch.setattr(atomic, "exchange_paths", lambda a, b: False)
    src, dst = _folder(tmp_path / ".new", "new"), _folder(tmp_path / "final", "old")
    seen = []
    real_rmtree, real_rename = atomic.shutil.rmtree, os.rename

    def rmtree(path, *args, **kwargs):
        seen.append(("rmtree", str(path), (dst / "f.txt").is_file()))
        return real_rmtree(path, *args, **kwargs)

    def rename(a, b):
        seen.append(("rename", str(a), (dst / "f.txt").is_file()))
        return real_rename(a, b)

    monkeypatch.setattr(atomic.shutil, "rmtree", rmtree)
    monkeypatch.setattr(os, "rename", rename)
    atomic.replace_dir(src, dst)
    assert (dst / "f.txt").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert all(path != str(dst) for kind, path, _ in seen if kind == "rmtree")
    missing = [(kind, path) for kind, path, present in seen if not present]
    assert missing == ([] if exchange else [("rename", str(src))])


def test_a_failed_swap_puts_the_old_folder_back(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "exchange_paths", lambda a, b: False)
    src, dst = _folder(tmp_path / ".new", "new"), _folder(tmp_path / "final", "old")
    real_rename = os.rename

    def rename(a, b):
        if str(a) == str(src):
            raise OSError(18, "Invalid cross-device link")
        return real_rename(a, b)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="cross-device"):
        atomic.replace_dir(src, dst)
    assert (dst / "f.txt").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == [".new", "final"]


def test_replace_dir_onto_nothing_is_a_rename(tmp_path):
    src = _folder(tmp_path / ".new", "new")
    atomic.replace_dir(src, tmp_path / "final")
    assert (tmp_path / "final" / "f.txt").read_text() == "new" and not src.exists()
