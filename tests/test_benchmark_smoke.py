"""Smoke runs of benchmark scripts whose measurement needs hardware this machine lacks: the code
path runs here on the CPU testbed, so the script works when a GPU is lent."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def saved_tiny_llama(tmp_path):
    """The tests' tiny Llama and its tokenizer saved as a model folder; its path."""
    from tests.train.conftest import make_model, make_tokenizer

    tok = make_tokenizer()
    make_model(tok).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def test_overlap_benchmark_runs_on_the_cpu(tmp_path):
    bench = _load("bench_overlap_gpu")
    res = bench.main(["--devices", "cpu", "--model", "testbed", "--reps", "1", "--new-tokens", "4", "--prompts", "2",
                      "--generations", "2", "--json", str(tmp_path / "o.json")])
    assert res["g_s"] > 0 and res["u_s"] > 0 and res["overlap_s"] > 0
    assert res["bound"] == pytest.approx((res["g_s"] + res["u_s"]) / max(res["g_s"], res["u_s"]))
    assert 1.0 <= res["bound"] <= 2.0 and (tmp_path / "o.json").exists()


def test_decode_loop_benchmark_runs_and_compares_like_with_like():
    """The A/B of the decode loops runs (on the testbed, which keeps its own generate: both arms
    must then return the same tokens) and reports a ratio of the two medians."""
    res = _load("bench_decode_loop").main(["--model", "testbed", "--task", "testbed", "--prompts", "2",
                                           "--generations", "2", "--max-new-tokens", "4", "--reps", "1",
                                           "--threads", "1"])
    assert res["same_tokens"] is True
    assert res["ratio"] == pytest.approx(res["echotrain_s"] / res["generate_s"])


def test_decode_sampling_benchmark_draws_the_same_tokens_both_ways():
    """The before/after A/B of the decode step's vocabulary work: both arms draw the same tokens from the same
    RNG state, and the ratio is after / before of the medians."""
    res = _load("bench_decode_sampling").main(["--rows", "16,3", "--vocab", "1000", "--reps", "2", "--threads", "1",
                                               "--no-model"])
    assert set(res) == {16, 3}
    for row in res.values():
        assert row["same_tokens"] is True
        assert row["ratio"] == pytest.approx(row["after"] / row["before"])


def test_rollout_autocast_benchmark_compares_the_same_tokens(saved_tiny_llama):
    """The A/B of generation under no_grad against inference_mode (bfloat16 autocast) runs end to end
    on a tiny saved Llama: both arms draw the same tokens (the same bfloat16 weights, cached or
    not), and the ratio is no_grad / inference_mode of the medians."""
    res = _load("bench_rollout_autocast").main(["--model", saved_tiny_llama, "--prompts", "2",
                                                "--generations", "2", "--max-new-tokens", "4", "--reps", "1",
                                                "--threads", "1"])
    assert res["same_tokens"] is True
    assert res["ratio"] == pytest.approx(res["no_grad_s"] / res["inference_mode_s"])
    assert 0 < res["row_steps"] <= 16


def test_packing_benchmark_runs_and_reports_ratios():
    """The A/B of the update layouts runs end to end (the testbed, which has no packed forward, so
    'packed' falls back to the KV-cache layout: same values); ratios are to the KV-cache layout and
    the plain layout runs the prompt once per row (more tokens)."""
    res = _load("bench_packing").main(["--model", "testbed", "--task", "testbed", "--prompts", "2",
                                       "--generations", "2", "--max-new-tokens", "4", "--reps", "1",
                                       "--threads", "1", "--plain"])
    assert set(res) == {"kv cache", "packed", "packed, whole-row mask", "plain"}
    assert res["kv cache"]["ratio"] == 1.0
    assert res["plain"]["ratio"] == pytest.approx(res["plain"]["median_s"] / res["kv cache"]["median_s"])
    assert res["plain"]["tokens"] > res["kv cache"]["tokens"] >= res["packed"]["tokens"]


