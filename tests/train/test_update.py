"""The trainer's step data and update plumbing, without a model: StepData select / concat,
mini-batch splits of whole groups, micro-batches (loss mask kept apart from the token mask), and
the old-log-prob pass that leaves the first update's rows to its own forward."""

from __future__ import annotations

import pytest
import torch

from echotrain.train.dist import DistContext
from echotrain.runtime.rollout import RolloutBatch
from echotrain.train.step import StepData
from echotrain.train.update import micro_batches, mini_batch_splits, old_log_probs


def _data(n_groups: int = 3, g: int = 2, T: int = 4, offset: int = 0) -> StepData:
    n = n_groups * g
    mask = torch.ones(n, T)
    mask[0, 2:] = 0  # row 0: 2 valid tokens
    batch = RolloutBatch(prompt_ids=torch.arange(n).unsqueeze(-1), prompt_mask=torch.ones(n, 1, dtype=torch.long),
                         response_ids=torch.arange(n * T).view(n, T), response_mask=mask,
                         group_index=torch.arange(n_groups).repeat_interleave(g) * 5 + offset,  # sparse ids
                         truncated=torch.zeros(n, dtype=torch.bool))
    return StepData(batch=batch, rewards=torch.arange(n, dtype=torch.float32), correct=torch.zeros(n),
                    format_ok=torch.ones(n, dtype=torch.bool), examples=[f"ex{i}" for i in range(n)],
                    texts=[f"t{i}" for i in range(n)])


def test_select_and_concat_keep_rows_together_and_make_group_ids_dense():
    a, b = _data(offset=0), _data(offset=100)
    kept = StepData.concat([a.select(torch.tensor([2, 3])), b.select(torch.tensor([0, 1, 4, 5]))], pad_id=0)
    assert kept.batch.group_index.tolist() == [0, 0, 1, 1, 2, 2] and kept.n_groups == 3
    assert kept.rewards.tolist() == [2.0, 3.0, 0.0, 1.0, 4.0, 5.0]
    assert kept.texts == ["t2", "t3", "t0", "t1", "t4", "t5"] and kept.examples[2] == "ex0"
    assert kept.batch.response_ids[2].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("num_mini_batches, epochs", [(2, 1), (3, 2), (5, 1)])
def test_mini_batch_splits_are_whole_groups_covering_each_epoch(num_mini_batches, epochs):
    gi = torch.arange(4).repeat_interleave(3)  # 4 groups of 3
    torch.manual_seed(0)
    splits = mini_batch_splits(gi, num_mini_batches, epochs, DistContext())
    per_epoch = min(num_mini_batches, 4)
    assert len(splits) == per_epoch * epochs
    for e in range(epochs):
        rows = torch.cat(splits[e * per_epoch:(e + 1) * per_epoch])
        assert sorted(rows.tolist()) == list(range(12))  # every row once per epoch
    for rows in splits:
        groups = gi[rows].unique()
        assert sorted(rows.tolist()) == torch.isin(gi, groups).nonzero().squeeze(-1).tolist()  # whole groups


def test_micro_batches_carry_the_loss_mask_and_the_tokens_separately():
    data = _data()
    data.response_mask = data.batch.response_mask.clone()
    data.response_mask[3] = 0  # e.g. overlong filtering of row 3
    data.advantages = torch.arange(6, dtype=torch.float32).unsqueeze(-1) * data.response_mask
    data.old_log_prob = -torch.arange(24, dtype=torch.float32).view(6, 4)
    rows = torch.tensor([4, 5, 2, 3])  # groups 2 and 1 of the step
    mbs = micro_batches(data, rows, 3, DistContext())
    assert [len(mb.rows) for mb in mbs] == [3, 1]
    assert torch.cat([mb.rows for mb in mbs]).tolist() == [4, 5, 2, 3]
    # group ids dense over the mini-batch, in the step's group order
    assert torch.cat([mb.group_index for mb in mbs]).tolist() == [1, 1, 0, 0]
    last = mbs[1]
    assert last.response_mask.tolist() == [[0.0, 0.0, 0.0, 0.0]]  # the loss mask ...
    assert last.batch.response_mask.tolist() == [[1.0, 1.0, 1.0, 1.0]]  # ... and the tokens' mask
    assert last.batch.response_ids.tolist() == [[12, 13, 14, 15]]
    assert torch.equal(mbs[0].old_log_prob, data.old_log_prob[[4, 5, 2]])
    assert mbs[0].ref_log_prob is None and mbs[0].log_prob is None


def test_old_log_probs_leave_the_first_update_rows_to_its_forward():
    data = _data()
    seen = []

    def batched(batch):
        seen.append(batch.prompt_ids.squeeze(-1).tolist())
        lp = -batch.prompt_ids.float().expand(-1, 4).clone()
        return lp, 2 * lp

    lp, ent = old_log_probs(batched, data.batch, torch.tensor([1, 0]))
    assert seen == [[2, 3, 4, 5]]
    assert lp[:2].eq(0).all() and ent[:2].eq(0).all()
    assert lp[:, 0].tolist() == [0.0, 0.0, -2.0, -3.0, -4.0, -5.0] and torch.equal(ent, 2 * lp)
    seen.clear()
    lp, ent = old_log_probs(batched, data.batch, torch.arange(6))  # one mini-batch: no pass at all
    assert seen == [] and lp.shape == (6, 4) and not lp.any()
    lp, _ = old_log_probs(batched, data.batch, None)  # no reuse: every row
    assert seen == [list(range(6))] and lp[:, 0].tolist() == [-float(i) for i in range(6)]
