"""The looped transformer as a policy in echotrain's rollout code (generate + log-probs)."""

from __future__ import annotations

import pytest
import torch

from echotrain.models.looped import LoopedConfig, LoopedTransformer

rollout = pytest.importorskip("echotrain.runtime.rollout")


class CharTokenizer:
    """The few tokenizer members the rollout code uses: characters a-z, pad 26, eos 27."""

    pad_token_id, eos_token_id, padding_side = 26, 27, "right"

    def __call__(self, texts, return_tensors="pt", padding=True, add_special_tokens=False):
        ids = [[ord(c) - 97 for c in t] for t in texts]
        T = max(map(len, ids))
        left = self.padding_side == "left"
        pad = lambda row, v: [v] * (T - len(row)) + row if left else row + [v] * (T - len(row))  # noqa: E731
        return {"input_ids": torch.tensor([pad(r, self.pad_token_id) for r in ids]),
                "attention_mask": torch.tensor([pad([1] * len(r), 0) for r in ids])}


def test_rollout_and_log_probs_match_unpadded_forward():
    torch.manual_seed(0)
    model = LoopedTransformer(LoopedConfig(vocab_size=28, d_model=16, n_heads=2, n_layers=1, n_loops=3))
    batch = rollout.generate_rollouts(model, CharTokenizer(), ["abc", "hello", "z"], num_generations=2,
                                      max_new_tokens=6, temperature=1.0)
    assert batch.prompt_ids.shape == (6, 5) and batch.response_ids.shape[0] == 6
    log_prob, _ = rollout.forward_log_probs(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                            batch.response_mask)
    # reference: each row alone, without any padding
    for i in range(6):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()]
        n = int(batch.response_mask[i].sum())
        seq = torch.cat([prompt, batch.response_ids[i, :n]])[None]
        logp = model(seq).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        expected = logp.gather(-1, batch.response_ids[i, :n, None])[:, 0]
        torch.testing.assert_close(log_prob[i, :n], expected, rtol=1e-5, atol=1e-5)