def test_update_passes_benchmark_runs_every_arm_on_the_same_update():
    """The A/B of the update's passes runs end to end on a tiny ECHO step of the testbed in float32
    (two mini-batches: the sampler's log-probs and the kept pre-pass both apply); every arm
    computes the same update up to float rounding, and ratios are to 'before'."""
    res = _load("bench_update_passes").main(["--threads", "1", "--reps", "1", "--set", "model=testbed",
                                             "--set", "task=testbed", "--set", "prompts_per_step=2",
                                             "--set", "num_generations=4", "--set", "max_new_tokens=4",
                                             "--set", "micro_batch_size=2", "--set", "autocast=off"])
    assert list(res) == ["before", "sampler log-probs", "kept pre-pass", "sparse embedding", "all"]
    assert res["before"]["ratio"] == 1.0 and res["before"]["max_metric_diff"] == 0.0
    for arm in res.values():
        assert arm["median_s"] > 0 and arm["max_metric_diff"] < 1e-4


def test_update_passes_benchmark_takes_arms_of_any_setting():
    """--arm NAME:KEY=VALUE replaces the built-in arms; the first is the baseline of the ratios.
    Micro-batches of 2 and 8 rows compute the same update (the exact global normalisers)."""
    res = _load("bench_update_passes").main(["--threads", "1", "--reps", "1", "--set", "model=testbed",
                                             "--set", "task=testbed", "--set", "prompts_per_step=2",
                                             "--set", "num_generations=4", "--set", "max_new_tokens=4",
                                             "--set", "autocast=off", "--arm", "mb2:micro_batch_size=2",
                                             "--arm", "mb8:micro_batch_size=8,log_prob_prepass=retain"])
    assert list(res) == ["mb2", "mb8"]
    assert res["mb2"]["ratio"] == 1.0 and res["mb2"]["max_metric_diff"] == 0.0
    assert res["mb8"]["max_metric_diff"] < 1e-4  # the same update up to the summation order
    assert res["mb2"]["settings"] == {"micro_batch_size": 2}  # each arm ran its own settings
    assert res["mb8"]["settings"] == {"micro_batch_size": 8, "log_prob_prepass": "retain"}


def test_prefill_benchmark_runs_both_arms_on_the_same_tokens():
    """The A/B of the common-prefix prefill runs end to end on the testbed (its byte model takes no
    KV cache, so both arms decode alike): same tokens, ratios to 'per prompt', the token counts."""
    res = _load("bench_prefill").main(["--threads", "1", "--reps", "1", "--set", "model=testbed",
                                       "--set", "task=testbed", "--set", "prompts_per_step=2",
                                       "--set", "num_generations=2", "--set", "max_new_tokens=4",
                                       "--set", "eval_prompts=2"])
    for what in ("rollouts", "evaluation"):
        assert res[what]["per prompt"]["ratio"] == 1.0 and res[what]["same_tokens"] is True
    C = res["common_prefix"]
    assert res["prefill_tokens"]["common prefix"] == res["prefill_tokens"]["per prompt"] - C * (2 - 1)


def test_adamw_fused_benchmark_times_every_arm_from_one_state():
    """The A/B of AdamW's kernels runs on the testbed model; ratios are to the for-loop arm and
    the three arms end within float rounding of each other (the same update)."""
    res = _load("bench_adamw_fused").main(["--model", "testbed", "--reps", "1", "--steps", "2", "--threads", "1"])
    assert set(res) == {"for-loop (foreach=False)", "foreach", "fused"}
    assert res["for-loop (foreach=False)"]["ratio"] == 1.0
    assert res["fused"]["ratio"] == pytest.approx(res["fused"]["median_s"] / res["for-loop (foreach=False)"]["median_s"])
    assert all(r["max_param_diff"] < 1e-6 for r in res.values())


def test_bandwidth_benchmark_reports_each_kernel_against_the_peak():
    """The peak is the best of copy, in-place add, in-place mul and sum: those four are <= 1 of it, one is 1."""
    res = _load("bench_bandwidth").main(["--threads", "1", "--mib", "4", "--params", "4096", "--rounds", "1",
                                         "--repeats", "2"])
    (r,) = res["rounds"]
    peak_kernels = [r[k]["of_peak"] for k in ("copy_ (2)", "in-place add_ (3)", "in-place mul_ (2)",
                                                     "read-only sum (1)")]
    assert max(peak_kernels) == 1.0 and all(0 < v <= 1.0 for v in peak_kernels)
    assert len(r) == 6 and all(v["gb_s"] > 0 for v in r.values())


