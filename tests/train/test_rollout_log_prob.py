"""The sampler's log-probs recorded at generation (``rollout_log_prob``), the train/inference
mismatch metrics, and every registered ``rollout_correction`` in the trainer.

The training runs use the path of the other trainer tests (``resolve_config`` + ``Trainer``, the
CLI's own config resolution) because ``echotrain train model=testbed`` currently fails the CLI's
offline preflight (it looks for a hub model named "testbed"); the bad settings go through the
real CLI (they fail before the preflight)."""

from __future__ import annotations

import pytest
import torch

from echotrain import cli
from echotrain.rl.correction import CORRECTION_METRICS, ROLLOUT_CORRECTIONS
from echotrain.runtime.rollout import forward_log_probs, generate_rollouts
from echotrain.train.metrics import read_jsonl

RUN = ["model=testbed", "task=testbed", "prompts_per_step=2", "num_generations=2", "max_new_tokens=6",
       "micro_batch_size=2", "num_mini_batches=2", "eval_prompts=0", "num_threads=1", "progress=false",
       "plots=false", "save_every=0", "save_final_model=false", "device=cpu", "seed=1"]


@pytest.fixture(scope="module")
def testbed():
    from echotrain.models.testbed import load_testbed

    return load_testbed()


@pytest.mark.parametrize("share_prefix", [True, False])
def test_recorded_log_probs_are_the_update_distribution(testbed, share_prefix):
    """float32 generation: rollout_log_prob equals forward_log_probs (the old_log_prob computation)
    at the sampling temperature, up to KV-cache rounding; 0 off the response positions."""
    model, tok = testbed
    torch.manual_seed(0)
    b = generate_rollouts(model, tok, ["12+7=", "3+4="], 3, max_new_tokens=8, temperature=0.7, top_p=0.9,
                          share_prefix=share_prefix)
    assert b.rollout_log_prob is not None and b.rollout_log_prob.dtype == torch.float32
    assert b.rollout_log_prob.shape == b.response_ids.shape
    lp, _ = forward_log_probs(model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask, temperature=0.7)
    m = b.response_mask.bool()
    torch.testing.assert_close(b.rollout_log_prob[m], lp[m], rtol=0, atol=1e-4)
    assert (b.rollout_log_prob[~m] == 0).all() and (b.rollout_log_prob[m] <= 0).all()
    # temperature matters: at T=1 the recorded values are another distribution's
    assert (b.rollout_log_prob[m] - forward_log_probs(model, b.prompt_ids, b.prompt_mask, b.response_ids,
                                                      b.response_mask)[0][m]).abs().max() > 1e-3
    # rows select and concatenate with it
    assert torch.equal(b.select([1, 0]).rollout_log_prob, b.rollout_log_prob[[1, 0]])
    # the sampler's entropy: the entropy of the same distributions, as forward_log_probs computes it
    _, ent = forward_log_probs(model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask, temperature=0.7,
                               with_entropy=True)
    assert b.rollout_entropy is not None and b.rollout_entropy.shape == b.response_ids.shape
    torch.testing.assert_close(b.rollout_entropy[m], ent[m], rtol=0, atol=1e-4)
    assert (b.rollout_entropy[~m] == 0).all() and (b.rollout_entropy[m] >= 0).all()
    assert float(b.rollout_entropy[m].std()) > 1e-3  # per-position values, not one number
    assert torch.equal(b.select([1, 0]).rollout_entropy, b.rollout_entropy[[1, 0]])
    # the sampler's sum_v pi(v)^2 (the optimal token baselines' statistic): the same distributions'
    from echotrain.runtime.rollout import response_log_softmax

    with torch.no_grad():
        ls = response_log_softmax(model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask,
                                  temperature=0.7, pack=False)
    sq = b.rollout_sum_pi_squared
    assert sq is not None and sq.shape == b.response_ids.shape and (sq[~m] == 0).all()
    torch.testing.assert_close(sq[m], (2 * ls).exp().sum(-1)[m], rtol=0, atol=1e-5)
    assert float(sq[m].std()) > 1e-3 and (sq[m] <= 1 + 1e-6).all()
    assert torch.equal(b.select([1, 0]).rollout_sum_pi_squared, sq[[1, 0]])


