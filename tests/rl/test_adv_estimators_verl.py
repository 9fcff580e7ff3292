"""verl 0.9.1's advantage estimators against echotrain's, enumerated from verl's own registry.

Every name verl registers is either compared here (value of every valid token, random rewards,
ragged masks with holes, empty responses, flat groups) or listed in ``NOT_IN_ECHOTRAIN`` with the
reason; a new verl estimator fails :func:`test_every_verl_estimator_is_accounted_for` until it is
one or the other. Groups of one are the documented difference (docs/design/objectives.md §1):
echotrain gives them advantage 0 under every group-baseline estimator, verl no baseline.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from echotrain.rl import compute_advantages
from echotrain.rl.advantages import (ADV_ESTIMATOR_REGISTRY, ADV_METHODS, compute_token_advantages, masked_whiten,
                                     zero_variance_groups)

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

#: verl estimators with no echotrain counterpart, and why.
NOT_IN_ECHOTRAIN = {
    "gae": "needs a critic (values): out of scope (issue 39)",
}
#: echotrain estimators verl does not register.
ONLY_IN_ECHOTRAIN = {"grpo_no_std", "batch_std"}


class _Cfg(dict):
    """verl's AlgoConfig as the estimators read it: ``config.get(key)`` and ``config.gamma``."""

    def __getattr__(self, key):
        return self[key]


def _batch(seed: int, *, binary: bool, holes: bool, flat_group: bool = False, group_sizes=(2, 3, 4, 5)):
    g = torch.Generator().manual_seed(seed)
    sizes = [group_sizes[int(torch.randint(len(group_sizes), (1,), generator=g))] for _ in range(5)]
    index = np.repeat(np.arange(100, 100 + len(sizes)), sizes)
    rng = np.random.default_rng(seed)
    rng.shuffle(index)  # groups interleaved in the batch
    B, T = len(index), 9
    rewards = (torch.randint(0, 2, (B,), generator=g).double() if binary
               else torch.randn(B, generator=g, dtype=torch.float64))
    if flat_group:
        rewards[torch.as_tensor(index == index[0])] = 0.7
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T  # at least one full row: whitening has tokens
    mask = (torch.arange(T) < lengths[:, None]).double()
    if holes:
        mask = mask * (torch.rand(B, T, generator=g) > 0.25).double()
    # verl's token_level_rewards: the outcome reward on the last valid token (position 0 if none:
    # it then counts in the group's score but on no token)
    last = torch.where(mask.any(-1), T - 1 - mask.flip(-1).argmax(-1), 0)
    tlr = torch.zeros(B, T, dtype=torch.float64)
    tlr[torch.arange(B), last] = rewards
    baselines = torch.randint(0, 2, (B,), generator=g).double()
    return index, rewards, mask, tlr, baselines


def _pi_stats(shape, seed: int) -> dict[str, torch.Tensor]:
    """Random policy statistics: log pi of the sampled token in [log 0.01, 0], and a sum of squared
    vocabulary probabilities between pi^2 and 1 (as a real distribution has)."""
    g = torch.Generator().manual_seed(1000 + seed)
    pi = 0.01 + 0.99 * torch.rand(shape, generator=g, dtype=torch.float64)
    s2 = pi**2 + (1 - pi**2) * torch.rand(shape, generator=g, dtype=torch.float64)
    return {"old_log_prob": pi.log(), "sum_pi_squared": s2}


def _verl(name: str, index, mask, tlr, baselines, *, gamma=1.0, norm=True, stats=None) -> torch.Tensor:
    fn = core_algos.get_adv_estimator_fn(name)
    cfg = _Cfg(gamma=gamma, norm_adv_by_std_in_grpo=norm)
    kwargs = dict(token_level_rewards=tlr.clone(), response_mask=mask.clone(), config=cfg)
    if name == "remax":
        kwargs["reward_baselines"] = baselines
    else:
        kwargs["index"] = index
    if name in ("grpo", "grpo_vectorized", "gdpo"):
        kwargs["norm_adv_by_std_in_grpo"] = norm
    if ADV_ESTIMATOR_REGISTRY.info(name).get("needs_pi_stats"):
        kwargs.update(old_log_probs=stats["old_log_prob"].clone(), sum_pi_squared=stats["sum_pi_squared"].clone())
    return fn(**kwargs)[0] * mask


def _verl_names() -> set[str]:
    """verl's own estimators (echotrain's verl plugin adds ``echotrain_*`` names to the same
    registry when another test has imported it: those are ours, not verl's)."""
    return {n for n in core_algos.ADV_ESTIMATOR_REGISTRY if not n.startswith("echotrain_")}


