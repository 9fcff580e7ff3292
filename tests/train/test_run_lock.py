"""The run directory's lock (train/run_lock.py): taken by the trainer before a model loads, held
through ``train()``, re-entrant within a process, released on return and on a raise; a holder in
another process is named by pid. The CLI side is in tests/compare/test_one_writer.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import echotrain
from echotrain.train import run_lock
from tests.train.conftest import Killed, kill_at

BASE = dict(steps=2, prompts_per_step=2, num_generations=2, max_new_tokens=4, eval_prompts=0, progress=False,
            plots=False, save_final_model=False, save_every=0)


def test_reentrant_in_a_process_and_free_after_the_last_release(tmp_path):
    run_dir = tmp_path / "run"
    assert run_lock.lock_holder(run_dir) is None  # no directory, no lock file
    first = run_lock.lock_run_dir(run_dir)
    second = run_lock.lock_run_dir(run_dir)  # a second Trainer in the same process
    assert (run_dir / run_lock.LOCK_FILE).read_text() == f"{os.getpid()}\n"
    first.release()
    first.release()  # a second release of one hold changes nothing
    assert run_lock.lock_holder(run_dir) == os.getpid() and second.held and not first.held
    second.release()
    assert run_lock.lock_holder(run_dir) is None
    run_lock.lock_run_dir(run_dir).release()  # free again; the file stays
    assert (run_dir / run_lock.LOCK_FILE).is_file()


def test_another_process_is_refused_with_this_pid(tmp_path):
    run_dir = tmp_path / "run"
    held = run_lock.lock_run_dir(run_dir)
    try:
        code = ("import sys; from echotrain.train.run_lock import RunDirBusy, lock_run_dir\n"
                "try:\n    lock_run_dir(sys.argv[1])\nexcept RunDirBusy as exc:\n    print(exc.pid, exc)\n")
        env = {**os.environ, "PYTHONPATH": str(Path(echotrain.__file__).resolve().parents[1])}
        out = subprocess.run([sys.executable, "-c", code, str(run_dir)], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.stdout.startswith(f"{os.getpid()} output_dir={str(run_dir)!r} is being written by another "
                                     f"process (pid {os.getpid()}, lock {run_dir / run_lock.LOCK_FILE})"), out.stderr
    finally:
        held.release()


def test_the_trainer_holds_the_lock_while_training_and_releases_it(build_trainer, tmp_path):
    seen = []
    trainer = build_trainer(BASE, callbacks=[lambda step, record: seen.append(run_lock.lock_holder(tmp_path / "run"))])
    assert run_lock.lock_holder(tmp_path / "run") == os.getpid()  # from the constructor on
    trainer.train()
    assert seen == [os.getpid(), os.getpid()] and run_lock.lock_holder(tmp_path / "run") is None
    with pytest.raises(Killed):  # a raise releases it too; a resumed trainer takes it again
        build_trainer(BASE, name="killed", save_every=1, callbacks=[kill_at(2)]).train()
    assert run_lock.lock_holder(tmp_path / "killed") is None
    resumed = build_trainer(BASE, name="killed", resume=True)
    assert run_lock.lock_holder(tmp_path / "killed") == os.getpid()
    resumed.train()
    assert run_lock.lock_holder(tmp_path / "killed") is None
