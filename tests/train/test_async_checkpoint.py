"""Checkpoints written in a background thread (``async_save``): the snapshot, the writer, the trainer."""

from __future__ import annotations

import collections
import threading

import pytest
import torch

import echotrain.train.checkpoint as ckpt
from echotrain.runtime.checkpoints import list_checkpoints, load_checkpoint
from echotrain.train.checkpoint import CheckpointWriter, cpu_snapshot, save_checkpoint
from tests.train.conftest import Killed, kill_at

BASE = dict(steps=3, prompts_per_step=4, num_generations=4, max_new_tokens=8, micro_batch_size=8,
            num_mini_batches=2, lr=1e-2, temperature=1.0, device="cpu", progress=False, plots=False,
            save_final_model=False, log_samples=0, seed=0, eval_prompts=0)


def test_cpu_snapshot_copies_tensors_keeps_ties_types_and_metadata():
    w = torch.arange(6.0).view(2, 3)
    sd = collections.OrderedDict(embed=w, head=w, bias=torch.ones(3), row=w[1], t=(torch.zeros(2), [1, 2]))
    sd._metadata = {"": {"version": 1}}
    leaf = {"draws": [1, 2]}
    snap = cpu_snapshot({"model": sd, "data": leaf, "n": 3})
    w.add_(100)  # in-place updates after the snapshot (the optimizer's next step) do not reach it
    sd["bias"].zero_()
    leaf["draws"].append(3)
    m = snap["model"]
    assert type(m) is collections.OrderedDict and m._metadata == {"": {"version": 1}}
    assert m._metadata is not sd._metadata
    assert torch.equal(m["embed"], torch.arange(6.0).view(2, 3)) and torch.equal(m["bias"], torch.ones(3))
    assert m["embed"] is m["head"]  # tied: one tensor, written once by torch.save
    assert m["row"] is not m["embed"] and torch.equal(m["row"], torch.tensor([3.0, 4.0, 5.0]))
    assert type(m["t"]) is tuple and torch.equal(m["t"][0], torch.zeros(2)) and m["t"][1] == [1, 2]
    assert snap["data"] == {"draws": [1, 2]} and snap["n"] == 3


def test_cpu_snapshot_file_size_keeps_tied_weights_once(tmp_path):
    w = torch.randn(256, 256)
    torch.save(cpu_snapshot({"a": w, "b": w}), tmp_path / "tied.pt")
    torch.save(cpu_snapshot({"a": w, "b": w.clone()}), tmp_path / "two.pt")
    one, two = (tmp_path / "tied.pt").stat().st_size, (tmp_path / "two.pt").stat().st_size
    assert two - one > 0.9 * w.numel() * 4


def _opt_and_model(tiny_model):
    opt = torch.optim.AdamW(tiny_model.parameters(), lr=1e-2)
    for p in tiny_model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def test_background_write_holds_the_state_at_save_time(tmp_path, tiny_model, monkeypatch):
    """The file holds the parameters and AdamW moments of the moment save() was called, although
    the training thread changes them in place before the (slowed) write runs."""
    opt = _opt_and_model(tiny_model)
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    exp_avg = {i: s["exp_avg"].clone() for i, s in enumerate(opt.state.values())}
    release = threading.Event()
    write = ckpt.write_checkpoint

    def slow_write(*args, **kwargs):
        release.wait(10)
        return write(*args, **kwargs)

    monkeypatch.setattr(ckpt, "write_checkpoint", slow_write)
    writer = CheckpointWriter(background=True)
    path = writer.save(tmp_path, 7, model=tiny_model, optimizer=opt, scheduler=None, data_state={"draws": 7})
    assert writer.pending == path and not path.exists()  # returned before writing
    opt.step()  # the next update, in place
    release.set()
    writer.wait()
    assert writer.pending is None
    state = load_checkpoint(path)
    assert state["step"] == 7 and state["data"] == {"draws": 7}
    assert all(torch.equal(state["model"][k], before[k]) for k in before)
    assert any(not torch.equal(v, before[k]) for k, v in tiny_model.state_dict().items())  # it did move
    assert all(torch.equal(state["optimizer"]["state"][i]["exp_avg"], exp_avg[i]) for i in exp_avg)


def test_background_write_equals_a_synchronous_one(tmp_path, tiny_model):
    opt = _opt_and_model(tiny_model)
    torch.manual_seed(3)
    sync = save_checkpoint(tmp_path / "sync", 2, model=tiny_model, optimizer=opt, scheduler=None, data_state={})
    torch.manual_seed(3)
    writer = CheckpointWriter(background=True)
    bg = writer.save(tmp_path / "bg", 2, model=tiny_model, optimizer=opt, scheduler=None, data_state={})
    writer.wait()
    a, b = load_checkpoint(sync), load_checkpoint(bg)
    assert a.keys() == b.keys() and a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    for i, s in a["optimizer"]["state"].items():
        assert all(torch.equal(s[k], b["optimizer"]["state"][i][k]) for k in s)