def test_every_verl_estimator_is_accounted_for():
    verl_names = _verl_names()
    missing = verl_names - set(ADV_METHODS)
    assert missing == set(NOT_IN_ECHOTRAIN), (
        f"verl estimators without an echotrain counterpart and not listed: {sorted(missing - set(NOT_IN_ECHOTRAIN))}; "
        f"listed but now present or gone from verl: {sorted(set(NOT_IN_ECHOTRAIN) - missing)}")
    assert set(ADV_METHODS) - verl_names >= ONLY_IN_ECHOTRAIN


PARITY = sorted(_verl_names() - set(NOT_IN_ECHOTRAIN))


@pytest.mark.parametrize("name", PARITY)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("holes", [False, True])
def test_matches_verl(name, seed, binary, holes):
    index, rewards, mask, tlr, base = _batch(seed, binary=binary, holes=holes, flat_group=seed == 1)
    stats = _pi_stats(mask.shape, seed)
    ref = _verl(name, index, mask, tlr, base, stats=stats)
    tok, seq = compute_token_advantages(rewards, torch.as_tensor(index), mask, adv_estimator=name,
                                        reward_baselines=base, **stats)
    assert tok.dtype == torch.float32 and tok.shape == mask.shape
    if name == "grpo_vectorized" and seed == 1:
        # verl's vectorized group std leaves a rounding residue in a flat group's mean and divides
        # it by eps (1e-2 here, not 0): echotrain gives such a group exactly 0 (objectives.md §1)
        flat = torch.as_tensor(index == index[0])
        assert tok[flat].abs().max() == 0 and ref[flat].abs().max() > 1e-4
        tok, ref = tok[~flat], ref[~flat]
    torch.testing.assert_close(tok.double(), ref, rtol=1e-5, atol=1e-6)
    if not ADV_ESTIMATOR_REGISTRY.info(name)["token_level"]:  # the sequence API gives the same numbers
        torch.testing.assert_close(compute_advantages(rewards, torch.as_tensor(index), name, reward_baselines=base),
                                   seq)


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
@pytest.mark.parametrize("holes", [False, True])
def test_reinforce_plus_plus_discount_matches_verl(gamma, holes):
    index, rewards, mask, tlr, base = _batch(3, binary=False, holes=holes)
    ref = _verl("reinforce_plus_plus", index, mask, tlr, base, gamma=gamma)
    tok, _ = compute_token_advantages(rewards, torch.as_tensor(index), mask, "reinforce_plus_plus", gamma=gamma)
    torch.testing.assert_close(tok.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "grpo_vectorized", "grpo_passk", "gdpo"])
def test_norm_adv_by_std_in_grpo_false_matches_verl(name):
    index, rewards, mask, tlr, base = _batch(4, binary=False, holes=True)
    ref = _verl(name, index, mask, tlr, base, norm=False)
    tok, _ = compute_token_advantages(rewards, torch.as_tensor(index), mask, name, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(tok.double(), ref, rtol=1e-5, atol=1e-6)


def test_group_of_one_is_zero_where_verl_has_no_baseline():
    """The documented difference: verl's grpo gives a lone response r / (1 + eps), echotrain 0."""
    index = np.array([0, 1, 1])
    rewards = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    mask = torch.ones(3, 2, dtype=torch.float64)
    tlr = torch.zeros(3, 2, dtype=torch.float64)
    tlr[:, 1] = rewards
    for name in ADV_METHODS:
        info = ADV_ESTIMATOR_REGISTRY.info(name)
        if not info["group_baseline"]:
            continue
        tok, _ = compute_token_advantages(rewards, torch.as_tensor(index), mask, name)
        if not info["token_level"] or info["zero_flat_groups"]:
            assert tok[0].abs().max() == 0, name
    assert _verl("grpo", index, mask, tlr, None)[0, 0] == pytest.approx(1 / (1 + 1e-6))


def test_hand_computed_values():
    gid = torch.tensor([0, 0, 0, 1, 1])
    r = torch.tensor([1.0, 0.0, 0.0, 2.0, 1.0])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float32)
    # rloo: r_i minus the mean of the others
    torch.testing.assert_close(compute_advantages(r, gid, "rloo"), torch.tensor([1.0, -0.5, -0.5, 1.0, -1.0]))
    # opo: group 0 baseline (4*1 + 2*0 + 1*0) / 7, group 1 (3*2 + 1*1) / 4
    _, seq = compute_token_advantages(r, gid, mask, "opo")
    torch.testing.assert_close(seq, torch.tensor([1 - 4 / 7, -4 / 7, -4 / 7, 2 - 7 / 4, 1 - 7 / 4]))
    # grpo_passk without the std: only the best of each group, r_max - r_second
    torch.testing.assert_close(compute_advantages(r, gid, "grpo_passk", norm_adv_by_std_in_grpo=False),
                               torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0]))
    # ties: the first best response in batch order gets the gap (0 here)
    torch.testing.assert_close(compute_advantages(torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0, 0, 0]), "grpo_passk",
                                                  norm_adv_by_std_in_grpo=False), torch.zeros(3))
    # gpg: alpha = B / #nonzero = 5 / 3
    torch.testing.assert_close(compute_advantages(r, gid, "gpg"),
                               5 / 3 * torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.5, -0.5]))
    # remax: r - b
    torch.testing.assert_close(compute_advantages(r, gid, "remax", reward_baselines=torch.tensor([1.0, 1, 1, 1, 1])),
                               torch.tensor([0.0, -1.0, -1.0, 1.0, 0.0]))
    # reinforce_plus_plus, gamma 0.5, one row of 3 valid tokens with a hole, reward 4: returns 1, 2, 4
    tok, _ = compute_token_advantages(torch.tensor([4.0]), torch.tensor([0]), torch.tensor([[1.0, 0.0, 1.0, 1.0]]),
                                      "reinforce_plus_plus", gamma=0.5)
    ret = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    white = (ret - ret.mean()) / torch.sqrt(ret.var() + 1e-8)
    torch.testing.assert_close(tok[0, [0, 2, 3]], white.float())
    assert tok[0, 1] == 0


