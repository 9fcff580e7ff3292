"""``echotrain eval --model RUN`` of a LoRA run without ``final_model/`` (killed mid-run, or
``save_final_model=false``): the base model plus the checkpoint's adapters, merged."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft")

from echotrain import cli  # noqa: E402
from echotrain.runtime.checkpoints import latest_checkpoint, load_checkpoint  # noqa: E402

LORA_RUN = ["model=testbed", "task=testbed", "steps=1", "lora_r=2", "lora_alpha=4", "lr=1e-2", "prompts_per_step=2",
            "num_generations=4", "max_new_tokens=4", "micro_batch_size=8", "eval_prompts=0", "num_threads=1",
            "progress=false", "plots=false", "save_final_model=false"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, testbed_cache):
    run = tmp_path_factory.mktemp("lora") / "run"
    assert cli.main(["train", *LORA_RUN, f"output_dir={run}"]) == 0
    assert not (run / "final_model").exists()
    # B starts at 0 and one step may have no learning signal (every group scored alike): give
    # every adapter a random B, so the merge below has something to add
    from echotrain.train.checkpoint import atomic_torch_save

    path = latest_checkpoint(run)
    state = load_checkpoint(path)
    gen = torch.Generator().manual_seed(0)
    for k, v in state["model"].items():
        if ".lora_B." in k:
            state["model"][k] = 0.05 * torch.randn(v.shape, generator=gen)
    atomic_torch_save(state, path)
    return run


def test_eval_of_a_lora_run_without_final_model(lora_run, capsys):
    capsys.readouterr()
    rc = cli.main(["eval", "--model", str(lora_run), "--task", "testbed", "--prompts", "2", "--n", "1",
                   "--temperature", "0", "--max-new-tokens", "4", "--threads", "1", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    res = json.loads(out.out.strip().splitlines()[-1])
    assert "LoRA r=2" in res["model"] and res["num_prompts"] == 2 and 0 <= res["accuracy"] <= 1


def test_merged_weights_are_base_plus_scaled_adapter_product(lora_run):
    """W = W0 + (alpha / r) B A for every adapted layer, with A, B from the checkpoint."""
    from echotrain.models import load_policy
    from echotrain.runtime.loading import load_for_eval

    merged, _, desc = load_for_eval(str(lora_run))
    base, _ = load_policy("testbed")
    adapters = load_checkpoint(latest_checkpoint(lora_run))["model"]
    prefix = "base_model.model."
    names = sorted({k[len(prefix):].rsplit(".lora_", 1)[0] for k in adapters})
    assert names and "lm_head" not in names  # all-linear leaves out the output head
    merged_sd, base_sd = merged.state_dict(), base.state_dict()
    for name in names:
        a, b = adapters[f"{prefix}{name}.lora_A.weight"], adapters[f"{prefix}{name}.lora_B.weight"]
        assert a.shape[0] == 2 and b.shape[1] == 2
        expected = base_sd[f"{name}.weight"] + (4 / 2) * b @ a
        assert not torch.equal(expected, base_sd[f"{name}.weight"])
        torch.testing.assert_close(merged_sd[f"{name}.weight"], expected, rtol=1e-6, atol=1e-7)
    untouched = [k for k in base_sd if k.rsplit(".", 1)[0] not in names]
    assert untouched and all(torch.equal(merged_sd[k], base_sd[k]) for k in untouched)


@pytest.fixture(scope="module")
def tiny_lora_run(tmp_path_factory):
    """A 1-step LoRA run of a tiny Llama (saved as a Hugging Face folder) without final_model/:
    the suite path needs a chat model (the testbed takes plain-text prompts)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import make_model, make_tokenizer  # tests/train/conftest.py

    root = tmp_path_factory.mktemp("tiny-lora")
    tok = make_tokenizer()
    make_model(tok).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    run = root / "run"
    over = [a for a in LORA_RUN if not a.startswith(("model=", "task="))]
    assert cli.main(["train", *over, f"model={root / 'model'}", "task=default", f"output_dir={run}"]) == 0
    return run


def test_suite_eval_of_a_lora_run_without_final_model(tiny_lora_run, tmp_path, capsys):
    """``eval --benchmark`` loads the run through the same loader as ``eval --task``."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"problem": f"{a}+{a}", "answer": str(2 * a)}) + "\n" for a in (1, 2)))
    capsys.readouterr()
    rc = cli.main(["eval", "--model", str(tiny_lora_run), "--benchmark", f"math:tiny={rows}", "--n", "1",
                   "--temperature", "0", "--max-new-tokens", "4", "--threads", "1", "--out", str(tmp_path / "out"),
                   "--no-progress", "--json"])
    err = capsys.readouterr().err
    assert rc == 0, err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert "LoRA r=2" in summary["model"] and summary["benchmarks"]["tiny"]["num_problems"] == 2
