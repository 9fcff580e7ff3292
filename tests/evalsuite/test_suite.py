"""The suite end to end: the shared benchmark files, hand-made multiple-choice files, a scripted
generator with known scores (avg@n, pass@k, per-sample JSONL, summary JSON), input errors, the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from echotrain.cli import main
from echotrain.evalsuite import SUITES, SuiteInputError, evaluate_run_dir, load_suite, run_suite

MATH = ["gsm8k", "math500", "aime24", "amc23", "minerva_math", "olympiadbench"]


def test_registry_lists_the_issue_benchmarks():
    assert list(SUITES["math"]) == MATH
    assert list(SUITES["mc"]) == ["gpqa", "mmlu_pro", "arc_challenge"]


def test_shared_files_load_and_score(shared_data):
    loaded = load_suite("math", data_dir=shared_data, limit=3)
    assert [b.name for b, _, _ in loaded] == MATH
    tasks = {b.name: t for b, _, t in loaded}
    assert all(len(t) == 3 for t in tasks.values())
    golds = {name: [ex.answer for ex in t] for name, t in tasks.items()}
    assert golds["gsm8k"] == ["18", "3", "70000"]
    assert golds["math500"][0] == r"\left( 3, \frac{\pi}{2} \right)"
    assert golds["aime24"] == ["204", "113", "371"]
    assert golds["amc23"] == ["27", "36", "45"]  # 27.0 in the file
    assert golds["minerva_math"] == ["1.6", "4.5e33", "41.8"]  # the solution's last box
    assert golds["olympiadbench"] == ["2", r"\frac{1}{2 n+2}", "2^{1009}"]
    assert tasks["gsm8k"][0].messages[-1]["content"].startswith("Janet")
    assert "\\boxed{}" in tasks["aime24"][0].messages[0]["content"]
    assert [ex.metadata["line"] for ex in tasks["amc23"]] == [1, 2, 3]
    # equivalent answers score 1 through math-verify (killable worker), wrong ones 0
    assert tasks["amc23"].score(r"\boxed{27.0}", tasks["amc23"][0]) == 1.0
    assert tasks["math500"].score(r"so \boxed{(3, \pi/2)}", tasks["math500"][0]) == 1.0
    assert tasks["gsm8k"].score(r"\boxed{18.00}", tasks["gsm8k"][0]) == 1.0
    assert tasks["aime24"].score(r"\boxed{205}", tasks["aime24"][0]) == 0.0
    assert [tasks["minerva_math"].score(ex.metadata["solution"], ex) for ex in tasks["minerva_math"]] == [1.0] * 3
    # OlympiadBench multi-answer rows: '$69$,$84$' -> '69,84', any order
    olymp = {b.name: t for b, _, t in load_suite(None, ["olympiadbench"], data_dir=shared_data)}["olympiadbench"]
    multi = next(ex for ex in olymp if ex.answer == "69,84")
    assert olymp.score(r"\boxed{84, 69}", multi) == 1.0


def _scripted_math_responses(golds: list[str]) -> list[str]:
    """3 problems x 2 samples: both right; right + wrong; no answer + wrong."""
    g0, g1, _ = golds
    return [rf"\boxed{{{g0}}}", rf"so \boxed{{{g0}}}.", rf"\boxed{{{g1}}}", r"\boxed{123456789}",
            "no answer", r"\boxed{123456789}"]


def test_run_suite_math_scripted(shared_data, scripted_lm, ascii_tokenizer, tmp_path):
    loaded = load_suite("math", data_dir=shared_data, limit=3)
    responses = [r for _, _, t in loaded for r in _scripted_math_responses([ex.answer for ex in t])]
    lm = scripted_lm(responses)
    out = tmp_path / "out"
    s = run_suite(lm, ascii_tokenizer, "math", data_dir=shared_data, limit=3, n=2, ks=(1, 2), temperature=0.6,
                  top_p=0.95, max_new_tokens=64, batch_size=2, out_dir=out, model_name="scripted")
    assert lm.used == len(responses) == 36
    # batches of 2 problems x 2 samples, then 1 x 2, sampling with the given temperature / top-p
    assert [c["rows"] for c in lm.calls] == [4, 2] * 6
    assert all(c["do_sample"] and c["temperature"] == 0.6 and c["top_p"] == 0.95 for c in lm.calls)
    assert list(s["benchmarks"]) == MATH and s["suite"] == "math" and s["model"] == "scripted"
    for name, r in s["benchmarks"].items():
        assert r["num_problems"] == 3 and r["n"] == 2
        assert r["avg@2"] == pytest.approx(3 / 6), name  # per problem 2/2, 1/2, 0/2
        assert r["avg@2_stderr"] == pytest.approx(math.sqrt(1 / 6) / math.sqrt(3))
        assert r["pass@1"] == pytest.approx(0.5)
        assert r["pass@2"] == pytest.approx(2 / 3)
        assert r["format_rate"] == pytest.approx(5 / 6)
        assert r["truncated_rate"] == 0.0 and r["n_timeouts"] == 0 and r["n_exceptions"] == 0
        assert r["source"].endswith(f"{name}/test.jsonl")
    gsm_texts = _scripted_math_responses(["18", "3", "70000"])
    assert s["benchmarks"]["gsm8k"]["mean_response_tokens"] == pytest.approx(
        sum(len(t) + 1 for t in gsm_texts) / 6)  # one token per character plus the EOS
    assert s["average"] == pytest.approx({"avg@2": 0.5, "pass@1": 0.5, "pass@2": 2 / 3})
    assert s["settings"]["n"] == 2 and s["settings"]["ks"] == [1, 2] and s["settings"]["limit"] == 3

    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 36
    assert records[0] == {"benchmark": "gsm8k", "index": 0, "line": 1, "sample": 0,
                          "question": records[0]["question"], "gold": "18", "completion": r"\boxed{18}",
                          "extracted": "18", "correct": 1.0, "format_ok": True, "response_tokens": 11,
                          "truncated": False}
    assert records[0]["question"].startswith("Janet")
    assert [(r["index"], r["sample"], r["correct"], r["extracted"]) for r in records[:6]] == [
        (0, 0, 1.0, "18"), (0, 1, 1.0, "18"), (1, 0, 1.0, "3"), (1, 1, 0.0, "123456789"),
        (2, 0, 0.0, None), (2, 1, 0.0, "123456789")]
    assert [r["benchmark"] for r in records[::6]] == MATH
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(s))


def _write_mc_dir(root):
    (root / "gpqa").mkdir(parents=True)
    gpqa = [{"Question": f"Which particle {i}?", "Correct Answer": "right", "Incorrect Answer 1": "w1",
             "Incorrect Answer 2": "w2", "Incorrect Answer 3": "w3"} for i in range(2)]
    (root / "gpqa" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gpqa))
    mmlu = [{"question": "2+2?", "options": ["3", "4", "5", "6", "7"], "answer": "B", "answer_index": 1},
            {"question": "3+3?", "options": ["6", "4", "5"], "answer": "A", "answer_index": 0}]
    (root / "mmlu_pro.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mmlu))
    (root / "arc_challenge").mkdir()
    arc = [{"question": "Sky?", "choices": {"text": ["blue", "red"], "label": ["A", "B"]}, "answerKey": "A"},
           {"question": "Grass?", "choices": {"text": ["blue", "green"], "label": ["1", "2"]}, "answerKey": "2"}]
    (root / "arc_challenge" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in arc))


def test_run_suite_mc_scripted(tmp_path, scripted_lm, ascii_tokenizer):
    _write_mc_dir(tmp_path / "data")
    loaded = load_suite("mc", data_dir=tmp_path / "data")
    gold = {b.name: [ex.answer for ex in t] for b, _, t in loaded}
    wrong = {"A": "B", "B": "A", "C": "A", "D": "A"}
    responses = [
        f"The answer is ({gold['gpqa'][0]})", rf"\boxed{{{wrong[gold['gpqa'][1]]}}}",  # gpqa: right, wrong
        "Answer: B", "x" * 30 + " The answer is (A)",                                  # mmlu_pro: right, cut
        "A", "The correct option is B.",                                               # arc: right, right
    ]
    lm = scripted_lm(responses)
    s = run_suite(lm, ascii_tokenizer, "mc", data_dir=tmp_path / "data", n=1, temperature=0.0, max_new_tokens=26,
                  out_dir=tmp_path / "out")
    assert all(not c["do_sample"] for c in lm.calls)  # temperature 0 = greedy
    r = s["benchmarks"]
    assert (r["gpqa"]["avg@1"], r["mmlu_pro"]["avg@1"], r["arc_challenge"]["avg@1"]) == (0.5, 0.5, 1.0)
    assert r["mmlu_pro"]["truncated_rate"] == 0.5 and r["mmlu_pro"]["format_rate"] == 0.5
    assert r["mmlu_pro"]["mean_response_tokens"] == pytest.approx((len("Answer: B") + 1 + 26) / 2)
    assert s["average"]["avg@1"] == pytest.approx(2 / 3)
    records = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert [x["extracted"] for x in records] == [gold["gpqa"][0], wrong[gold["gpqa"][1]], "B", None, "A", "B"]
    assert records[2]["question"] == "2+2?\n\n(A) 3\n(B) 4\n(C) 5\n(D) 6\n(E) 7"


def test_per_file_choice_benchmark(tmp_path, scripted_lm, ascii_tokenizer):
    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"question": "q1", "choices": ["a", "b", "c"], "answer": 2}) + "\n" +
                 json.dumps({"question": "q2", "choices": ["a", "b"], "answer": "A"}) + "\n")
    lm = scripted_lm(["The answer is (C)", "The answer is (C)", "Answer: A", "Answer: B"])
    s = run_suite(lm, ascii_tokenizer, None, benchmarks=[f"choice:mine={f}"], n=2, ks=(1, 2), temperature=1.0)
    r = s["benchmarks"]["mine"]
    assert s["suite"] == "custom" and r["avg@2"] == 0.75 and r["pass@1"] == 0.75 and r["pass@2"] == 1.0
    assert s["files"] == {}  # no out_dir, no files


def test_input_errors(tmp_path, shared_data):
    with pytest.raises(SuiteInputError, match=r"unknown suite 'nope' \(--suite\); suites: math, mc"):
        load_suite("nope")
    with pytest.raises(SuiteInputError, match="nothing to evaluate"):
        load_suite(None, [])
    with pytest.raises(SuiteInputError, match=r"data_dir \(--data-dir\) .*missing' is not a directory"):
        load_suite("math", data_dir=tmp_path / "missing")
    with pytest.raises(SuiteInputError, match=r"benchmark 'gsm8k': no file under data_dir .*gsm8k/test.jsonl"):
        load_suite("math", data_dir=tmp_path)
    with pytest.raises(SuiteInputError, match=r"benchmark 'gsm8k': file .*nope.jsonl' not found"):
        load_suite(None, [f"gsm8k={tmp_path / 'nope.jsonl'}"])
    with pytest.raises(SuiteInputError, match=r"unknown benchmark 'gsm9k'; registered: aime24"):
        load_suite(None, ["gsm9k"])
    with pytest.raises(SuiteInputError, match="'gsm8k' is a registered benchmark"):
        load_suite(None, [f"math:gsm8k={tmp_path}"])
    with pytest.raises(SuiteInputError, match="a file of a kind is KIND:NAME"):
        load_suite(None, [f"essay:x={tmp_path}"])
    with pytest.raises(SuiteInputError, match="given twice"):
        load_suite(None, ["gsm8k", "gsm8k"], data_dir=shared_data)
    with pytest.raises(SuiteInputError, match=r"limit \(--limit\) must be a positive integer"):
        load_suite(None, ["gsm8k"], data_dir=shared_data, limit=0)
    bad = tmp_path / "g.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n" + json.dumps({"question": "q"}) + "\n")
    with pytest.raises(SuiteInputError, match=r"g.jsonl:2: benchmark 'gsm8k': row lacks field 'answer'"):
        load_suite(None, [f"gsm8k={bad}"])
    bad.write_text(json.dumps({"question": "q", "answer": "forty"}) + "\n")
    with pytest.raises(SuiteInputError, match=r"g.jsonl:1: benchmark 'gsm8k': GSM8K answer has no '####'"):
        load_suite(None, [f"gsm8k={bad}"])
    bad.write_text(json.dumps({"problem": "p", "solution": "no box"}) + "\n")
    with pytest.raises(SuiteInputError, match=r"g.jsonl:1: benchmark 'g': no 'answer' field and no \\boxed"):
        load_suite(None, [f"math:g={bad}"])
    # settings are checked before the model is touched (model=None here)
    for kwargs, match in [({"n": 0}, r"n \(--n\) must be a positive integer"),
                          ({"n": 2, "ks": (3,), "temperature": 1.0}, r"ks \(--k\): every k .* \[1, n=2\]"),
                          ({"temperature": -1.0}, r"temperature \(--temperature\) must be >= 0"),
                          ({"top_p": 0.0}, r"top_p \(--top-p\) must be in \(0, 1\]"),
                          ({"n": 4, "temperature": 0.0}, "decodes greedily"),
                          ({"max_new_tokens": 0}, r"max_new_tokens \(--max-new-tokens\)")]:
        with pytest.raises(SuiteInputError, match=match):
            run_suite(None, None, "math", data_dir=shared_data, **kwargs)


@pytest.mark.parametrize("argv, message", [
    (["--suite", "nope"], "unknown suite 'nope' (--suite)"),
    (["--suite", "math", "--data-dir", "/nonexistent/dir"],
     "data_dir (--data-dir) '/nonexistent/dir' is not a directory"),
    (["--benchmark", "gsm8k=/nonexistent/g.jsonl"], "benchmark 'gsm8k': file '/nonexistent/g.jsonl' not found"),
    (["--benchmark", "gsm8k="], "must be NAME, NAME=PATH"),
    (["--suite", "mc", "--n", "2", "--k", "3"], "ks (--k): every k must be an integer in [1, n=2]"),
    (["--suite", "mc", "--k", "one"], "--k 'one' must be comma-separated integers"),
    (["--suite", "mc", "--limit", "0"], "limit (--limit) must be a positive integer"),
])
def test_cli_errors_before_loading_a_model(argv, message, capsys):
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("echotrain eval: error: ") and message in err


def _save_tiny_model(path, tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)


def test_cli_end_to_end_tiny_model(tmp_path, ascii_tokenizer, capsys):
    _save_tiny_model(tmp_path / "model", ascii_tokenizer)
    f = tmp_path / "mc.jsonl"
    f.write_text("".join(json.dumps({"question": f"q{i}", "choices": ["a", "b", "c"], "answer": i % 3}) + "\n"
                         for i in range(3)))
    out = tmp_path / "out"
    rc = main(["eval", "--model", str(tmp_path / "model"), "--benchmark", f"choice:mini={f}", "--n", "2", "--k",
               "1,2", "--temperature", "1.0", "--max-new-tokens", "4", "--batch-size", "2", "--out", str(out),
               "--json", "--no-progress", "--threads", "1"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((out / "summary.json").read_text())
    assert printed == saved and saved["suite"] == "custom"
    r = saved["benchmarks"]["mini"]
    assert r["num_problems"] == 3 and r["n"] == 2 and r["mean_response_tokens"] <= 4
    assert saved["settings"]["max_new_tokens"] == 4 and saved["settings"]["ks"] == [1, 2]
    assert len((out / "samples.jsonl").read_text().splitlines()) == 6
    # the table output names every benchmark and the average
    assert main(["eval", "--model", str(tmp_path / "model"), "--benchmark", f"choice:mini={f}", "--n", "1",
                 "--temperature", "0", "--max-new-tokens", "2", "--out", str(tmp_path / "out2"), "--no-progress",
                 "--threads", "1"]) == 0
    table = capsys.readouterr().out
    assert "mini" in table and "average" in table and "avg@1" in table


def test_evaluate_run_dir_writes_and_skips(tmp_path, ascii_tokenizer, monkeypatch):
    import yaml

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"model": "unused"}))
    _save_tiny_model(run / "final_model", ascii_tokenizer)
    f = tmp_path / "mc.jsonl"
    f.write_text(json.dumps({"question": "q", "choices": ["a", "b"], "answer": "A"}) + "\n")
    kwargs = dict(benchmarks=[f"choice:mini={f}"], n=1, temperature=0.0, max_new_tokens=2)
    first = evaluate_run_dir(run, None, **kwargs)
    assert (run / "suite" / "custom" / "summary.json").is_file() and first["model"].endswith("final_model")
    import echotrain.runtime.loading as ev

    monkeypatch.setattr(ev, "load_for_eval", lambda *a, **k: pytest.fail("a finished evaluation was redone"))
    assert evaluate_run_dir(run, None, **kwargs) == json.loads(json.dumps(first))
    with pytest.raises(pytest.fail.Exception):  # other settings: evaluated again
        evaluate_run_dir(run, None, **{**kwargs, "max_new_tokens": 3})
    with pytest.raises(SuiteInputError, match="unknown suite"):  # inputs checked before the model
        evaluate_run_dir(run, "nope")


def test_sources_folder_and_hub(shared_data, tmp_path):
    from echotrain.evalsuite.registry import HubSource, parse_source

    assert parse_source("hf:allenai/ai2_arc:ARC-Challenge@validation") == HubSource(
        "allenai/ai2_arc", "ARC-Challenge", "validation")
    assert parse_source("hf:openai/gsm8k") == HubSource("openai/gsm8k", None, "test")
    assert str(HubSource("openai/gsm8k", "main", "test")) == "hf:openai/gsm8k:main@test"
    # a folder source reads its test.jsonl (gsm8k/ also holds train.jsonl)
    [(bench, src, task)] = load_suite(None, {"gsm8k": shared_data / "gsm8k"}, limit=2)
    assert src.endswith("gsm8k/test.jsonl") and len(task) == 2
    with pytest.raises(SuiteInputError, match="holds no test.jsonl"):
        load_suite(None, {"gsm8k": tmp_path})
    # a hub source that cannot be loaded (tests run offline) names the benchmark and the way out
    with pytest.raises(SuiteInputError, match=r"benchmark 'gsm8k': could not load hf:echotrain/none@test .*"
                                              r"give a local file with --data-dir DIR or gsm8k=PATH"):
        load_suite(None, ["gsm8k=hf:echotrain/none"])


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent/model"], "/nonexistent/model"),
    (["--threads", "100000"], "--threads"),
    (["--device", "cuda:7"], "--device"),
])
def test_cli_suite_runs_the_eval_preflight_checks(argv, message, tmp_path, capsys):
    """Review: --suite/--benchmark bypassed issue 10's checks (a traceback, exit 1, or a crash)."""
    f = tmp_path / "mc.jsonl"
    f.write_text(json.dumps({"question": "q", "choices": ["a", "b"], "answer": 0}) + "\n")
    assert main(["eval", "--benchmark", f"choice:mini={f}", "--no-progress", "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("echotrain eval: error: ") and message in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("setting, want", [("off", torch.float32), ("bfloat16", torch.bfloat16)])
def test_eval_autocast_flag_sets_the_forward_precision(setting, want, tmp_path, ascii_tokenizer, monkeypatch):
    """``echotrain eval --autocast`` (task and suite paths): the model's Linear outputs are in the
    chosen precision; the default is float32."""
    _save_tiny_model(tmp_path / "model", ascii_tokenizer)
    seen: list[torch.dtype] = []
    from echotrain.runtime import loading as evaluate_module

    real_load = evaluate_module.load_for_eval

    def load_and_hook(*a, **k):
        model, tok, desc = real_load(*a, **k)
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
        return model, tok, desc

    monkeypatch.setattr(evaluate_module, "load_for_eval", load_and_hook)
    f = tmp_path / "mc.jsonl"
    f.write_text(json.dumps({"question": "q", "choices": ["a", "b"], "answer": 0}) + "\n")
    flag = [] if setting == "off" else ["--autocast", setting]
    assert main(["eval", "--model", str(tmp_path / "model"), "--benchmark", f"choice:mini={f}", "--n", "1",
                 "--max-new-tokens", "2", "--out", str(tmp_path / "o"), "--no-progress", "--threads", "1",
                 "--json", *flag]) == 0
    assert seen and set(seen) == {want}
    seen.clear()
    assert main(["eval", "--model", str(tmp_path / "model"), "--prompts", "2", "--n", "1", "--max-new-tokens", "2",
                 "--threads", "1", "--json", *flag]) == 0
    assert seen and set(seen) == {want}


def test_eval_generates_as_the_run_did(tmp_path, ascii_tokenizer, monkeypatch, capsys):
    """Issue 36 item 7: ``echotrain eval --model RUN_DIR`` (``--suite``/``--benchmark`` and
    ``--task``) hands the run's ``decode_loop`` and ``sampler`` to generation; ``--decode-loop`` /
    ``--sampler`` override them; another model gets the trainer's defaults. The suite records them."""
    import yaml

    from echotrain.runtime import rollout
    from echotrain.train import evaluate as task_eval

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"model": "unused", "task": "testbed", "max_new_tokens": 2,
                                                     "decode_loop": "generate", "sampler": "multinomial"}))
    _save_tiny_model(run / "final_model", ascii_tokenizer)
    _save_tiny_model(tmp_path / "model", ascii_tokenizer)
    seen: list[tuple[str, str]] = []

    def spy(real):
        def generate(*args, **kwargs):
            seen.append((kwargs.get("decode_loop"), kwargs.get("sampler")))
            return real(*args, **kwargs)
        return generate

    monkeypatch.setattr(rollout, "generate_rollouts", spy(rollout.generate_rollouts))  # the suite's (imported per call)
    monkeypatch.setattr(task_eval, "generate_rollouts", spy(task_eval.generate_rollouts))  # --task's
    f = tmp_path / "mc.jsonl"
    f.write_text(json.dumps({"question": "q", "choices": ["a", "b"], "answer": 0}) + "\n")
    suite = ["--benchmark", f"choice:mini={f}", "--n", "1", "--max-new-tokens", "2", "--no-progress", "--threads", "1",
             "--json"]
    task = ["--prompts", "2", "--n", "1", "--threads", "1", "--json"]
    cases = [(["--model", str(run), *suite, "--out", str(tmp_path / "o1")], ("generate", "multinomial")),
             (["--model", str(run), *suite, "--out", str(tmp_path / "o2"), "--sampler", "inverse_cdf"],
              ("generate", "inverse_cdf")),
             (["--model", str(tmp_path / "model"), *suite, "--out", str(tmp_path / "o3")], ("echotrain", "inverse_cdf")),
             (["--model", str(run), *task], ("generate", "multinomial")),
             (["--model", str(run), *task, "--decode-loop", "echotrain"], ("echotrain", "multinomial")),
             (["--model", str(tmp_path / "model"), "--task", "testbed", *task], ("echotrain", "inverse_cdf"))]
    capsys.readouterr()
    for i, (argv, want) in enumerate(cases):
        seen.clear()
        assert main(["eval", *argv]) == 0
        out = capsys.readouterr()
        printed = json.loads(out.out)
        assert seen and set(seen) == {want}, argv
        said = {0: "decode_loop=generate, sampler=multinomial as the run", 1: "decode_loop=generate as the run"}
        if i in said:  # the first line says what came from the run
            assert out.err.startswith(f"echotrain eval: {said[i]} ({run / 'config.yaml'}); --decode-loop, --sampler "
                                      "set them\n"), out.err
        settings = printed.get("settings", printed)  # the suite's summary block, or --task's JSON line
        assert (settings["decode_loop"], settings["sampler"]) == want
    # the Python hook of `echotrain compare` too
    seen.clear()
    summary = evaluate_run_dir(run, None, benchmarks=[f"choice:mini={f}"], n=1, temperature=0.0, max_new_tokens=2)
    assert set(seen) == {("generate", "multinomial")}
    assert (summary["settings"]["decode_loop"], summary["settings"]["sampler"]) == ("generate", "multinomial")
