"""What is guaranteed about reproducibility (issue 10, item 3), tested on the tiny model.

Guaranteed: the same config (seed included), device, thread count, machine and library versions
give bit-identical metrics (all but the time/throughput/memory keys), samples, evaluations and
weights, in one process or in fresh processes with different PYTHONHASHSEED; a different seed
gives a different run. Not guaranteed (README "Reproducibility"): other thread counts, CPU
models, library versions or GPUs, and reward timeouts (load-dependent; counted in
``reward/timeouts``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from echotrain.train.config import resolve_config
from echotrain.train.metrics import NONDETERMINISTIC_PREFIXES, read_jsonl
from echotrain.train.trainer import Trainer

BASE = dict(steps=3, prompts_per_step=4, num_generations=4, max_new_tokens=6, micro_batch_size=4, num_mini_batches=2,
            lr=1e-2, temperature=1.0, device="cpu", progress=False, plots=False, save_final_model=False,
            eval_prompts=4, log_samples=4, save_every=0)


def _strip(records):
    return [{k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC_PREFIXES)} for r in records]


def _run(tmp_path, name, tokenizer, make_model, task, **over):
    cfg = resolve_config(overrides={**BASE, "output_dir": str(tmp_path / name), **over})
    trainer = Trainer(cfg, model=make_model(tokenizer), tokenizer=tokenizer, task=task)
    records = trainer.train()
    d = trainer.run_dir
    return (_strip(records), read_jsonl(d / "samples.jsonl"), _strip(read_jsonl(d / "eval.jsonl")),
            {k: v.detach().clone() for k, v in trainer.model.state_dict().items()})


def test_same_seed_same_run_different_seed_different_run(tmp_path, tiny_tokenizer, make_tiny_model, digit_task):
    a = _run(tmp_path, "a", tiny_tokenizer, make_tiny_model, digit_task, seed=3)
    b = _run(tmp_path, "b", tiny_tokenizer, make_tiny_model, digit_task, seed=3)
    c = _run(tmp_path, "c", tiny_tokenizer, make_tiny_model, digit_task, seed=4)
    assert a[0] == b[0] and a[1] == b[1] and a[2] == b[2]  # metrics, samples, evals: exactly equal
    assert all(torch.equal(a[3][k], b[3][k]) for k in a[3])  # weights bit-identical
    assert a[1] != c[1] and any(not torch.equal(a[3][k], c[3][k]) for k in a[3])  # the seed matters
    assert len({s["group"] for s in a[1] if s["step"] == 1}) == 4  # samples.jsonl covers 4 prompts per step


SCRIPT = r"""
import sys, torch
sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
from conftest import DigitTask, make_model, make_tokenizer
from echotrain.train.config import resolve_config
from echotrain.train.trainer import Trainer
cfg = resolve_config(overrides={{**{base!r}, "output_dir": sys.argv[1], "seed": 5}})
tok = make_tokenizer()
Trainer(cfg, model=make_model(tok), tokenizer=tok, task=DigitTask()).train()
"""


def test_fresh_processes_with_different_hash_seeds_agree(tmp_path):
    code = SCRIPT.format(tests=str(Path(__file__).parent), base=BASE)
    outs = []
    for hash_seed in ("1", "2"):
        d = tmp_path / f"p{hash_seed}"
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "OMP_NUM_THREADS": "1"}
        res = subprocess.run([sys.executable, "-c", code, str(d)], env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        outs.append((_strip(read_jsonl(d / "metrics.jsonl")), (d / "samples.jsonl").read_text(),
                     _strip(read_jsonl(d / "eval.jsonl"))))
    assert outs[0] == outs[1]
    assert json.loads(outs[0][1].splitlines()[0])["step"] == 1