def test_writer_keeps_last_k_and_one_write_at_a_time(tmp_path, tiny_model):
    opt = _opt_and_model(tiny_model)
    writer = CheckpointWriter(background=True)
    for step in (1, 2, 3):
        writer.save(tmp_path, step, model=tiny_model, optimizer=opt, scheduler=None, data_state={}, keep_last=2)
    writer.wait()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002.pt", "step_00000003.pt"]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if "tmp" in p.name]
    with pytest.raises(ValueError, match="keep_last"):
        writer.save(tmp_path, 4, model=tiny_model, optimizer=opt, scheduler=None, data_state={}, keep_last=0)


def test_synchronous_writer_writes_before_returning(tmp_path, tiny_model):
    opt = _opt_and_model(tiny_model)
    writer = CheckpointWriter(background=False)
    path = writer.save(tmp_path, 1, model=tiny_model, optimizer=opt, scheduler=None, data_state={})
    assert path.is_file() and writer.pending is None


def test_a_failed_background_write_raises_from_wait_and_next_save(tmp_path, tiny_model):
    opt = _opt_and_model(tiny_model)
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")  # checkpoints/ cannot be created under it
    writer = CheckpointWriter(background=True)
    writer.save(blocked, 1, model=tiny_model, optimizer=opt, scheduler=None, data_state={})
    with pytest.raises(RuntimeError, match="writing checkpoint .*step_00000001.pt failed") as info:
        writer.wait()
    assert isinstance(info.value.__cause__, OSError)
    writer.wait()  # reported once
    writer.save(blocked, 2, model=tiny_model, optimizer=opt, scheduler=None, data_state={})
    with pytest.raises(RuntimeError, match="step_00000002.pt"):
        writer.save(tmp_path, 3, model=tiny_model, optimizer=opt, scheduler=None, data_state={})


def test_async_save_is_the_default_and_runs_resume_exactly(build_trainer, tmp_path):
    """The default trainer writes in the background; a run resumed from such a checkpoint
    continues exactly as the uninterrupted run, and as one written synchronously."""
    full = build_trainer(BASE, "full", save_every=1, keep_last=3)
    assert full.cfg.async_save and full.checkpoints.background
    records = full.train()
    sync = build_trainer(BASE, "sync", save_every=1, async_save=False)
    assert not sync.checkpoints.background
    sync_records = sync.train()
    a = load_checkpoint(tmp_path / "full" / "checkpoints" / "step_00000003.pt")
    b = load_checkpoint(tmp_path / "sync" / "checkpoints" / "step_00000003.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    (tmp_path / "full" / "checkpoints" / "step_00000003.pt").unlink()  # resume from step 2's
    resumed = build_trainer(BASE, "full", resume=True, save_every=1)
    assert resumed.start_step == 2
    again = resumed.train()
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "memory/"))}
    assert [strip(r) for r in again] == [strip(r) for r in records]
    assert [strip(r) for r in sync_records] == [strip(r) for r in records]


def test_a_failing_step_finishes_the_checkpoint_in_flight(build_trainer, tmp_path, monkeypatch):
    """A step that raises after a background save began: train() waits for that write before the
    error leaves it, so the checkpoint is complete when the caller sees the error."""
    write = ckpt.write_checkpoint
    release = threading.Event()

    def slow_write(*args, **kwargs):
        release.wait(10)  # step 1's write starts only once step 2 has failed
        return write(*args, **kwargs)

    monkeypatch.setattr(ckpt, "write_checkpoint", slow_write)

    with pytest.raises(Killed):  # step 1's write starts only once step 2 has failed
        build_trainer(BASE, "killed", save_every=1, callbacks=[kill_at(2, before=release.set)]).train()
    assert [p.name for p in list_checkpoints(tmp_path / "killed")] == ["step_00000001.pt"]
    assert load_checkpoint(tmp_path / "killed" / "checkpoints" / "step_00000001.pt")["step"] == 1