def test_bf16_generation_shows_a_mismatch(testbed):
    """Generating in bf16 and recomputing in float32 gives a positive gap, the metric's purpose."""
    model, tok = testbed
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        b = generate_rollouts(model, tok, ["12+7=", "3+4="], 2, max_new_tokens=8, temperature=1.0)
    lp, _ = forward_log_probs(model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
    from echotrain.rl.correction import rollout_mismatch_metrics

    m = rollout_mismatch_metrics(lp, b.rollout_log_prob, b.response_mask)
    assert m["rollout_corr/log_prob_abs_diff"] > 1e-4 and m["rollout_corr/k3_kl"] > 0


def _train(argv):
    from echotrain.train.config import parse_overrides, resolve_config
    from echotrain.train.trainer import Trainer

    return Trainer(resolve_config(overrides=parse_overrides(RUN + argv))).train()


def test_mismatch_is_logged_without_a_correction(tmp_path):
    (rec,) = _train(["steps=1", f"output_dir={tmp_path / 'run'}"])
    assert 0 <= rec["rollout_corr/log_prob_abs_diff"] < 1e-4  # float32 generation and update
    assert "rollout_corr/ess" not in rec  # no correction, no correction metrics


@pytest.mark.parametrize("name", list(ROLLOUT_CORRECTIONS))
def test_every_correction_trains(tmp_path, name):
    recs = _train(["steps=3", f"rollout_correction={name}", "rollout_is_batch_normalize=true",
                   f"output_dir={tmp_path / name}"])
    assert [r["step"] for r in recs] == [1, 2, 3]
    for key in CORRECTION_METRICS:
        assert all(key in r for r in recs), key
    assert all(0 < r["rollout_corr/ess"] <= 1 + 1e-12 for r in recs)


@pytest.mark.parametrize("argv,needles", [
    (["rollout_correction=tis"], ["rollout_correction", "token_is"]),
    (["rollout_is_threshold=-1"], ["rollout_is_threshold", "> 0"]),
    (["rollout_is_threshold=2", "rollout_is_threshold_lower=3"], ["rollout_is_threshold_lower=3.0", "wrong order"]),
    (["rollout_rs=token_k4"], ["rollout_rs", "token_k1"]),
    (["rollout_rs_threshold=1.5", "rollout_rs_threshold_lower=2"], ["rollout_rs_threshold_lower", "wrong order"]),
    (["behav_imp_weight_cap=0.5"], ["behav_imp_weight_cap"]),
])
def test_bad_correction_settings_exit_2_naming_the_key(tmp_path, capsys, argv, needles):
    rc = cli.main(["train", *RUN, "steps=1", *argv, f"output_dir={tmp_path / 'bad'}"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert all(n in err for n in needles), err
    assert not (tmp_path / "bad").exists()  # before any work


def test_cap_at_1_masks_no_on_policy_token_through_the_cli(tmp_path):
    """behav_imp_weight_cap=1.0 on a synchronous run (every step on-policy: old_log_prob and the
    sampler's differ by float rounding only) masks no token; a strict w > 1 masked ~21% (issue 40).
    At staleness=2 the drift is real and the same cap masks tokens from step 3 on."""
    cap = ["rollout_correction=decoupled", "behav_imp_weight_cap=1.0", "lr=1e-2", "prompts_per_step=4",
           "num_generations=4"]
    assert cli.main(["train", *RUN, *cap, "steps=3", f"output_dir={tmp_path / 'sync'}"]) == 0
    recs = read_jsonl(tmp_path / "sync" / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(r["rollout_corr/log_prob_abs_diff"] > 0 for r in recs)  # the noise is there
    assert [r["rollout_corr/frac_high"] for r in recs] == [0.0, 0.0, 0.0]
    assert [r["rollout_corr/zero_weight_frac"] for r in recs] == [0.0, 0.0, 0.0]
    assert cli.main(["train", *RUN, *cap, "steps=4", "staleness=2", f"output_dir={tmp_path / 'lag'}"]) == 0
    lag = read_jsonl(tmp_path / "lag" / "metrics.jsonl")
    assert [r["staleness/max"] for r in lag] == [0, 1, 2, 2]
    assert lag[0]["rollout_corr/frac_high"] == 0.0
    assert lag[2]["rollout_corr/frac_high"] + lag[3]["rollout_corr/frac_high"] > 0
