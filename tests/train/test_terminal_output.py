"""Terminal output (issue 10, item 5): no known-harmless third-party noise, summary title times
that match what ran, metric names never cut, `echotrain eval` says how it decoded and shows
completions when nothing was correct."""

from __future__ import annotations

import logging

from echotrain._quiet import silence_known_noise
from echotrain.train.config import resolve_config
from echotrain.train.eval_report import print_eval_report
from echotrain.train.metrics import print_summary
from echotrain.train.trainer import Trainer


def test_known_noise_is_dropped_and_the_rest_kept(caplog):
    silence_known_noise()
    silence_known_noise()  # idempotent
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: Could not load this library")
        logging.getLogger("torch.utils._pytree").warning("<enum 'KernelPreference'> is an Enum subclass and ...")
        logging.getLogger("torchao").warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]
    assert len(logging.getLogger("torchao").filters) == 1


def test_summary_keeps_metric_names_whole_and_says_which_steps_ran(capsys):
    records = [{"step": s, "accuracy": 0.5, "throughput/tokens_per_s": 123.4, "response_length/mean": 10.0}
               for s in range(1, 7)]
    evals = [{"step": 0, "eval/accuracy": 0.25, "eval/format_rate": 0.5}, {"step": 6, "eval/accuracy": 0.5,
                                                                         "eval/format_rate": 1.0}]
    print_summary(records, "runs/a-rather-long-run-directory-name-20261130-000000", 77.2, evals=evals, steps_run=(4, 6))
    err = capsys.readouterr().err
    for name in ("throughput/tokens_per_s", "response_length/mean", "eval/format_rate (greedy)"):
        assert name in err, err
    assert "6 steps in metrics.jsonl; steps 4-6 ran in 77 s" in " ".join(err.split())
    assert "eval rows: greedy on fixed prompts at step 0 (first) and 6 (last)" in " ".join(err.split())
    # sampled evaluations (eval_temperature > 0) are not called greedy
    sampled = [{**e, "eval/temperature": 1.0} for e in evals]
    print_summary(records, "runs/a", 77.2, evals=sampled, steps_run=(4, 6))
    err = " ".join(capsys.readouterr().err.split())
    assert "eval rows: sampled at T=1 on fixed prompts" in err and "eval/accuracy (sampled)" in err
    assert "greedy" not in err


def test_resumed_run_title_counts_the_steps_it_ran(tmp_path, tiny_tokenizer, make_tiny_model, digit_task, capsys):
    base = dict(steps=2, prompts_per_step=2, num_generations=2, max_new_tokens=4, micro_batch_size=4,
                num_mini_batches=1, device="cpu", plots=False, save_final_model=False, eval_prompts=0,
                output_dir=str(tmp_path / "r"), progress=True)
    Trainer(resolve_config(overrides=base), model=make_tiny_model(tiny_tokenizer), tokenizer=tiny_tokenizer,
            task=digit_task).train()
    capsys.readouterr()
    Trainer(resolve_config(overrides={**base, "steps": 4}), model=make_tiny_model(tiny_tokenizer),
            tokenizer=tiny_tokenizer, task=digit_task, resume=True).train()
    err = " ".join(capsys.readouterr().err.split())
    assert "4 steps in metrics.jsonl; steps 3-4 ran in" in err


def test_eval_report_header_and_completions_at_zero_accuracy(capsys):
    from rich.console import Console

    model = "runs/echo-20261130-120000/checkpoints/step_00000016.pt (base smollm2-135m-instruct)"
    res = {"accuracy": 0.0, "format_rate": 0.0, "num_prompts": 2.0, "n": 1.0, "truncated_frac": 1.0, "pass@1": 0.0,
           "seconds": 1.5}
    samples = [{"question": "Calculate 83 - 66.", "answer": "17", "completion": "83 - 66 =", "correct": 0.0,
                "truncated": True}]
    print_eval_report(model, "gsm8k", {"temperature": 0.0, "max_new_tokens": 48, "seed": 1}, res, samples,
                      console=Console(width=60, force_terminal=False))
    out = capsys.readouterr().out
    assert model in out  # the path is printed whole, not split mid-word
    assert "greedy (temperature 0)" in out and "at most 48 new tokens" in out
    assert "100% of completions hit the 48-token limit" in out and "--max-new-tokens" in out
    assert "gold answer '17' (wrong, hit the token limit)" in out and "A: 83 - 66 =" in out


def test_eval_keeps_samples_and_truncation(tiny_model, tiny_tokenizer, digit_task):
    from echotrain.train.evaluate import evaluate

    res = evaluate(tiny_model, tiny_tokenizer, digit_task, num_prompts=3, n=2, max_new_tokens=3, temperature=0.0,
                   keep_samples=2)
    assert len(res["samples"]) == 2 and {"question", "answer", "completion", "correct"} <= set(res["samples"][0])
    assert 0.0 <= res["truncated_frac"] <= 1.0
