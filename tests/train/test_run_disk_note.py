"""A finished run's last line says what it leaves on disk (issue 36, item 18): the run folder's
total, the checkpoints kept (``keep_last``, default 1) and the final model, through the real CLI."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from echotrain.cli import main
from echotrain.train.config import TrainConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import make_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tiny_hf_model(tmp_path_factory) -> Path:
    """A 2-layer Llama (hidden 32) saved with save_pretrained, so the run writes final_model/."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    d = tmp_path_factory.mktemp("tiny") / "model"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _bytes(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def _si(n: int) -> str:  # decimal units, one decimal above 1 MB (as du --si)
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def test_last_line_says_what_the_run_leaves_on_disk(tmp_path, tiny_hf_model, capsys):
    assert TrainConfig().keep_last == 1  # the default keeps one checkpoint
    run = tmp_path / "run"
    rc = main(["train", f"model={tiny_hf_model}", "steps=3", "save_every=1", "prompts_per_step=2", "num_generations=2",
               "max_new_tokens=4", "num_mini_batches=1", "micro_batch_size=4", "eval_prompts=0", "num_threads=1",
               "plots=false", "progress=false", "device=cpu", f"output_dir={run}"])
    err = capsys.readouterr().err
    assert rc == 0, err
    (ckpt,) = (run / "checkpoints").iterdir()  # steps 1 and 2 were written, then deleted
    assert ckpt.name == "step_00000003.pt"
    last = err.strip().splitlines()[-1]
    assert last.startswith("echotrain: done in "), last
    expected = (f"{_si(_bytes(run))} on disk: checkpoints/ {_si(ckpt.stat().st_size)} (1 checkpoint: model and "
                f"optimizer states, for --resume; keep_last=1), final_model/ {_si(_bytes(run / 'final_model'))}")
    assert last.endswith(expected), (last, expected)
    assert _bytes(run / "final_model") > 0 and ckpt.stat().st_size > 0
