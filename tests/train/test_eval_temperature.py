"""``eval_temperature``: the trainer's evaluation greedy (0, the default) or sampled, one sample
per prompt from a fixed seed, through the real CLI on the shipped testbed policy."""

from __future__ import annotations

import json

from echotrain.cli import main

RUN = ["model=testbed", "task=testbed", "prompts_per_step=2", "num_generations=2", "max_new_tokens=6",
       "micro_batch_size=4", "steps=1", "eval_prompts=64", "num_threads=1", "progress=false", "plots=false",
       "save_every=0", "save_final_model=false", "seed=0"]


def _evals(run):
    return [json.loads(line)["eval/accuracy"] for line in (run / "eval.jsonl").read_text().splitlines()]


def test_sampled_evaluation_uses_the_same_draws_every_time(tmp_path):
    # lr so small that the weights do not change in float32: both evaluations see one policy
    assert main(["train", *RUN, "lr=1e-30", "eval_temperature=1.0", f"output_dir={tmp_path / 's'}"]) == 0
    assert main(["train", *RUN, "lr=1e-30", f"output_dir={tmp_path / 'g'}"]) == 0
    sampled, greedy = _evals(tmp_path / "s"), _evals(tmp_path / "g")
    assert len(sampled) == 2 and sampled[0] == sampled[1]  # common random numbers
    assert greedy[0] == greedy[1]
    # the testbed policy is far sharper greedy than sampled (0.28 vs ~0.2 on all 512 problems)
    assert sampled[0] != greedy[0]


def test_negative_eval_temperature_is_refused(capsys):
    # (tiny settings: were the check missing, the run would be one testbed step, not the default job)
    assert main(["train", *RUN, "eval_temperature=-1"]) == 2
    assert "eval_temperature=-1.0: must be >= 0 (0 = greedy)" in capsys.readouterr().err


def test_sampled_evaluation_does_not_change_the_training_run(tmp_path):
    """The evaluation's sampling draws come from a forked RNG: training with a sampled evaluation
    after every step is the run without evaluation, record for record."""
    from echotrain.train.metrics import NONDETERMINISTIC_PREFIXES, read_jsonl

    base = [t for t in RUN if not t.startswith(("steps=", "eval_prompts="))] + ["steps=3", "lr=1e-2"]
    assert main(["train", *base, "eval_prompts=8", "eval_every=1", "eval_temperature=1.0",
                 f"output_dir={tmp_path / 'e'}"]) == 0
    assert main(["train", *base, "eval_prompts=0", f"output_dir={tmp_path / 'n'}"]) == 0

    def train_records(run):
        return [{k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC_PREFIXES + ("eval/",))}
                for r in read_jsonl(run / "metrics.jsonl")]

    with_eval, without = train_records(tmp_path / "e"), train_records(tmp_path / "n")
    assert len(with_eval) == 3 and with_eval == without