def test_cli_writes_the_same_checkpoints_with_and_without_async_save(tmp_path, testbed_cache):
    """`echotrain train ... [async_save=false]` on the testbed: the background writer and the
    synchronous one leave the same files (keep-last 2 of 3), the same tensors in them."""
    from echotrain import cli

    run = ["model=testbed", "task=testbed", "steps=3", "save_every=1", "keep_last=2", "prompts_per_step=2",
           "num_generations=2", "max_new_tokens=4", "micro_batch_size=4", "eval_prompts=0", "num_threads=1",
           "progress=false", "plots=false", "save_final_model=false"]
    assert cli.main(["train", *run, f"output_dir={tmp_path / 'bg'}"]) == 0
    assert cli.main(["train", *run, "async_save=false", f"output_dir={tmp_path / 'sync'}"]) == 0
    names = [[p.name for p in list_checkpoints(tmp_path / r)] for r in ("bg", "sync")]
    assert names[0] == names[1] == ["step_00000002.pt", "step_00000003.pt"]
    for name in names[0]:
        a, b = (load_checkpoint(tmp_path / r / "checkpoints" / name) for r in ("bg", "sync"))
        assert a["step"] == b["step"] and a["model"].keys() == b["model"].keys()
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_cpu_snapshot_ties_only_the_very_same_view():
    """Only tensors that are the same view (storage, offset, shape, strides, dtype) become one:
    two rows of one matrix, the matrix, its flat view, its transpose and a reinterpretation
    as int32 stay separate tensors with their own values."""
    w = torch.arange(9.0).view(3, 3)
    views = {"r0": w[0], "r1": w[1], "full": w, "flat": w.view(9), "t": w.t(), "int": w.view(torch.int32),
             "full2": w}
    expected = {k: v.clone() for k, v in views.items()}
    snap = cpu_snapshot(views)
    for k, v in expected.items():
        assert snap[k].dtype == v.dtype and snap[k].shape == v.shape and torch.equal(snap[k], v), k
    assert torch.equal(snap["r1"], torch.tensor([3.0, 4.0, 5.0]))
    assert torch.equal(snap["t"][0], torch.tensor([0.0, 3.0, 6.0]))
    assert snap["full2"] is snap["full"]  # the same view: one tensor
    assert len({id(v) for k, v in snap.items() if k != "full2"}) == 6


def test_cpu_snapshot_copies_other_leaves_and_keeps_named_tuples():
    """Leaves that are neither dicts, lists, tuples nor tensors (a numpy array, a set, a named
    tuple) are copies: changing the originals in place afterwards does not reach the snapshot."""
    import numpy as np

    Pair = collections.namedtuple("Pair", "a b")
    arr, seen = np.arange(4), {1, 2}
    pair = Pair(torch.ones(2), [7])
    snap = cpu_snapshot({"arr": arr, "seen": seen, "pair": pair})
    arr[0] = 100
    seen.add(3)
    pair.a.zero_()
    pair.b.append(8)
    assert snap["arr"].tolist() == [0, 1, 2, 3] and snap["seen"] == {1, 2}
    assert type(snap["pair"]) is Pair and torch.equal(snap["pair"].a, torch.ones(2)) and snap["pair"].b == [7]


def test_write_checkpoint_refuses_keep_last_0_before_writing(tmp_path, tiny_model):
    opt = _opt_and_model(tiny_model)
    state = ckpt.checkpoint_state(1, model=tiny_model, optimizer=opt, scheduler=None, data_state={})
    with pytest.raises(ValueError, match="keep_last must be >= 1, got 0"):
        ckpt.write_checkpoint(state, tmp_path, keep_last=0)
    assert not (tmp_path / "checkpoints").exists()


def test_synchronous_writer_keeps_last_k(tmp_path, tiny_model):
    opt = _opt_and_model(tiny_model)
    writer = CheckpointWriter(background=False)
    for step in (1, 2, 3):
        writer.save(tmp_path, step, model=tiny_model, optimizer=opt, scheduler=None, data_state={}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002.pt", "step_00000003.pt"]


def test_pending_ends_with_the_thread_which_is_not_a_daemon(tmp_path, tiny_model, monkeypatch):
    """pending names the file while the write runs and is None once the thread has finished,
    even before wait(); the thread is not a daemon (the interpreter waits for it at exit)."""
    opt = _opt_and_model(tiny_model)
    release = threading.Event()
    write = ckpt.write_checkpoint
    monkeypatch.setattr(ckpt, "write_checkpoint", lambda *a, **k: release.wait(10) and write(*a, **k))
    writer = CheckpointWriter(background=True)
    path = writer.save(tmp_path, 5, model=tiny_model, optimizer=opt, scheduler=None, data_state={})
    [thread] = [t for t in threading.enumerate() if t.name == "echotrain-checkpoint-5"]
    assert writer.pending == path and thread.daemon is False
    release.set()
    thread.join(10)
    assert writer.pending is None and path.is_file()
    writer.wait()


def test_a_background_write_interrupted_by_a_base_exception_raises_from_wait(tmp_path, tiny_model, monkeypatch):
    """Not only Exceptions: a KeyboardInterrupt (BaseException) in the write thread reaches the
    training thread through wait()."""
    opt = _opt_and_model(tiny_model)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt, "write_checkpoint", interrupted)
    writer = CheckpointWriter(background=True)
    writer.save(tmp_path, 1, model=tiny_model, optimizer=opt, scheduler=None, data_state={})
    with pytest.raises(RuntimeError, match="step_00000001.pt failed") as info:
        writer.wait()
    assert isinstance(info.value.__cause__, KeyboardInterrupt)


