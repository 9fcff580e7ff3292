"""Rollout corrections side by side with verl 0.9.1's ``rollout_corr_helper``: same weights,
same masks, same metrics on random batches with masked rows and extreme log-ratios.

The documented differences (docs/design/objectives.md §8) are asserted as such, not skipped.
verl is an optional test dependency; without it these tests skip with the import error.
"""

from __future__ import annotations

import pytest
import torch

try:
    from verl.trainer.ppo import rollout_corr_helper as verl_rc
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"verl parity tests: {exc}", allow_module_level=True)

from echotrain.rl.config import RS_STATISTICS
from echotrain.rl.correction import apply_rollout_correction

TOL = dict(rtol=1e-7, atol=1e-12)
#: verl's masked_mean divides by (count + 1e-8): its means differ from exact ones by ~1e-8 / count.
REL = 1e-7


def _batch(seed, B=10, T=8, extreme=True):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = T, 0  # a full row and an empty (masked) row
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    roll = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    if extreme:  # token log-ratios of +-30 (beyond the +-20 safety bound) and a sequence sum beyond it
        roll[0, 0], roll[0, 1] = old[0, 0] - 30.0, old[0, 1] + 30.0
        roll[2, : int(lengths[2])] = old[2, : int(lengths[2])] - 6.0
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T)
    return old, roll, adv, mask


def _ours(old, roll, adv, mask, **cfg):
    return apply_rollout_correction(old, roll, adv, mask, cfg)


def _verl(old, roll, mask, **kw):
    w, new_mask, metrics = verl_rc.compute_rollout_correction_and_rejection_mask(old, roll, mask, **kw)
    return (None if w is None else w.batch["rollout_is_weights"]), new_mask, metrics


# (our correction, our settings, verl's rollout_is and threshold spec)
IS_CASES = [
    ("token_is", dict(rollout_is_threshold=2.0), "token", 2.0),
    ("seq_is", dict(rollout_is_threshold=5.0), "sequence", 5.0),
    ("token_mask", dict(rollout_is_threshold=2.0, rollout_is_threshold_lower=0.5), "token", "0.5_2.0"),
    ("seq_mask", dict(rollout_is_threshold=3.0, rollout_is_threshold_lower=0.3), "sequence", "0.3_3.0"),
    # decoupled PPO uncapped = verl's decoupled mode with no effective truncation (exp(20) < 1e9)
    ("decoupled", dict(), "token", 1e9),
]


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "batch-normalized"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name,settings,level,spec", IS_CASES, ids=[c[0] for c in IS_CASES])
def test_is_weights_and_metrics_match_verl(name, settings, level, spec, seed, normalize):
    old, roll, adv, mask = _batch(seed)
    ours = _ours(old, roll, adv, mask, rollout_correction=name, rollout_is_batch_normalize=normalize, **settings)
    w, new_mask, vm = _verl(old, roll, mask, rollout_is=level, rollout_is_threshold=spec,
                            rollout_is_batch_normalize=normalize)
    torch.testing.assert_close(ours.rollout_is_weights, w * mask, **TOL)
    assert torch.equal(ours.response_mask, new_mask.bool())
    m = ours.metrics
    assert m["rollout_corr/is_mean"] == pytest.approx(vm["rollout_corr/rollout_is_mean"], rel=REL)
    # verl adds 1e-8 to the mean inside its ESS: a relative difference of ~1e-8
    assert m["rollout_corr/ess"] == pytest.approx(vm["rollout_corr/rollout_is_eff_sample_size"], rel=1e-6)
    if normalize:
        assert m["rollout_corr/batch_norm_factor"] == pytest.approx(vm["rollout_corr/rollout_is_batch_norm_factor"], rel=REL)
    if level == "token":
        assert m["rollout_corr/is_min"] == pytest.approx(vm["rollout_corr/rollout_is_min"], rel=REL)
        assert m["rollout_corr/is_max"] == pytest.approx(vm["rollout_corr/rollout_is_max"], rel=REL)
        if name == "token_is":  # truncated above C: verl's fraction of raw weights above C
            assert m["rollout_corr/frac_high"] == pytest.approx(vm["rollout_corr/rollout_is_ratio_fraction_high"], rel=REL)
        if name == "token_mask":  # masked outside the band: verl's out-of-bounds ratio
            assert m["rollout_corr/frac_high"] + m["rollout_corr/frac_low"] == pytest.approx(
                vm["rollout_corr/rollout_is_oob_ratio"], rel=REL)
    else:
        # documented difference: verl's sequence-level is_min/is_max are exp of the raw (unclamped,
        # untruncated) sequence log-ratio over all rows; ours are the applied weights on kept tokens
        assert m["rollout_corr/is_max"] <= vm["rollout_corr/rollout_is_max"] + 1e-12
    # mismatch: same k1 KL; verl's k3 exponentiates the unclamped log-ratio (documented difference)
    assert m["rollout_corr/kl"] == pytest.approx(vm["rollout_corr/kl"], rel=REL)