def test_adv_estimator_benchmark_times_every_estimator():
    from echotrain.rl import ADV_METHODS

    res = _load("bench_adv_estimators").main(["--prompts", "2", "--generations", "2", "--T", "8", "--rounds", "2"])
    assert set(res) == set(ADV_METHODS)
    assert res["grpo"]["ratio"] == pytest.approx(1.0) or res["grpo"]["median_s"] == 0
    assert all(r["step_share"] == pytest.approx(r["median_s"] / 16.0) for r in res.values())


def test_episodes_benchmark_reports_both_throughputs():
    """benchmarks/bench_episodes.py on the testbed: feedback episodes of several turns against
    single-turn rollouts, model tokens per second of each and their ratio."""
    res = _load("bench_episodes").main(["--model", "testbed", "--task", "testbed", "--prompts", "2",
                                        "--generations", "2", "--turns", "2", "--max-new-tokens", "8", "--reps", "1"])
    assert res["episodes"]["env_tokens"] > 0 and res["episodes"]["turns"] > 1
    assert res["ratio"] == pytest.approx(res["episodes"]["tokens_per_s"] / res["single-turn"]["tokens_per_s"])
    assert res["ratio_no_cache"] == pytest.approx(res["episodes-no-cache"]["tokens_per_s"]
                                                  / res["single-turn"]["tokens_per_s"])
    assert res["episodes-no-cache"]["env_tokens"] > 0 and res["cache_kib_per_position"] is None  # testbed: no HF cache


@pytest.mark.slow  # three echotrain processes, ~30 s on a loaded core
def test_distill_benchmark_runs_and_reports_ratios():
    """The teacher-pass benchmark's three arms run on the testbed (teacher = a second copy) and each
    arm's ratios are to the no-teacher arm of the same run."""
    res = _load("bench_distill").main(["--model", "testbed", "--steps", "1", "--max-new-tokens", "4",
                                       "--top-k", "4", "--generations", "2"])
    assert list(res) == ["rl", "rl+distill (full vocabulary)", "rl+distill (top-4)"]
    assert res["rl"]["step_ratio"] == 1.0 and res["rl"]["teacher_s"] == 0.0
    for name in list(res)[1:]:
        assert res[name]["teacher_s"] > 0 and res[name]["teacher_mb"] > 0
        assert res[name]["step_ratio"] == pytest.approx(res[name]["step_s"] / res["rl"]["step_s"])


def test_rollout_autocast_benchmark_arms(saved_tiny_llama, monkeypatch):
    """Each arm of bench_rollout_autocast runs under its own mode (inference mode only in the
    inference_mode arm, bfloat16 autocast in both), the warm-up round is not timed, same_tokens
    compares the two arms, row_steps counts the response mask."""
    import echotrain.runtime.rollout as rollout
    real, seen = rollout.generate_rollouts, []

    def spy(*a, **k):
        b = real(*a, **k)
        im = torch.is_inference_mode_enabled()
        seen.append((im, torch.is_autocast_enabled("cpu")))
        if im:  # make the arms differ: same_tokens must see it
            b.response_ids = b.response_ids + 1
        b.response_mask[0] = 0  # row_steps must follow the mask
        return b

    monkeypatch.setattr(rollout, "generate_rollouts", spy)
    res = _load("bench_rollout_autocast").main(["--model", saved_tiny_llama, "--prompts", "2",
                                                "--generations", "2", "--max-new-tokens", "4", "--reps", "2",
                                                "--threads", "1"])
    assert sorted(set(seen)) == [(False, True), (True, True)] and len(seen) == 2 * 3
    assert res["same_tokens"] is False
    assert all(len(v) == 2 for v in res["per_rep_s"].values())
    assert res["row_steps"] < 2 * 2 * 4


