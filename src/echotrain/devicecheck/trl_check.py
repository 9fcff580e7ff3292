"""The TRL adapter with vLLM in ``echotrain device-check``: :class:`EchoGRPOTrainer` generating
with vLLM (``use_vllm=True``, ``vllm_mode="colocate"``: vLLM in this process, on this GPU), so the
sampler's own per-token log-probs (TRL's ``sampling_per_token_logps``) reach echotrain's loss
as ``rollout_log_prob`` (``rollout_correction=token_is``) and the rollout-mismatch metrics
(``rollout_corr/*``: |log mu - log pi_old|, KL, ESS) are logged.

vLLM is the ``vllm`` extra of pyproject.toml (pinned to the newest version TRL 1.16 accepts,
0.31.0). It needs a CUDA GPU and ships its own torch build: install it into the GPU machine's
environment (``pip install -e '.[trl,vllm]'``); the check is skipped with the reason when vLLM
does not import, TRL refuses its version, or there is no GPU.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from echotrain.devicecheck.common import Context, require


class Skipped(Exception):
    """A check that cannot run here; the message is the reason (recorded in the summary)."""


def vllm_unavailable(ctx: Context) -> str | None:
    """Why the TRL + vLLM check cannot run here, or None when it can."""
    if not ctx.is_cuda:
        return "vLLM needs a CUDA GPU (dry run on the CPU)"
    if importlib.util.find_spec("trl") is None:
        return "TRL is not installed (pip install -e '.[trl]')"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (pip install -e '.[vllm]')"
    from trl.import_utils import is_vllm_available

    try:
        if not is_vllm_available():
            return "TRL does not accept the installed vLLM version"
    except Exception as exc:  # noqa: BLE001  (an import error inside vLLM: the reason is the message)
        return f"vLLM does not import: {type(exc).__name__}: {exc}"[:300]
    return None


def _reward(prompts, completions, **kwargs) -> list[float]:
    """1.0 for a completion that contains a digit (a reward with signal for any chat model)."""
    return [float(any(ch.isdigit() for ch in c[-1]["content"])) for c in completions]


def check_trl_vllm(ctx: Context) -> dict[str, Any]:
    """Two GRPO steps of :class:`~echotrain.integrations.trl.EchoGRPOTrainer` with vLLM on the
    default model; asserts the steps ran, the rollout-mismatch metrics were logged and are
    finite, and the weights moved.

    Raises:
        Skipped: :func:`vllm_unavailable` gives a reason.
    """
    why = vllm_unavailable(ctx)
    if why is not None:
        raise Skipped(why)
    import math

    import torch
    from datasets import Dataset

    from echotrain.integrations.trl import EchoGRPOConfig, EchoGRPOTrainer
    from echotrain.models.gguf import load_embedded

    path = str(load_embedded())
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} + {i + 3}? Answer with a number."}]}
                            for i in range(32)])
    args = EchoGRPOConfig(output_dir=str(ctx.out / "trl_vllm"), report_to="none", save_strategy="no",
                          logging_steps=1, bf16=True, seed=0, per_device_train_batch_size=8,
                          gradient_accumulation_steps=2, num_generations=8, max_completion_length=32,
                          max_steps=2, learning_rate=1e-6, use_vllm=True, vllm_mode="colocate",
                          vllm_gpu_memory_utilization=0.3, rollout_correction="token_is", loss_mode="echo")
    trainer = EchoGRPOTrainer(model=path, reward_funcs=[_reward], args=args, train_dataset=ds)
    before = [p.detach().float().clone() for p in trainer.model.parameters()]
    trainer.train()
    moved = sum(int(not torch.equal(a, p.detach().float())) for a, p in zip(before, trainer.model.parameters()))
    # TRL averages its _metrics into each log record and clears them: read the records
    last = {k: float(v) for rec in trainer.state.log_history for k, v in rec.items() if "rollout_corr" in k}
    out = {"steps": trainer.state.global_step, "mismatch_metrics": last, "vllm_mode": "colocate", "moved": moved}
    require(trainer.state.global_step == 2, f"TRL ran {trainer.state.global_step} steps, expected 2", out)
    require(moved > 0, "no parameter moved", out)
    require(any("log_prob_abs_diff" in k for k in last), f"no rollout-mismatch metric logged: {sorted(last)}", out)
    require(all(math.isfinite(v) for v in last.values()), f"non-finite mismatch metrics: {last}", out)
    return out