def test_errors_name_the_argument():
    gid, r = torch.tensor([0, 0]), torch.tensor([1.0, 0.0])
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantages(r, gid, "remax")
    with pytest.raises(ValueError, match="compute_token_advantages"):
        compute_advantages(r, gid, "reinforce_plus_plus")
    with pytest.raises(ValueError, match="gamma"):
        compute_token_advantages(r, gid, torch.ones(2, 3), "reinforce_plus_plus", gamma=1.5)
    with pytest.raises(ValueError, match="response_mask"):
        compute_token_advantages(r, gid, torch.ones(3, 3), "opo")
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantages(r, gid, "remax", reward_baselines=torch.tensor([float("nan"), 0.0]))


def test_masked_whiten_hand_values_and_fewer_than_two_valid_tokens():
    """Unbiased variance over the valid entries; one or no valid entry gives 0, not NaN (verl raises)."""
    values = torch.tensor([[1.0, 9.0, 2.0], [4.0, 7.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    # valid 1, 2, 4: mean 7/3, unbiased var ((4/3)^2 + (1/3)^2 + (5/3)^2) / 2 = 7/3
    expected = torch.tensor([[1 - 7 / 3, 0.0, 2 - 7 / 3], [4 - 7 / 3, 0.0, 0.0]], dtype=torch.float64) / (7 / 3 + 1e-8) ** 0.5
    torch.testing.assert_close(masked_whiten(values, mask), expected)
    for one in (torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64), torch.zeros(2, 3, dtype=torch.float64)):
        assert torch.equal(masked_whiten(values, one), torch.zeros(2, 3, dtype=torch.float64))
    # through the estimator: a batch with one valid token has advantage 0 there (a whitened single value)
    tok, seq = compute_token_advantages(torch.tensor([3.0, 1.0]), torch.tensor([0, 1]),
                                        torch.tensor([[1.0, 0.0], [0.0, 0.0]]), "reinforce_plus_plus")
    assert torch.equal(tok, torch.zeros(2, 2)) and torch.equal(seq, torch.zeros(2))


def test_gpg_all_zero_rewards_give_zero_not_an_error():
    """alpha = B / max(#(r != 0), 1): a batch whose rewards are all 0 has alpha 1 (no division by zero)."""
    assert torch.equal(compute_advantages(torch.zeros(4), torch.tensor([0, 0, 1, 1]), "gpg"), torch.zeros(4))


def test_gdpo_flat_group_is_exactly_zero_before_whitening():
    """gdpo zeroes a zero-variance group before whitening: a flat group whose float64 mean leaves a
    rounding residue (7 x 1e8/3: r - mean = ~1e-8, / (std + eps) = ~4e-3) still enters as 0."""
    r = torch.tensor([1e8 / 3] * 7 + [0.0, 1.0], dtype=torch.float64)
    gid = torch.tensor([0] * 7 + [1, 1])
    mask = torch.ones(9, 2, dtype=torch.float64)
    c = 0.5 / (0.5**0.5 + 1e-6)  # grpo of the group [0, 1]: -/+ 0.5 / (std + eps), std = sqrt(0.5)
    a = torch.tensor([0.0] * 7 + [-c, c], dtype=torch.float64)
    tok, _ = compute_token_advantages(r, gid, mask, "gdpo")
    torch.testing.assert_close(tok.double(), masked_whiten(a[:, None] * mask, mask), rtol=0, atol=1e-6)


def test_zero_variance_is_exact_no_tolerance():
    """A group whose rewards differ by 1e-4 is not flat: grpo gives it +-d / (std + eps)."""
    r = torch.tensor([0.0, 1e-4], dtype=torch.float64)
    gid = torch.tensor([0, 0])
    assert not zero_variance_groups(r, gid).any()
    std = (2 * 0.5e-4**2) ** 0.5
    expected = torch.tensor([-0.5e-4, 0.5e-4]) / (std + 1e-6)
    torch.testing.assert_close(compute_advantages(r, gid, "grpo"), expected.float())


OTB = ("optimal_token_baseline", "tir_optimal_token_baseline")


@pytest.mark.parametrize("name", OTB)
@pytest.mark.parametrize("seed", [5, 6, 7])
def test_optimal_token_baselines_match_verl_on_groups_of_one_flat_groups_and_empty_responses(name, seed):
    """The cases the random batches rarely hit: groups of one (no baseline: A = the reward, as verl),
    an all-equal group (not zeroed, as verl), empty responses, one strictly longest response (its
    baseline 0 past the second longest: handle_zero_tail) and holes."""
    index, rewards, mask, tlr, base = _batch(seed, binary=True, holes=seed != 5, flat_group=True,
                                             group_sizes=(1, 2, 3))
    mask[1] = 0.0  # an empty response
    last = torch.where(mask.any(-1), mask.shape[1] - 1 - mask.flip(-1).argmax(-1), 0)
    tlr = torch.zeros_like(tlr)
    tlr[torch.arange(len(rewards)), last] = rewards
    stats = _pi_stats(mask.shape, seed)
    ref = _verl(name, index, mask, tlr, base, stats=stats)
    tok, _ = compute_token_advantages(rewards, torch.as_tensor(index), mask, name, **stats)
    torch.testing.assert_close(tok.double(), ref, rtol=1e-5, atol=1e-6)
    assert (np.unique(index, return_counts=True)[1] == 1).any()  # the batch has a group of one


def test_optimal_token_baseline_by_hand():
    """One group of two responses, no holes: w = 1 - 2 pi + s2 per token, W its running sum,
    B_t = sum_i r_i W_it / sum_i W_it on the columns both have, 0 on the longer one's tail."""
    r = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    pi = torch.tensor([[0.5, 0.5, 0.5], [0.5, 1.0, 0.5]])
    s2 = torch.tensor([[0.5, 0.5, 0.5], [0.5, 1.0, 0.5]])
    # w = 1 - 2 pi + s2: row 0: 0.5, 0.5, 0.5 -> W 0.5, 1.0, 1.5; row 1: 0.5, 0.0 -> W 0.5, 0.5
    tok, _ = compute_token_advantages(r, torch.tensor([0, 0]), mask, "optimal_token_baseline",
                                      old_log_prob=pi.log(), sum_pi_squared=s2)
    b0 = 1 * 0.5 / (0.5 + 0.5 + 1e-8)
    b1 = 1 * 1.0 / (1.0 + 0.5 + 1e-8)
    # column 2: only row 0 is valid, and row 0 is strictly the longest (3 > 2): its baseline is 0 from column 2
    expect = torch.tensor([[1 - b0, 1 - b1, 1.0], [-b0, -b1, 0.0]])
    torch.testing.assert_close(tok, expect.float())


def test_optimal_token_baselines_need_the_policy_statistics():
    gid, r, mask = torch.tensor([0, 0]), torch.tensor([1.0, 0.0]), torch.ones(2, 3)
    for name in OTB:
        with pytest.raises(ValueError, match="needs old_log_prob"):
            compute_token_advantages(r, gid, mask, name)
        with pytest.raises(ValueError, match="sum_pi_squared has shape"):
            compute_token_advantages(r, gid, mask, name, old_log_prob=torch.zeros(2, 3), sum_pi_squared=torch.zeros(2, 4))
        with pytest.raises(ValueError, match="old_log_prob"):
            compute_token_advantages(r, gid, mask, name, old_log_prob=torch.full((2, 3), float("nan")),
                                     sum_pi_squared=torch.zeros(2, 3))
        with pytest.raises(ValueError, match="compute_token_advantages"):
            compute_advantages(r, gid, name)