def test_launch_count_benchmark_counts_each_phase_of_a_step():
    """The launch counter runs one testbed step per arm: every phase dispatches ops, the counts
    do not depend on the arm when the setting changes nothing (the testbed has no packed
    forward, so packed_attention is moot), and the ratio is total ops / the job's."""
    res = _load("bench_launches").main(["--model", "testbed", "--task", "testbed", "--prompts", "2",
                                        "--generations", "2", "--max-new-tokens", "4", "--threads", "1",
                                        "--arm", "packed_attention=mask", "--arm", "num_mini_batches=1"])
    job, same, one = res["job"], res["packed_attention=mask"], res["num_mini_batches=1"]
    assert {"collect", "update", "advantages", "metrics"} <= set(job["ops"])
    assert all(n > 0 for n in job["ops"].values()) and job["syncs"]["collect"] > 0
    assert same["ops"] == job["ops"] and same["ratio"] == 1.0
    assert job["total_ops"] == sum(job["ops"].values())
    assert one["ops"]["update"] < job["ops"]["update"]  # one optimizer step instead of two
    assert one["ratio"] == pytest.approx(one["total_ops"] / job["total_ops"], abs=1e-3)
    import echotrain.train.trainer as trainer_module

    bench = _load("bench_launches")
    for _, name, _label in bench.PHASES:  # the trainer module's functions are its own again
        if hasattr(trainer_module, name):
            assert getattr(trainer_module, name).__module__ != "bench_launches", name


def test_launch_count_benchmark_labels_a_phase_only_while_its_function_runs():
    bench = _load("bench_launches")
    phase = ["other"]
    seen = bench.labelled(lambda: phase[0], phase, "update")
    assert seen() == "update" and phase == ["other"]

    def boom():
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        bench.labelled(boom, phase, "collect")()
    assert phase == ["other"]


def test_launch_count_benchmark_knows_which_ops_make_the_host_wait():
    bench = _load("bench_launches")
    x = torch.arange(6.0)
    assert bench._is_sync("_local_scalar_dense.default", (x,)) and bench._is_sync("nonzero.default", (x,))
    assert bench._is_sync("index.Tensor", (x, [x > 2])) and bench._is_sync("index_put_.default", (x, [x > 2], x[:3]))
    assert not bench._is_sync("index.Tensor", (x, [torch.tensor([0, 2])]))
    assert not bench._is_sync("index.Tensor", (x, [None, x > 2][:1]))
    assert not bench._is_sync("add.Tensor", (x, x)) and not bench._is_sync("mm.default", (x, x))
    for name in bench.SYNC_OPS:  # every op the host waits on, with any overload
        assert bench._is_sync(f"{name}.default", (x,)), name


def test_roofline_benchmark_counts_decode_bytes_as_the_runs_meter_does(saved_tiny_llama, monkeypatch):
    """The per-phase roofline runs end to end on a tiny saved Llama (peaks given, not measured) and
    counts a decode step's weights in the compute dtype, as every run's meter does: 4 bytes in
    float32, and decode_bytes follows from the shape and the responses' lengths."""
    monkeypatch.setenv("ECHOTRAIN_ROOFLINE_PEAKS", "1e11,1e10")
    res = _load("bench_roofline").main(["--set", f"model={saved_tiny_llama}", "--set", "task=testbed",
                                        "--set", "autocast=off", "--prompts", "2", "--generations", "2",
                                        "--max-new-tokens", "4", "--threads", "1"])
    assert res["param_bytes"] == 4 and res["decode_bytes"] > 0
    assert [row[0] for row in res["rows"]] == ["prefill", "decode", "old log-probs", "pre-pass", "with-grad forward",
                                               "backward", "optimizer"]
    assert res["peaks"]["gemm_flops_per_s"] == 1e11 and 0 < res["update_mfu"] and 0 < res["decode_bw_util"]


