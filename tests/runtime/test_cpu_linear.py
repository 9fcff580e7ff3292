"""decode_linear: oneDNN's inner product for the float32 linear layers of generation on a CPU
(echotrain.runtime.cpu_linear)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F

from echotrain.runtime import cpu_linear
from echotrain.runtime.cpu_linear import DECODE_LINEARS, linear_backend, onednn_linear_available

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN")


#: the size rule as the module declares it (the fixture below lowers it for the tests' tiny models)
SIZE_RULE = cpu_linear.MIN_ONEDNN_WEIGHTS


@pytest.fixture(autouse=True)
def every_layer(monkeypatch):
    """Small layers are taken over too: the tests' models are tiny."""
    monkeypatch.setattr(cpu_linear, "MIN_ONEDNN_WEIGHTS", 0)


class Counting(torch.nn.Module):
    """Two plain linears and a subclass of nn.Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(24, 40)
        self.b = torch.nn.Linear(40, 300, bias=False)
        self.sub = type("MyLinear", (torch.nn.Linear,), {})(300, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sub(self.b(self.a(x)))


@pytest.fixture
def calls(monkeypatch):
    """The oneDNN calls made (the weight each received: the module's own or a packed copy)."""
    seen: list[torch.Tensor] = []
    real = torch.ops.mkldnn._linear_pointwise

    class Op:
        def __call__(self, x, w, b, *rest):
            seen.append(w)
            return real(x, w, b, *rest)

    monkeypatch.setattr(cpu_linear.torch.ops.mkldnn, "_linear_pointwise", Op(), raising=False)
    return seen


@pytest.mark.parametrize("mode", ["onednn", "onednn_packed"])
def test_no_grad_forwards_use_onednn_and_agree_with_f_linear(mode, calls):
    m = Counting()
    x = torch.randn(5, 3, 24)
    with torch.no_grad():
        ref = m(x)
        with linear_backend(m, mode):
            out = m(x)
    assert len(calls) == 2  # a and b; the nn.Linear subclass keeps F.linear
    assert (calls[0] is m.a.weight) == (mode == "onednn")
    assert calls[0].is_mkldnn == (mode == "onednn_packed")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert "forward" not in m.a.__dict__ and "forward" not in m.b.__dict__  # the modules are as they were


def test_with_grad_autocast_and_torch_mode_keep_f_linear(calls):
    m = Counting()
    x = torch.randn(4, 24)
    with linear_backend(m, "onednn_packed"):
        y = m(x)  # grad enabled: the update's forwards
        y.sum().backward()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            m(x)
        with torch.no_grad(), linear_backend(m, "torch"):  # the innermost context decides
            m(x)
            with linear_backend(m, "torch"):  # nested torch contexts (a suite's around each call's)
                m(x)
            m(x)
        with torch.no_grad():
            m(x)  # back in the outer onednn_packed context: oneDNN again
    assert len(calls) == 2
    assert m.a.weight.grad is not None


def test_other_threads_keep_f_linear(calls):
    m = Counting()
    x = torch.randn(4, 24)
    seen_other = []

    def other():
        with torch.no_grad():
            m(x)
        seen_other.append(len(calls))

    with torch.no_grad(), linear_backend(m, "onednn"):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert seen_other == [0]
        m(x)
    assert len(calls) == 2


def test_packed_copies_are_made_once_and_again_after_a_write(calls):
    m = Counting()
    x = torch.randn(4, 24)
    with torch.no_grad(), linear_backend(m, "onednn_packed"):
        m(x)
        with linear_backend(m, "onednn_packed"):  # nested, same mode: the outer copies
            m(x)
        first = calls[0]
        assert calls[2] is first
        m.a.weight.add_(1.0)  # an optimizer step between two forwards
        out = m(x)
        assert calls[4] is not first
        ref = m.sub(F.linear(F.linear(x, m.a.weight, m.a.bias), m.b.weight))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_deep_copy_inside_the_context_computes_with_its_own_weights():
    m = Counting()
    x = torch.randn(4, 24)
    with torch.no_grad(), linear_backend(m, "onednn_packed"):
        c = copy.deepcopy(m)
        c.a.weight.mul_(2.0)
        torch.testing.assert_close(c(x), c.sub(c.b(F.linear(x, c.a.weight, c.a.bias))), rtol=1e-5, atol=1e-5)
    assert "forward" not in m.a.__dict__


def test_an_unknown_mode_is_refused_and_nothing_is_left_installed():
    m = Counting()
    with pytest.raises(ValueError, match="decode_linear must be one of"):
        with linear_backend(m, "mkl"):
            pass
    assert "forward" not in m.a.__dict__
    assert DECODE_LINEARS == ("torch", "onednn", "onednn_packed")


def test_an_error_inside_restores_the_modules():
    m = Counting()
    with pytest.raises(RuntimeError, match="boom"):
        with linear_backend(m, "onednn"):
            assert "forward" in m.a.__dict__
            raise RuntimeError("boom")
    assert "forward" not in m.a.__dict__ and not cpu_linear._installed
    assert getattr(cpu_linear._local, "state", None) is None


# ------------------------------------------------------------------ through the trainer and the CLIs
def _count_onednn(monkeypatch) -> list[bool]:
    """Patch the oneDNN op to record, per call, whether grad was enabled (it must never be)."""
    seen: list[bool] = []
    real = torch.ops.mkldnn._linear_pointwise

    class Op:
        def __call__(self, *a):
            seen.append(torch.is_grad_enabled())
            return real(*a)

    monkeypatch.setattr(cpu_linear.torch.ops.mkldnn, "_linear_pointwise", Op(), raising=False)
    return seen


@pytest.mark.parametrize("mode", DECODE_LINEARS)
def test_the_trainer_generates_with_its_decode_linear_and_updates_with_f_linear(mode, monkeypatch, tmp_path):
    """``decode_linear`` from the CLI reaches generation (rollouts and the held-out evaluation) and
    nothing else: every oneDNN call is without grad, and on-policy the update's first ratio is 1
    exactly (old and new log-probs both F.linear's)."""
    import json

    from echotrain.cli import main

    seen = _count_onednn(monkeypatch)
    args = ["train", "model=testbed", "task=testbed", "steps=1", "prompts_per_step=2", "num_generations=2",
            "max_new_tokens=4", "num_mini_batches=1", "micro_batch_size=4", "eval_prompts=2", "eval_every=1",
            "num_threads=1", "save_every=0", "save_final_model=false", "plots=false", "progress=false",
            "log_samples=0", f"decode_linear={mode}", f"output_dir={tmp_path}"]
    assert main(args) == 0
    assert (len(seen) > 0) == (mode != "torch") and not any(seen)
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["ppo_kl"] == 0.0 and rec["pg_clipfrac"] == 0.0 and rec["echo/R_batch"] == 1.0


def test_a_bad_decode_linear_is_refused_by_train_and_eval(capsys):
    from echotrain.cli import main

    assert main(["train", "model=testbed", "task=testbed", "decode_linear=mkl", "--print-config"]) == 2
    assert "decode_linear" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--model", "testbed", "--decode-linear", "mkl"])
    assert exc.value.code == 2


@pytest.mark.parametrize("mode", ["torch", "onednn"])
def test_eval_generates_with_decode_linear(mode, monkeypatch, capsys):
    """``echotrain eval --decode-linear`` (``--task``) reaches generation."""
    from echotrain.cli import main

    seen = _count_onednn(monkeypatch)
    assert main(["eval", "--model", "testbed", "--prompts", "2", "--n", "1", "--max-new-tokens", "4", "--threads", "1",
                 "--decode-linear", mode, "--json"]) == 0
    assert (len(seen) > 0) == (mode == "onednn")


@pytest.mark.parametrize("mode", ["torch", "onednn_packed"])
def test_eval_benchmark_generates_with_decode_linear(mode, monkeypatch, tmp_path):
    """``echotrain eval --benchmark ... --decode-linear`` (the suite path of the CLI) reaches generation, and the
    mode is not one of the summary's settings (like ``--threads``, it changes results by float rounding only)."""
    import json

    from echotrain.cli import main
    from tests.evalsuite.conftest import make_ascii_tokenizer
    from tests.evalsuite.test_suite import _save_tiny_model

    _save_tiny_model(tmp_path / "model", make_ascii_tokenizer())
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": "4"}\n')
    seen = _count_onednn(monkeypatch)
    out = tmp_path / "out"
    assert main(["eval", "--model", str(tmp_path / "model"), "--benchmark", f"math:mini={rows}", "--n", "1", "--max-new-tokens", "4",
                 "--threads", "1", "--no-progress", "--out", str(out), "--decode-linear", mode]) == 0
    assert (len(seen) > 0) == (mode != "torch") and not any(seen)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmarks"]["mini"]["num_problems"] == 2
    assert "decode_linear" not in summary["settings"]


def test_suite_generates_with_decode_linear(monkeypatch, tmp_path):
    """``run_suite(decode_linear=...)`` reaches generation; an unknown value is a SuiteInputError."""
    from echotrain.evalsuite import SuiteInputError, run_suite
    from tests.train.conftest import make_model, make_tokenizer

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "1+1?", "answer": "2"}\n')
    tok = make_tokenizer()
    model = make_model(tok)
    seen = _count_onednn(monkeypatch)
    run_suite(model, tok, None, benchmarks=[f"math:mini={rows}"], max_new_tokens=4, decode_linear="torch")
    assert seen == []
    run_suite(model, tok, None, benchmarks=[f"math:mini={rows}"], max_new_tokens=4, decode_linear="onednn_packed")
    assert len(seen) > 0
    with pytest.raises(SuiteInputError, match="decode_linear"):
        run_suite(model, tok, None, benchmarks=[f"math:mini={rows}"], decode_linear="mkl")


