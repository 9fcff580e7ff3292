"""report_to= tracker sinks: the registry, the config, missing-library errors, and
what each installed backend wrote, read back from its files after a tiny training run."""

from __future__ import annotations

import glob
import importlib.util
import json
import struct

import pytest

from echotrain.train.config import ConfigError, resolve_config
from echotrain.train.metrics import MetricsLogger, read_jsonl
from echotrain.train.sinks import SINKS, Sink, parse_report_to, register_sink
from echotrain.train.trainer import Trainer

BASE = dict(steps=2, prompts_per_step=2, num_generations=4, max_new_tokens=6, micro_batch_size=8,
            num_mini_batches=1, lr=1e-2, device="cpu", progress=False, plots=False, save_final_model=False,
            eval_prompts=0, save_every=0)
KEYS = ("reward/mean", "accuracy", "ppo_kl", "grad_norm", "entropy", "echo/R_batch")


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def test_parse_report_to_and_unknown_name():
    assert parse_report_to("") == [] and parse_report_to("none") == []
    assert parse_report_to(" TensorBoard, wandb ,tensorboard") == ["tensorboard", "wandb"]
    with pytest.raises(ValueError, match="unknown backend 'mlflow'; valid: tensorboard, wandb, trackio"):
        parse_report_to("tensorboard,mlflow")
    with pytest.raises(ConfigError, match="unknown backend 'mlflow'"):
        resolve_config(overrides={"report_to": "mlflow"})


def test_missing_library_names_the_extra(monkeypatch):
    @register_sink("fake_missing", extra="fakeextra", module="echotrain_no_such_module")
    class Missing(Sink):
        pass

    try:
        with pytest.raises(ConfigError, match=r"report_to=fake_missing needs the echotrain_no_such_module package: "
                                              r"pip install 'echotrain\[fakeextra\]'"):
            resolve_config(overrides={"report_to": "fake_missing"})
        with pytest.raises(ImportError, match=r"echotrain\[fakeextra\]"):
            MetricsLogger("/nonexistent", report_to="fake_missing")
    finally:
        SINKS.unregister("fake_missing")
    if not installed("trackio"):
        with pytest.raises(ConfigError, match=r"pip install 'echotrain\[trackio\]'"):
            resolve_config(overrides={"report_to": "trackio"})


