"""Fingerprint of every policy loss under its settings, recorded before the loss settings moved from
PolicyLossConfig fields into the losses' registrations (issue 36 item 13), and a config round trip.

``tests/rl/data/loss_settings_fingerprint.json`` holds, for every loss x {default settings, every
moved setting at a non-default value (by its flat name), a rollout correction} x 3 aggregation
modes, the loss value, the sum and the sum of squares of the gradient and the sum of the metrics,
plus the micro-batched step losses, computed by :func:`fingerprint` on commit 323fa4d (before the
move). The same inputs must give the same numbers (float64; rtol 1e-12), so the refactor changed no
loss, gradient or metric. A loss registered later has no entry and is not compared; a deliberate
change of a loss's math regenerates the file (``python tests/rl/test_rl_settings_fingerprint.py``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from echotrain.rl import POLICY_LOSSES, compute_policy_loss, compute_step_stats, split_micro_batches

DATA = Path(__file__).parent / "data" / "loss_settings_fingerprint.json"
#: every setting that moved, at a non-default value, by its flat name (as configs and adapters name them)
NONDEFAULT = dict(tau_pos=1.3, tau_neg=0.9, cispo_lower_clip=False, clip_cov_ratio=0.5, clip_cov_lb=-0.1,
                  clip_cov_ub=0.5, kl_cov_ratio=0.2, ppo_kl_coef=0.4, dro_beta=0.25, vespo_k_pos=1.5,
                  vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5, batch_clip_low=0.001,
                  batch_clip_high=0.002, batch_ratio="arith", detach_kappa=True, echo_pessimistic=True,
                  echo_token_clip="truncate", echo_token_cap=1.5)
CASES = {"default": {}, "nondefault": NONDEFAULT,
         "corr": dict(rollout_correction="token_is,rejection", rollout_rs_threshold=1.5)}
AGGS = ("token-mean", "seq-mean-token-mean", "balanced")


def _inputs():
    g = torch.Generator().manual_seed(0)
    B, T = 10, 7
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[1] = 0
    mask = torch.arange(T) < lengths[:, None]
    old = -3 * torch.rand(B, T, generator=g, dtype=torch.float64) - 0.01
    log_prob = old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    roll = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T) * mask
    return old, log_prob, roll, adv, mask, torch.arange(B) // 2


def fingerprint(loss_mode: str) -> dict[str, list[float]]:
    """``{case/agg: [loss, sum grad, sum grad^2, sum metrics], "step": [micro-batch losses]}``."""
    old, lp0, roll, adv, mask, gi = _inputs()
    out = {}
    for name, cfg in CASES.items():
        for agg in AGGS:
            lp = lp0.clone().requires_grad_(True)
            extra = {"rollout_log_prob": roll} if name == "corr" else {}
            loss, m = compute_policy_loss(loss_mode, old, lp, adv, mask, agg, {**cfg, "norm_constant": 7.0},
                                          group_index=gi, **extra)
            loss.backward()
            out[f"{name}/{agg}"] = [float(loss), float(lp.grad.sum()), float(lp.grad.square().sum()),
                                    float(sum(m.values()))]
    batch = {"old_log_prob": old, "log_prob": lp0, "advantages": adv, "response_mask": mask, "group_index": gi}
    mbs = split_micro_batches(batch, [3, 4, 3])
    step = compute_step_stats(mbs, loss_mode=loss_mode, loss_agg_mode="token-mean", config=NONDEFAULT)
    out["step"] = [float(compute_policy_loss(loss_mode, mb["old_log_prob"], mb["log_prob"], mb["advantages"],
                                             mb["response_mask"], "token-mean", NONDEFAULT,
                                             group_index=mb["group_index"], step=step)[0]) for mb in mbs]
    return out


RECORDED = json.loads(DATA.read_text()) if DATA.exists() else {}


@pytest.mark.parametrize("loss_mode", sorted(RECORDED))
def test_every_loss_matches_its_recorded_fingerprint(loss_mode):
    if loss_mode not in POLICY_LOSSES:
        pytest.fail(f"{loss_mode} is recorded but no longer registered")
    now = fingerprint(loss_mode)
    assert now.keys() == RECORDED[loss_mode].keys()
    for key, values in RECORDED[loss_mode].items():
        assert now[key] == pytest.approx(values, rel=1e-12, abs=1e-14), f"{loss_mode} {key}"


def test_the_record_covers_the_built_in_losses():
    assert set(RECORDED) >= {"vanilla", "gspo", "gspo_token", "echo", "cispo", "sapo", "geo_mean", "dppo_tv",
                             "dppo_kl", "gpg", "clip_cov", "kl_cov", "dro", "luspo", "vespo"}


def test_flat_settings_round_trip_through_the_trainer_config():
    """The moved settings by their flat names: CLI tokens -> TrainConfig -> config.yaml dict -> TrainConfig,
    and the PolicyLossConfig the run uses reads each one back."""
    from echotrain.train.config import parse_overrides, resolve_config

    tokens = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in NONDEFAULT.items()]
    cfg = resolve_config(overrides=parse_overrides(tokens + ["loss_mode=echo"]))
    again = resolve_config(cfg.to_dict())
    assert again == cfg and again.to_dict() == cfg.to_dict()
    plc = again.policy_loss_config()
    assert {k: getattr(plc, k) for k in NONDEFAULT} == NONDEFAULT


if __name__ == "__main__":  # regenerate the record (after a deliberate change of a loss's math)
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(json.dumps({m: fingerprint(m) for m in sorted(POLICY_LOSSES)}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {DATA}", file=sys.stderr)