def test_k3_mismatch_matches_verl_without_extreme_log_ratios():
    old, roll, adv, mask = _batch(5, extreme=False)
    ours = _ours(old, roll, adv, mask, rollout_correction="token_is")
    _, _, vm = _verl(old, roll, mask, rollout_is="token", rollout_is_threshold=2.0)
    assert ours.metrics["rollout_corr/k3_kl"] == pytest.approx(vm["rollout_corr/k3_kl"], rel=REL)


def _rs_spec(option, old, roll, mask):
    """Thresholds inside the statistic's range (so both outcomes occur): ours and verl's spec."""
    from echotrain.rl.correction import rejection_statistic

    lr = torch.where(mask.bool(), (old - roll).clamp(-20, 20), 0)
    stat, is_k1 = rejection_statistic(lr, mask.bool(), option)
    u = torch.unique(stat[mask.bool()])  # midway between distinct values: no ties at a threshold
    i, j = int(0.2 * len(u)), int(0.7 * len(u))
    lo, hi = float(u[i] + u[i + 1]) / 2, float(u[j] + u[j + 1]) / 2
    if is_k1:
        lo, hi = float(torch.tensor(lo).exp()), float(torch.tensor(hi).exp())
        return dict(rollout_rs_threshold=hi, rollout_rs_threshold_lower=lo), f"{lo!r}_{hi!r}"
    return dict(rollout_rs_threshold=hi), hi


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("option", RS_STATISTICS)
def test_rejection_masks_and_metrics_match_verl(option, seed):
    old, roll, adv, mask = _batch(seed)
    ours_settings, spec = _rs_spec(option, old, roll, mask)
    ours = _ours(old, roll, adv, mask, rollout_correction="rejection", rollout_rs=option, **ours_settings)
    _, new_mask, vm = _verl(old, roll, mask, rollout_rs=option, rollout_rs_threshold=spec)
    assert torch.equal(ours.response_mask, new_mask.bool())
    m = ours.metrics
    assert 0 < m["rollout_corr/rejected_frac"] < 1
    assert m["rollout_corr/rejected_frac"] == pytest.approx(vm["rollout_corr/rollout_rs_masked_fraction"], rel=REL)
    # documented difference: verl's sequence share counts every row (empty ones too); ours the non-empty ones
    n_rows, n_nonempty = mask.shape[0], int((mask.sum(-1) > 0).sum())
    assert m["rollout_corr/seq_rejected_frac"] * n_nonempty == pytest.approx(
        vm["rollout_corr/rollout_rs_seq_masked_fraction"] * n_rows, rel=REL)


def test_verl_single_float_k1_threshold_means_the_reciprocal_lower_bound():
    old, roll, adv, mask = _batch(3)
    ours = _ours(old, roll, adv, mask, rollout_correction="rejection", rollout_rs="token_k1", rollout_rs_threshold=1.4)
    _, new_mask, _ = _verl(old, roll, mask, rollout_rs="token_k1", rollout_rs_threshold=1.4)
    assert torch.equal(ours.response_mask, new_mask.bool())


def test_is_and_rejection_together_match_verl():
    """token TIS + seq_mean_k3 rejection, as verl runs rollout_is and rollout_rs in one call."""
    old, roll, adv, mask = _batch(4)
    settings, spec = _rs_spec("seq_mean_k3", old, roll, mask)
    ours = _ours(old, roll, adv, mask, rollout_correction="token_is,rejection", rollout_is_threshold=2.0,
                 rollout_rs="seq_mean_k3", **settings)
    w, new_mask, vm = _verl(old, roll, mask, rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3",
                            rollout_rs_threshold=spec)
    assert torch.equal(ours.response_mask, new_mask.bool())
    kept = ours.response_mask
    torch.testing.assert_close(torch.where(kept, ours.rollout_is_weights, 0), torch.where(kept, w, 0), **TOL)