def test_a_new_backend_is_one_class(tmp_path):
    seen = []

    @register_sink("memory", extra="none", module="json")
    class MemorySink(Sink):
        def log(self, record, step):
            seen.append((step, record["reward/mean"]))

        def close(self):
            seen.append("closed")

    try:
        logger = MetricsLogger(tmp_path, report_to="memory")
        logger.log({"step": 1, "reward/mean": 0.25})
        logger.log({"step": 2, "reward/mean": 0.5})
        logger.close()
    finally:
        SINKS.unregister("memory")
    assert seen == [(1, 0.25), (2, 0.5), "closed"]
    assert [r["reward/mean"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0.25, 0.5]


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """A 2-step run with every installed sink on; returns (run_dir, metrics records)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import DigitTask, make_model, make_tokenizer

    names = [n for n in ("tensorboard", "wandb", "trackio") if installed(SINKS[n].module)]
    if not names:
        pytest.skip("no tracker library installed")
    out = tmp_path_factory.mktemp("tracked")
    import os

    os.environ["TRACKIO_DIR"] = str(out / "trackio")  # trackio's local store, not the user's cache
    tok = make_tokenizer()
    cfg = resolve_config(overrides={**BASE, "output_dir": str(out / "run"), "report_to": ",".join(names)})
    records = Trainer(cfg, model=make_model(tok), tokenizer=tok, task=DigitTask()).train()
    return out / "run", records


def test_tensorboard_scalars_read_back(tracked_run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, records = tracked_run
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    for key in KEYS:
        events = acc.Scalars(key)
        assert [e.step for e in events] == [1, 2]
        assert [e.value for e in events] == pytest.approx([r[key] for r in records], rel=1e-6, abs=1e-7)


def _wandb_records(path):
    """Records of a W&B offline run file (LevelDB-log framing of protobuf Records: 7-byte file
    header, 32 KiB blocks, 7-byte chunk headers crc32/length/type with FULL=1 FIRST=2 MIDDLE=3 LAST=4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def test_wandb_offline_history_read_back(tracked_run):
    pytest.importorskip("wandb")
    run_dir, records = tracked_run
    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = []
    for rec in _wandb_records(path):
        if rec.WhichOneof("record_type") == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    assert [h["_step"] for h in history] == [1, 2]
    for h, r in zip(history, records):
        for key in KEYS:
            assert h[key] == pytest.approx(r[key], rel=1e-12), key


def test_trackio_read_back(tracked_run):
    """Not run on the development machine (trackio 0.43 would downgrade pillow there): reads
    trackio's local SQLite store (``$TRACKIO_DIR/<project>.db``, table ``metrics``)."""
    pytest.importorskip("trackio")
    import os
    import sqlite3

    run_dir, records = tracked_run
    db = sqlite3.connect(os.path.join(os.environ["TRACKIO_DIR"], "echotrain.db"))
    rows = db.execute("SELECT step, metrics FROM metrics WHERE run_name = ? ORDER BY step", (run_dir.name,)).fetchall()
    assert [int(r[0]) for r in rows] == [1, 2]
    assert [json.loads(r[1])["reward/mean"] for r in rows] == pytest.approx([r["reward/mean"] for r in records])


# ---------------------------------------------------------------- resume
def test_tensorboard_resume_purges_the_steps_run_again(tmp_path, testbed_cache, capsys):
    """A run killed after step 3 with its last checkpoint at step 2, resumed: step 3 is logged
    again, and the event files read back hold each step once (purge_step), with the new values."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from echotrain import cli

    run = tmp_path / "run"
    args = ["model=testbed", "task=testbed", "prompts_per_step=2", "num_generations=2", "max_new_tokens=4",
            "micro_batch_size=4", "eval_prompts=0", "num_threads=1", "progress=false", "plots=false",
            "save_final_model=false", "report_to=tensorboard", "save_every=1", "keep_last=3", "steps=3"]
    assert cli.main(["train", *args, f"output_dir={run}"]) == 0
    (run / "checkpoints" / "step_00000003.pt").unlink()  # as if killed before step 3's checkpoint
    assert cli.main(["train", "--resume", str(run)]) == 0, capsys.readouterr().err
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert len(glob.glob(str(run / "tensorboard" / "events.out.tfevents.*"))) == 2  # one file per process
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    for key in ("reward/mean", "grad_norm", "lr"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [1, 2, 3], key
        assert [e.value for e in events] == pytest.approx([r[key] for r in records], rel=1e-6, abs=1e-7)


def test_tensorboard_sink_purge_step(monkeypatch, tmp_path):
    """The writer is opened with purge_step = start_step + 1 on resume, none on a new run."""
    pytest.importorskip("tensorboard")
    import torch.utils.tensorboard as tb

    seen = []

    class FakeWriter:
        def __init__(self, log_dir, purge_step=None):
            seen.append((log_dir, purge_step))

    monkeypatch.setattr(tb, "SummaryWriter", FakeWriter)
    SINKS["tensorboard"](tmp_path, {}, "p")
    SINKS["tensorboard"](tmp_path, {}, "p", start_step=7)
    assert seen == [(str(tmp_path / "tensorboard"), None), (str(tmp_path / "tensorboard"), 8)]


def test_wandb_resume_continues_the_same_run_id(monkeypatch, tmp_path):
    """The W&B run id is kept in <run>/wandb/run_id; a resumed run passes it with resume='allow'."""
    import importlib.machinery
    import sys
    import types

    from echotrain.train.sinks import WandbSink, build_sinks

    calls = []

    class FakeRun:
        def __init__(self, **kw):
            self.kw, self.logged = kw, []

        def log(self, values, step):
            self.logged.append((step, values))

        def finish(self):
            pass

    def init(**kw):
        calls.append(kw)
        return FakeRun(**kw)

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    (first,) = build_sinks(["wandb"], tmp_path, {"lr": 1}, "proj")
    first.log({"step": 1, "reward/mean": 0.5}, 1)
    first.close()
    run_id = (tmp_path / WandbSink.RUN_ID_FILE).read_text().strip()
    assert len(run_id) == 8 and set(run_id) <= set("0123456789abcdef")  # token_hex: may be all digits
    (second,) = build_sinks(["wandb"], tmp_path, {"lr": 1}, "proj", start_step=1)
    assert [c["id"] for c in calls] == [run_id, run_id]
    assert all(c["resume"] == "allow" and c["mode"] == "offline" and c["dir"] == str(tmp_path) for c in calls)
    other = tmp_path / "other"
    other.mkdir()
    build_sinks(["wandb"], other, {}, "proj")
    assert calls[-1]["id"] != run_id  # another run directory, another run
