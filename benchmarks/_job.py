"""What the rollout benchmarks share: the default job's options and its model, tokenizer and first-step
prompts (``bench_decode_loop``, ``bench_rollout_autocast``, ``bench_packing``).

A script imports it from its own folder (``benchmarks/`` need not be a package)::

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _job import add_job_arguments, load_job
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: command-line option -> the job's setting it overrides (None: the default job's value)
JOB_OPTIONS = {"model": "model", "task": "task", "prompts": "prompts_per_step", "generations": "num_generations",
               "max_new_tokens": "max_new_tokens"}


def add_job_arguments(ap: argparse.ArgumentParser, *, threads: int = 2, reps: int | None = 5) -> None:
    """Add ``--threads``, ``--reps`` (left out when ``reps`` is None: a script that times nothing)
    and the job options of :data:`JOB_OPTIONS` to ``ap``."""
    ap.add_argument("--threads", type=int, default=threads)
    if reps is not None:
        ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--model", default=None, help="model= (default: the default job's)")
    ap.add_argument("--task", default=None, help="task= (default: the default job's)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts_per_step= (default: the default job's)")
    ap.add_argument("--generations", type=int, default=None, help="num_generations= (default: the default job's)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="max_new_tokens= (default: the default job's)")


def load_job(args: argparse.Namespace, **overrides: Any) -> SimpleNamespace:
    """Set the OpenMP wait policy and ``args.threads``, resolve the job (the options of
    :data:`JOB_OPTIONS` that are set, then ``overrides`` whose value is not None), load its model and
    tokenizer and draw its first step's prompts.

    Returns:
        ``SimpleNamespace(cfg, model, tokenizer, messages, wait)``: the resolved ``TrainConfig``,
        the policy and tokenizer of ``cfg.model``, the chat messages of ``cfg.prompts_per_step``
        prompts of ``cfg.task`` drawn with ``cfg.seed``, and the OpenMP wait policy set (text).
    """
    from echotrain.cli import set_omp_wait_policy

    wait = set_omp_wait_policy()
    import torch

    torch.set_num_threads(args.threads)
    from echotrain.models import load_policy
    from echotrain.tasks import get_task
    from echotrain.train.config import resolve_config

    over = {key: getattr(args, opt) for opt, key in JOB_OPTIONS.items() if getattr(args, opt) is not None}
    over.update({k: v for k, v in overrides.items() if v is not None})
    cfg = resolve_config(overrides=over)
    model, tok = load_policy(cfg.model)
    task = get_task(cfg.task, **cfg.task_options)
    messages = [ex.messages for ex in task.sample(cfg.prompts_per_step, cfg.seed)]
    return SimpleNamespace(cfg=cfg, model=model, tokenizer=tok, messages=messages, wait=wait)