def test_decode_linear_benchmark_times_every_shape_and_mode(saved_tiny_llama):
    """The A/B of ``decode_linear`` runs end to end on a tiny saved Llama: a row per (shape, row count)
    with ratios of its own medians, every mode's rollouts, and ``torch`` drawing its own tokens."""
    import torch

    res = _load("bench_decode_linear").main(["--model", saved_tiny_llama, "--prompts", "2", "--generations", "2",
                                             "--max-new-tokens", "4", "--reps", "1", "--threads", "1",
                                             "--rows", "1,3", "--calls", "2"])
    model_shapes = {tuple(m.weight.shape) for m in _tiny_llama_linears(saved_tiny_llama)}
    assert {(r["shape"], r["rows"]) for r in res["shapes"]} == {(s, n) for s in model_shapes for n in (1, 3)}
    for r in res["shapes"]:
        assert r["packed_ratio"] == pytest.approx(r["onednn_packed_ms"] / r["torch_ms"])
        assert r["max_abs_diff"] < 1e-3
    assert res["torch"]["same_tokens"] is True and res["torch"]["ratio"] == 1.0
    assert set(res) == {"shapes", "torch", "onednn", "onednn_packed"}
    assert torch.backends.mkldnn.is_available()
    one = _load("bench_decode_linear").main(["--model", saved_tiny_llama, "--prompts", "2", "--generations", "2",
                                             "--max-new-tokens", "4", "--reps", "1", "--threads", "1", "--no-shapes",
                                             "--only", "onednn"])
    assert set(one) == {"shapes", "onednn"} and one["shapes"] == [] and one["onednn"]["peak_mb"] > 50


def _tiny_llama_linears(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return [m for m in AutoModelForCausalLM.from_pretrained(path).modules() if type(m) is torch.nn.Linear]


def test_trl_step_benchmark_passes_set_to_echotrain_only(tmp_path, monkeypatch):
    """``bench_trl_step.py --set KEY=VALUE`` reaches echotrain's config (and a bad value is refused there)."""
    import os

    from echotrain.errors import ConfigError
    from tests.train.conftest import DigitTask, make_model, make_tokenizer

    # the script sets the offline variables at import: restored after the test (later tests probe the hub)
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "TOKENIZERS_PARALLELISM",
                "WANDB_DISABLED"):
        monkeypatch.setenv(key, os.environ.get(key, ""))  # recorded (absent or not): undone after the test
        if not os.environ[key]:
            monkeypatch.delenv(key)
    bench = _load("bench_trl_step")
    tok = make_tokenizer()
    for given, want in (([], "onednn"), (["--set", "decode_linear=torch"], "torch")):
        args = bench.parse_args(["--threads", "1", *given])
        trainer = bench.build_echotrain(args, make_model(tok), tok, DigitTask(), str(tmp_path / want))
        assert trainer.cfg.decode_linear == want
    with pytest.raises(ConfigError, match="decode_linear"):
        bench.build_echotrain(bench.parse_args(["--set", "decode_linear=mkl"]), make_model(tok), tok, DigitTask(),
                              str(tmp_path / "bad"))


def test_adamw4bit_codes_benchmark_times_both_code_widths(monkeypatch):
    """``bench_adamw4bit_codes.py``: every part is timed, and the step with uint8 and int32 codes (tiny sizes)."""
    bench = _load("bench_adamw4bit_codes")
    made = []
    real = bench.AdamW4bit
    monkeypatch.setattr(bench, "AdamW4bit", lambda params, **kw: made.append(kw["widen_codes"]) or real(params, **kw))
    res = bench.main(["--numel", "4096", "--calls", "2", "--shape", "64", "80", "--pieces", "2", "--rounds", "2",
                      "--steps", "1"])
    assert made == [False, True]  # the "uint8" arm reads the codes, the "int32" arm their copies
    assert set(res["parts_us"]) == {"unpack uint8 codes", "unpack int32 codes", "AdamW arithmetic", "DE quantization",
                                    "Linear quantization", "ATen uint8 -> int32 (eager)"}
    assert all(v > 0 for v in res["parts_us"].values())
    step = res["step"]
    assert len(step["torch_adamw_ms"]) == len(step["uint8_ms"]) == len(step["int32_ms"]) == 2
    assert min(step["int32_over_uint8"], step["uint8_over_torch_adamw"], step["int32_over_torch_adamw"]) > 0
    assert isinstance(res["widen_codes_default"], bool) and res["threads"] == 1
    threads = torch.get_num_threads()
    res = _load("bench_adamw4bit_codes").main(["--skip-parts", "--shape", "64", "80", "--pieces", "1", "--rounds", "1",
                                               "--steps", "1", "--threads", "2"])
    assert "parts_us" not in res and res["threads"] == 2 and len(res["step"]["int32_ms"]) == 1
    assert torch.get_num_threads() == threads  # restored