def test_layers_below_the_size_rule_keep_f_linear(calls, monkeypatch):
    """``MIN_ONEDNN_WEIGHTS`` = 2^17 weights: a 1024 x 128 layer is taken over, a 131071 x 1 one
    (one weight fewer) and the testbed's layers are not."""
    from echotrain.models import load_policy

    assert SIZE_RULE == 2**17
    monkeypatch.setattr(cpu_linear, "MIN_ONEDNN_WEIGHTS", SIZE_RULE)
    big, small = torch.nn.Linear(128, 1024), torch.nn.Linear(1, 2**17 - 1)
    with torch.no_grad(), linear_backend(big, "onednn"), linear_backend(small, "onednn"):
        big(torch.randn(2, 128))
        small(torch.randn(2, 1))
    assert len(calls) == 1 and calls[0] is big.weight
    testbed, _ = load_policy("testbed")
    assert cpu_linear._linears(testbed) == []


def test_packed_copies_follow_a_replaced_weight(calls):
    """A weight whose storage was replaced (``w.data = t``, as peft's merge does) is packed again."""
    m = Counting()
    x = torch.randn(4, 24)
    with torch.no_grad(), linear_backend(m, "onednn_packed"):
        m(x)
        m.a.weight.data = m.a.weight.data * 3.0
        out = m(x)
        ref = m.sub(F.linear(F.linear(x, m.a.weight, m.a.bias), m.b.weight))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_model_pickled_inside_the_context_loads():
    import io

    m = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 8))
    x = torch.randn(4, 24)
    with torch.no_grad(), linear_backend(m, "onednn"):
        buf = io.BytesIO()
        torch.save(m, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), m(x))


