"""Response-length statistics of a batch of rollouts: spread, and the gap between right and wrong.

The premise of Balanced Aggregation and of the length-collapse claims is that correct and wrong
responses differ in length; :func:`length_facts` measures it from ``response_mask``-style valid
lengths, 0/1 correctness and the group of each row (the rows sampled from one prompt).

Pure tensor math, no model; used by ``scripts/measure_testbed_length.py`` (docs/testbed.md) and
the trainer's ``response_length/gap`` and ``response_length/within_group_gap`` step metrics.
"""

from __future__ import annotations

import torch

__all__ = ["length_facts"]


def length_facts(lengths: torch.Tensor, correct: torch.Tensor, group_index: torch.Tensor) -> dict[str, float]:
    """Length spread and the correct-minus-wrong length gap of N responses.

    Args:
        lengths: (N,) valid response tokens per row (EOS included), any real dtype.
        correct: (N,) 0/1 correctness (bool or float).
        group_index: (N,) int64 prompt id of each row.

    Returns:
        ``mean``, ``std`` (population), ``var``, ``min``, ``max`` of the lengths (tokens);
        ``mean_correct`` / ``mean_wrong`` (NaN when there is none) and ``gap`` = their difference
        (pooled over all rows: mixes the effect of the problem's size with that of the answer);
        ``within_group_gap``: the mean, over mixed groups (at least one right and one wrong row),
        of (mean correct length - mean wrong length) in the group (the gap a group-relative
        advantage sees), NaN without mixed groups; ``mixed_groups``: the share of groups that
        are mixed; ``accuracy``: mean correctness.

    Raises:
        ValueError: the three tensors are not 1-D of one length N >= 1, or ``lengths`` has NaN/Inf.
    """
    if not (lengths.dim() == correct.dim() == group_index.dim() == 1
            and lengths.shape == correct.shape == group_index.shape and lengths.numel() >= 1):
        raise ValueError(f"lengths, correct and group_index must be 1-D of one length N >= 1, got shapes "
                         f"{tuple(lengths.shape)}, {tuple(correct.shape)}, {tuple(group_index.shape)}")
    x = lengths.double()
    if not torch.isfinite(x).all():
        raise ValueError("lengths has NaN or Inf")
    c = correct.bool()
    nan = float("nan")
    mean_c = float(x[c].mean()) if c.any() else nan
    mean_w = float(x[~c].mean()) if (~c).any() else nan
    gaps = []
    groups = torch.unique(group_index)
    for g in groups:
        rows = group_index == g
        cg, xg = c[rows], x[rows]
        if cg.any() and (~cg).any():
            gaps.append(float(xg[cg].mean() - xg[~cg].mean()))
    return {"mean": float(x.mean()), "std": float(x.std(unbiased=False)), "var": float(x.var(unbiased=False)),
            "min": float(x.min()), "max": float(x.max()), "mean_correct": mean_c, "mean_wrong": mean_w,
            "gap": mean_c - mean_w, "within_group_gap": sum(gaps) / len(gaps) if gaps else nan,
            "mixed_groups": len(gaps) / len(groups), "accuracy": float(c.double().mean())}