def _slow_writes(monkeypatch, seconds=0.5):
    import time

    write = ckpt.write_checkpoint

    def slow_write(*args, **kwargs):
        time.sleep(seconds)
        return write(*args, **kwargs)

    monkeypatch.setattr(ckpt, "write_checkpoint", slow_write)


def test_train_returns_once_the_last_checkpoint_is_written(build_trainer, tmp_path, monkeypatch):
    """The last checkpoint is written in the background while the final outputs are made, and
    complete when train() returns (also when its write is slower than the final outputs)."""
    _slow_writes(monkeypatch)
    build_trainer(BASE, "slow", steps=2).train()
    assert [p.name for p in list_checkpoints(tmp_path / "slow")] == ["step_00000002.pt"]
    assert load_checkpoint(tmp_path / "slow" / "checkpoints" / "step_00000002.pt")["step"] == 2


def test_failing_final_outputs_still_finish_the_last_checkpoint(build_trainer, tmp_path, monkeypatch):
    _slow_writes(monkeypatch)
    t = build_trainer(BASE, "final", steps=2)

    def boom():
        raise OSError("disk full")

    monkeypatch.setattr(t, "_final_outputs", boom)
    with pytest.raises(OSError, match="disk full"):
        t.train()
    assert load_checkpoint(tmp_path / "final" / "checkpoints" / "step_00000002.pt")["step"] == 2


def test_trainer_checkpoint_holds_the_scheduler_state(build_trainer, tmp_path):
    """The checkpoint's scheduler state is the trainer's after the step: its count of optimizer
    steps (two mini-batch updates a step)."""
    t = build_trainer(BASE, "sched", steps=2, lr_scheduler="cosine")
    t.train()
    state = load_checkpoint(tmp_path / "sched" / "checkpoints" / "step_00000002.pt")
    assert state["scheduler"] is not None
    assert state["scheduler"]["last_epoch"] == t.scheduler.last_epoch == 4
    assert state["scheduler"]["_last_lr"] == t.scheduler.get_last_lr()


def test_tensor_bytes_counts_each_view_once():
    w = torch.zeros(4, 8)
    assert ckpt.tensor_bytes({"a": w, "b": w, "c": [torch.zeros(3, dtype=torch.float64)], "d": 5}) == 4 * 8 * 4 + 3 * 8


def test_available_memory_reads_meminfo():
    avail = ckpt.available_memory()
    assert avail is None or avail > 0


def test_a_copy_larger_than_half_the_free_memory_is_written_within_the_step(tmp_path, tiny_model, monkeypatch,
                                                                            caplog):
    """Where the CPU copy would take more than half of the available memory, the writer warns once
    and writes synchronously from then on (no thread, no copy); with room it writes in the background."""
    opt = _opt_and_model(tiny_model)
    need = ckpt.tensor_bytes(ckpt.checkpoint_state(1, model=tiny_model, optimizer=opt, scheduler=None, data_state={}))
    monkeypatch.setattr(ckpt, "available_memory", lambda: 2 * need)  # exactly half: fits
    writer = CheckpointWriter(background=True)
    writer.save(tmp_path, 1, model=tiny_model, optimizer=opt, scheduler=None, data_state={})
    assert writer.background and writer._thread is not None
    writer.wait()
    monkeypatch.setattr(ckpt, "available_memory", lambda: 2 * need - 1)
    monkeypatch.setattr(ckpt, "cpu_snapshot", lambda state: pytest.fail("no copy when it does not fit"))
    with caplog.at_level("WARNING", logger="echotrain.train"):
        path = writer.save(tmp_path, 2, model=tiny_model, optimizer=opt, scheduler=None, data_state={})
        assert path.is_file() and writer.pending is None and not writer.background
        writer.save(tmp_path, 3, model=tiny_model, optimizer=opt, scheduler=None, data_state={})
    assert len([r for r in caplog.records if "async_save" in r.getMessage()]) == 1  # warned once
    assert "more than half of the available memory" in caplog.text
    monkeypatch.setattr(ckpt, "available_memory", lambda: None)  # unknown: background as configured
    assert CheckpointWriter(background=True)._copy_fits({"w": torch.zeros(10)})