def test_a_forward_set_by_others_is_left_alone():
    """A module with its own instance forward is not taken over; one set during the block (a hook
    library's) stays after it; one removed during the block does not break the exit."""
    m = Counting()
    own = lambda x: x  # noqa: E731 - a stand-in for accelerate's hook
    m.a.forward = own
    with linear_backend(m, "onednn"):
        assert m.a.__dict__["forward"] is own
        other = lambda x: x  # noqa: E731
        m.b.forward = other
    assert m.b.__dict__["forward"] is other and m.a.__dict__["forward"] is own
    del m.a.forward, m.b.forward
    with pytest.raises(KeyError):
        with linear_backend(m, "onednn"):
            del m.b.forward
            raise KeyError("the block's own error")
    assert "forward" not in m.a.__dict__ and not cpu_linear._installed


def test_generation_packs_each_weight_once_per_call(monkeypatch):
    """``generate_rollouts`` in chunks (``batch_size``) and per group, and ``evaluate`` over batches,
    pack each weight once; ``run_episodes`` refuses an unknown mode before touching the model."""
    from echotrain.runtime.episodes import run_episodes
    from echotrain.runtime.rollout import generate_rollouts, generate_rollouts_per_group
    from tests.train.conftest import make_model, make_tokenizer

    tok = make_tokenizer()
    model = make_model(tok)
    packs: list[int] = []
    real = torch.ops.mkldnn._reorder_linear_weight

    def reorder(w, *a):
        packs.append(w.data_ptr())  # the weight's storage (w is a fresh detached view)
        return real(w, *a)

    monkeypatch.setattr(cpu_linear.torch.ops.mkldnn, "_reorder_linear_weight", reorder, raising=False)
    n_linear = len(cpu_linear._linears(model))
    prompts = ["12+3", "4+5", "7+1"]
    generate_rollouts(model, tok, prompts, 2, max_new_tokens=3, batch_size=1, decode_linear="onednn_packed")
    assert len(packs) == len(set(packs)) == n_linear
    packs.clear()
    generate_rollouts_per_group(model, tok, prompts, 2, seeds=[1, 2, 3], pad_token_id=0, max_new_tokens=3,
                                decode_linear="onednn_packed")
    assert len(packs) == n_linear
    model.train()
    with pytest.raises(ValueError, match="decode_linear"):
        run_episodes(model, tok, [object()], 1, lambda: None, max_new_tokens=2, max_turns=1, max_episode_tokens=4,
                     decode_linear="mkl")
    assert model.training
