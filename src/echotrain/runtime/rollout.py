"""Rollouts: batched sampling with ``model.generate`` and log-probs of response tokens.

Two functions the trainer calls, and the mask that both rely on:

- :func:`generate_rollouts` samples every prompt x G completion in one decode call (KV cache
  of the prompts' common prefix and their rests, :func:`_prefill`; echotrain's loop of :mod:`echotrain.runtime.decode`, rows leaving at EOS, or
  ``model.generate``) and returns a :class:`RolloutBatch` of padded tensors.
- :func:`response_mask_from_ids` marks the valid response tokens: everything up to and
  including the first EOS; never padding, whether or not an EOS was produced.
- :func:`forward_log_probs` runs the policy on prompt + response and gathers the log-probability
  of each response token from ``log_softmax(logits / temperature)``, with the token entropy from
  the same logits (no gradient).

Any model with ``model(input_ids, attention_mask=...).logits`` and ``model.generate(...)`` works
(Hugging Face causal LMs, echotrain's looped transformer).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from echotrain.runtime.device import rng_devices
from echotrain.runtime.decode import DECODE_LOOPS, SAMPLERS, distribution_stats, sample_tokens
from echotrain.runtime.cpu_linear import DEFAULT_DECODE_LINEAR, check_decode_linear, linear_backend
from echotrain.runtime.packing import (accepts_keyword, common_prefix_len, distinct_prompts, has_window_attention,
                                       is_prefix_mask, packed_log_probs, real_prompts, supports_packed_forward)


@dataclass
class RolloutBatch:
    """Padded rollout tensors for ``N = B * G`` sequences.

    Attributes:
        prompt_ids: (N, P) int64, left-padded prompts.
        prompt_mask: (N, P) int64, 1 on real prompt tokens.
        response_ids: (N, T) int64, right-padded responses (pad after the first EOS).
        response_mask: (N, T) float32, 1 on valid response tokens (up to and incl. the first EOS).
        group_index: (N,) int64, which prompt group each sequence belongs to.
        truncated: (N,) bool, True if the response has no EOS (hit max_new_tokens).
        rollout_log_prob: (N, T) float32 log-probs of the sampled tokens under the model that
            generated them, recorded at generation (:class:`RolloutLogProbRecorder`), 0 off
            ``response_mask``; None when not recorded (e.g. greedy evaluation).
        rollout_entropy: (N, T) float32 entropy (nats) of the distribution each response token
            was sampled from (the same log-softmax), 0 off ``response_mask``; None when not
            recorded. The trainer's ``entropy`` when ``recompute_old_log_prob=false``.
        rollout_sum_pi_squared: (N, T) float32 ``sum_v pi(v)^2`` of that distribution, 0 off
            ``response_mask``; None when not recorded (multi-turn episodes). What the optimal token
            baselines read when the sampler is the learner (docs/design/objectives.md §1).
        response_attention_mask: (N, T) float32, 1 on every token of the trajectory the forward
            attends to; None = ``response_mask``. Multi-turn episodes
            (:mod:`echotrain.runtime.episodes`) set it: their ``response_mask`` has holes (0 on the
            environment's tokens), this mask has none.
        episode_stats: (N, K) float32 per-episode counts (columns
            :data:`echotrain.runtime.episodes.EPISODE_STATS`); None for single-turn rollouts.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    group_index: torch.Tensor
    truncated: torch.Tensor
    rollout_log_prob: torch.Tensor | None = None
    rollout_entropy: torch.Tensor | None = None
    rollout_sum_pi_squared: torch.Tensor | None = None
    response_attention_mask: torch.Tensor | None = None
    episode_stats: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def attended_mask(self) -> torch.Tensor:
        """(N, T) the response tokens the forward attends to: ``response_attention_mask`` where
        set (episodes: model and environment tokens), else ``response_mask``."""
        return self.response_mask if self.response_attention_mask is None else self.response_attention_mask

    @property
    def response_length(self) -> torch.Tensor:
        """(N,) float32 number of valid response tokens."""
        return self.response_mask.sum(-1)

    def select(self, index: torch.Tensor | Sequence[int]) -> "RolloutBatch":
        """Rows ``index`` of every tensor (a new batch)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        return RolloutBatch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[idx]
                               for f in fields(self)})


class RolloutLogProbRecorder:
    """Records, while ``model.generate`` runs, the log-prob of every sampled token under the
    distribution the update's ratio uses: ``log_softmax(logits.float() / temperature)`` over the
    full vocabulary (before top-p / top-k filtering), exactly as :func:`forward_log_probs`
    computes ``old_log_prob``; with identical numerics the two are equal, so their gap is the
    train/inference mismatch (bf16 generation, KV cache, a stale model).

    Works with any ``generate`` that calls the module once per new token with the last sampled
    token as the last input id (Hugging Face's and the looped transformer's): a forward hook keeps
    the last position's log-softmax ``(N, V)`` of each call, and the next call's pre-hook gathers
    it at the token just sampled (one ``(N, V)`` buffer, no stored logits). :meth:`finish`
    gathers the last token; :meth:`entropy` gives the entropy of each of those distributions
    (computed from the same buffer). Use as a context manager around ``generate``.
    """

    def __init__(self, model: Any, temperature: float):
        self.module = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.temperature = float(temperature)
        self.prev: torch.Tensor | None = None
        self.cols: list[torch.Tensor] = []
        self.ent_cols: list[torch.Tensor] = []
        self.sq_cols: list[torch.Tensor] = []
        self._handles: list[Any] = []

    def _pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.prev is not None and ids is not None:
            self.cols.append(self.prev.gather(-1, ids[:, -1:].to(self.prev.device)).squeeze(-1).float().cpu())
            self._stats(self.prev)

    def _post(self, module: Any, args: tuple, kwargs: dict, out: Any) -> None:
        logits = out.logits[:, -1, :].float()
        if self.temperature != 1.0:
            logits = logits / self.temperature
        self.prev = torch.log_softmax(logits, dim=-1)

    def _stats(self, log_p: torch.Tensor) -> None:
        ent, sq = distribution_stats(log_p)
        self.ent_cols.append(ent)
        self.sq_cols.append(sq)

    def __enter__(self) -> "RolloutLogProbRecorder":
        self._handles = [self.module.register_forward_pre_hook(self._pre, with_kwargs=True),
                         self.module.register_forward_hook(self._post, with_kwargs=True)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def finish(self, response_ids: torch.Tensor) -> torch.Tensor:
        """``(N, T)`` float32 log-probs of ``response_ids`` (N, T), the tokens ``generate`` returned.

        Raises:
            RuntimeError: the number of recorded positions is not T (a ``generate`` that does not
                run one forward per new token).
        """
        if self.prev is not None and response_ids.shape[1] > len(self.cols):
            self.cols.append(self.prev.gather(-1, response_ids[:, len(self.cols):len(self.cols) + 1]
                                              .to(self.prev.device)).squeeze(-1).float().cpu())
            self._stats(self.prev)
        self.prev = None
        if len(self.cols) != response_ids.shape[1]:
            raise RuntimeError(f"recorded {len(self.cols)} sampled-token log-probs for {response_ids.shape[1]} response "
                               "positions: this model's generate does not run one forward per new token")
        return torch.stack(self.cols, dim=1) if self.cols else torch.zeros(response_ids.shape, dtype=torch.float32)

    def entropy(self, response_ids: torch.Tensor) -> torch.Tensor:
        """``(N, T)`` float32 entropies (nats) of the distributions the tokens of ``response_ids``
        were sampled from; call after :meth:`finish` (which records the last position)."""
        if len(self.ent_cols) != response_ids.shape[1]:
            raise RuntimeError(f"recorded {len(self.ent_cols)} entropies for {response_ids.shape[1]} response positions")
        return (torch.stack(self.ent_cols, dim=1) if self.ent_cols
                else torch.zeros(response_ids.shape, dtype=torch.float32))

    def sum_pi_squared(self, response_ids: torch.Tensor) -> torch.Tensor:
        """``(N, T)`` float32 ``sum_v pi(v)^2`` of the same distributions as :meth:`entropy`; call
        after :meth:`finish`."""
        if len(self.sq_cols) != response_ids.shape[1]:
            raise RuntimeError(f"recorded {len(self.sq_cols)} sum_pi_squared for {response_ids.shape[1]} response positions")
        return (torch.stack(self.sq_cols, dim=1) if self.sq_cols
                else torch.zeros(response_ids.shape, dtype=torch.float32))


def response_mask_from_ids(response_ids: torch.Tensor, eos_token_ids: int | Sequence[int] | None,
                           pad_token_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid-token mask of generated responses.

    A token is valid if no EOS occurs strictly before it (so the first EOS itself is valid) and
    it is not in the trailing run of padding (``generate`` pads finished rows after their EOS;
    rows concatenated from several calls are right-padded). When ``pad_token_id`` equals an EOS
    id, the first EOS still counts once and everything after it is padding. A pad id the model
    *sampled* in the middle of a response (possible when pad != EOS) stays valid: it was
    generated and later tokens attended to it.

    Args:
        response_ids: (N, T) int64.
        eos_token_ids: one id, several ids, or None (no EOS: only padding is excluded).
        pad_token_id: the padding id or None.

    Returns:
        ``(mask, truncated)``: (N, T) float32 mask and (N,) bool, True where no EOS was produced.
    """
    if response_ids.dim() != 2:
        raise ValueError(f"response_ids must be (N, T), got shape {tuple(response_ids.shape)}")
    if eos_token_ids is None:
        eos_list: list[int] = []
    elif isinstance(eos_token_ids, int):
        eos_list = [eos_token_ids]
    else:
        eos_list = [int(e) for e in eos_token_ids]
    is_eos = torch.zeros_like(response_ids, dtype=torch.bool)
    for e in eos_list:
        is_eos |= response_ids == e
    # number of EOS strictly before position t
    eos_before = torch.cumsum(is_eos.long(), dim=-1) - is_eos.long()
    valid = eos_before == 0
    if pad_token_id is not None:
        not_pad = (response_ids != pad_token_id) | (is_eos & (eos_before == 0))
        # trailing padding: positions after the last non-pad token
        trailing = torch.flip(torch.cumsum(torch.flip(not_pad.long(), [-1]), -1), [-1]) == 0
        valid &= ~trailing
    truncated = ~is_eos.any(dim=-1)
    return valid.float(), truncated


def eos_ids_of(model: Any, tokenizer: Any) -> list[int]:
    """EOS token ids from the model's generation config and the tokenizer (deduplicated)."""
    ids: list[int] = []
    gen_cfg = getattr(model, "generation_config", None)
    for src in (getattr(gen_cfg, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if src is None:
            continue
        for e in ([src] if isinstance(src, int) else list(src)):
            if e not in ids:
                ids.append(int(e))
    return ids


def render_prompts(tokenizer: Any, prompts: Sequence[Any]) -> list[str]:
    """Turn task prompts into text: chat message lists go through the tokenizer's chat template
    (with the generation prompt); plain strings pass unchanged."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append(p)
        else:
            out.append(tokenizer.apply_chat_template(list(p), tokenize=False, add_generation_prompt=True))
    return out


def bos_to_prepend(tokenizer: Any) -> int | None:
    """The BOS id the tokenizer's own post-processor puts in front of a text, or None.

    Probed on a one-character text: ``tokenizer(x, add_special_tokens=True)`` starts with
    ``bos_token_id`` while ``add_special_tokens=False`` does not (Llama/SmolLM-style
    post-processors). None for tokenizers that add no BOS (Qwen, GPT-2), whose models never saw
    one.
    """
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    with_special = list(tokenizer("a", add_special_tokens=True, return_tensors=None)["input_ids"])
    without = list(tokenizer("a", add_special_tokens=False, return_tensors=None)["input_ids"])
    return int(bos) if with_special[:1] == [bos] and without[:1] != [bos] else None


def encode_prompts(tokenizer: Any, texts: Sequence[str], pad_token_id: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of rendered prompts, left-padded, with exactly one BOS where the model expects one.

    The text is tokenized without special tokens (a chat template often writes BOS itself), and
    the tokenizer's BOS (:func:`bos_to_prepend`) is put in front unless the ids already start
    with it: one BOS, never zero and never two, for string and chat-templated prompts alike, so
    the rollouts, the log-prob passes (which reuse these ids) and ``echotrain eval`` all see
    what ``tokenizer(text)`` gives the model in training.

    Returns:
        ``(input_ids, attention_mask)``, both ``(len(texts), P)`` int64, left-padded with
        ``pad_token_id`` (default: the tokenizer's pad id, else its eos id, else 0).
    """
    bos = bos_to_prepend(tokenizer)
    rows = [list(tokenizer(t, add_special_tokens=False, return_tensors=None)["input_ids"]) for t in texts]
    if bos is not None:
        rows = [r if r[:1] == [bos] else [bos] + r for r in rows]
    pad = pad_token_id if pad_token_id is not None else tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return left_pad(rows, int(pad))


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention_mask)`` (n, max(1, longest)) int64 of token-id ``rows``, left-padded with ``pad_id``."""
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, width - len(r):] = torch.tensor(list(r), dtype=torch.long)
            attn[i, width - len(r):] = 1
    return ids, attn


def generate_rollouts(model: Any, tokenizer: Any, prompts: Sequence[Any], num_generations: int, *,
                      max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                      batch_size: int = 0, group_offset: int = 0, share_prefix: bool = True,
                      do_sample: bool = True, record_log_prob: bool = True,
                      decode_loop: str = "echotrain", sampler: str = "inverse_cdf",
                      decode_linear: str = DEFAULT_DECODE_LINEAR) -> RolloutBatch:
    """Sample ``num_generations`` completions of each prompt.

    Each prompt is repeated G times (rows ``g*G .. g*G+G-1`` belong to group ``group_offset + g``),
    encoded by :func:`encode_prompts` (exactly one BOS where the tokenizer adds one), and all rows
    are generated in one ``generate`` call (or chunks of ``batch_size`` rows), with the KV cache. Sampling uses torch's global RNG, so a run is reproducible given its RNG state.

    Args:
        prompts: B prompts, each a chat message list or a string.
        num_generations: G >= 1.
        max_new_tokens: response length cap.
        temperature, top_p, top_k: sampling parameters (top_k=0 disables it).
        batch_size: rows per generate call; 0 = all.
        do_sample: False = greedy decoding (evaluation); temperature/top_p/top_k are then unused.
        share_prefix: with one generate call and a model taking ``past_key_values``: prefill
            the prompts' common prefix once and each prompt's rest once, and hand the decode
            loop (or ``generate``) that KV cache repeated G times (:func:`_prefill`; the prompt
            prefill is most of the cost for short answers), instead of prefilling B*G copies.
            Same distribution; tokens equal up to float rounding.
        record_log_prob: when sampling, record the sampler's per-token log-probs
            (``rollout_log_prob``, :class:`RolloutLogProbRecorder`); False for evaluation, which
            needs none (and for a ``generate`` that does not run one forward per new token).
        decode_loop: ``"echotrain"``: :func:`echotrain.runtime.decode.sample_tokens` (rows leave
            the batch at EOS) for models with a KV-cache forward, else ``model.generate``;
            ``"generate"``: always ``model.generate``.
        sampler: how echotrain's loop draws a token (:data:`echotrain.runtime.decode.SAMPLERS`):
            ``"inverse_cdf"`` (one uniform a row) or ``"multinomial"`` (the same tokens as
            ``generate`` from the same RNG state). Unused by ``generate``.
        decode_linear: how the model's float32 linear layers run on a CPU while generating
            (:data:`echotrain.runtime.cpu_linear.DECODE_LINEARS`): ``"onednn"`` (the default) /
            ``"onednn_packed"``: oneDNN's inner product (:func:`~echotrain.runtime.cpu_linear.linear_backend`);
            ``"torch"``: ``F.linear``. No effect on a GPU or under autocast.

    Raises:
        ValueError: ``num_generations`` < 1, no prompts, an unknown ``decode_loop``, ``sampler`` or
            ``decode_linear``.

    Returns:
        A :class:`RolloutBatch` with N = B * G rows.
    """
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty")
    if decode_loop not in DECODE_LOOPS:
        raise ValueError(f"decode_loop must be one of {DECODE_LOOPS}, got {decode_loop!r}")
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    check_decode_linear(decode_linear)
    texts = render_prompts(tokenizer, prompts)
    texts = [t for t in texts for _ in range(num_generations)]
    group_index = torch.arange(len(prompts)).repeat_interleave(num_generations) + group_offset
    eos = eos_ids_of(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    device = next(model.parameters()).device
    ids, attn = encode_prompts(tokenizer, texts, pad_id)
    chunk = batch_size or len(texts)
    responses, rollout_lps, rollout_ents, rollout_sqs = [], [], [], []
    own_loop = decode_loop == "echotrain" and _supports_decode_loop(model)
    backend = contextlib.ExitStack()
    backend.enter_context(linear_backend(model, decode_linear))  # one for every chunk: weights packed once
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(texts), chunk):
            sl = slice(start, start + chunk)
            kwargs: dict[str, Any] = dict(
                attention_mask=attn[sl].to(device), max_new_tokens=max_new_tokens, do_sample=do_sample,
                pad_token_id=pad_id, eos_token_id=eos or None, use_cache=True)
            if do_sample:
                kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else None)
            else:
                kwargs.update(temperature=None, top_p=None, top_k=None)
            gen_ids = ids[sl].to(device)  # the prompt layout handed to the decode loop / generate
            # no_grad, not inference_mode: under autocast, inference mode re-casts every weight to bfloat16 at
            # every forward (autocast caches its casts of parameters only outside it): ~1/3 of a bf16 decode step
            with torch.no_grad():
                if share_prefix and chunk == len(texts) and ids.shape[1] > 1 and _supports_shared_prefix(model):
                    cache, p_ids, p_attn = _prefill(model, ids[::num_generations].to(device),
                                                    attn[::num_generations].to(device), num_generations)
                    if cache is not None:
                        kwargs.update(past_key_values=cache, attention_mask=p_attn)
                        gen_ids = p_ids
                if own_loop:
                    dec = sample_tokens(model, gen_ids, kwargs["attention_mask"],
                                        max_new_tokens=max_new_tokens, eos_token_ids=eos, pad_token_id=pad_id,
                                        do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                                        past_key_values=kwargs.get("past_key_values"),
                                        record_log_prob=do_sample and record_log_prob, sampler=sampler)
                    new_ids = dec.tokens
                    if dec.log_prob is not None:
                        rollout_lps.append(dec.log_prob)
                        rollout_ents.append(dec.entropy)
                        rollout_sqs.append(dec.sum_pi_squared)
                else:
                    # the sampler's own log-probs, recorded inside generate (whatever model generates)
                    recorder = RolloutLogProbRecorder(model, temperature) if do_sample and record_log_prob else None
                    with recorder or contextlib.nullcontext():
                        out = model.generate(gen_ids, **kwargs)
                    new_ids = out[:, gen_ids.shape[1]:]
                    if recorder is not None:
                        rollout_lps.append(recorder.finish(new_ids))
                        rollout_ents.append(recorder.entropy(new_ids))
                        rollout_sqs.append(recorder.sum_pi_squared(new_ids))
            # a compact copy (the decode loop's token buffer is wider)
            responses.append(new_ids.cpu().clone())
    finally:
        backend.close()
        model.train(was_training)
    width = max(r.shape[1] for r in responses)
    response_ids = torch.cat([F.pad(r, (0, width - r.shape[1]), value=pad_id) for r in responses])
    mask, truncated = response_mask_from_ids(response_ids, eos, pad_id)
    rollout_log_prob = rollout_entropy = rollout_sum_pi_squared = None
    if rollout_lps:
        rollout_log_prob, rollout_entropy, rollout_sum_pi_squared = (
            torch.cat([F.pad(r.clone(), (0, width - r.shape[1])) for r in cols]) * mask
            for cols in (rollout_lps, rollout_ents, rollout_sqs))
    return RolloutBatch(prompt_ids=ids, prompt_mask=attn, response_ids=response_ids, response_mask=mask,
                        group_index=group_index, truncated=truncated, rollout_log_prob=rollout_log_prob,
                        rollout_entropy=rollout_entropy, rollout_sum_pi_squared=rollout_sum_pi_squared)


def _prefill(model: Any, ids: torch.Tensor, attn: torch.Tensor, repeats: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """KV cache of B distinct prompts but their last token, the prompts' common prefix computed once.

    The prompts are laid out as ``[common prefix | left padding | rest]`` (the same tokens and
    positions as left-padded prompts: padding is masked wherever it sits; for a model with
    window attention, whose window counts columns, the prefix is taken as empty, i.e. the
    left-padded prompts): one forward of the
    prefix (C tokens, shared by every prompt, at most the shortest prompt's length - 1), its
    cache repeated B times, then one forward of every prompt's rest but its last token on top of
    it; the cache is repeated ``repeats`` (G) times along the batch. The decode loop then runs
    only the last prompt token and the new ones.

    Args:
        ids, attn: (B, P) int64, left-padded, each row at least one token.
        repeats: G >= 1.

    Returns:
        ``(cache, ids, attention_mask)``: the cache of the B * G rows (None where nothing is
        shared: no common prefix and G = 1) and the (B * G, C + W) prompt layout it belongs to.
    """
    real = real_prompts(ids, attn)
    C = 0 if has_window_attention(model) else common_prefix_len(real)  # a window counts columns: no gap
    if C == 0 and repeats == 1:
        return None, ids, attn
    rest = [r[C:] for r in real]
    W = max(len(r) for r in rest)
    B = len(real)
    p_ids = ids.new_zeros(B, C + W)
    p_attn = attn.new_zeros(B, C + W)
    p_ids[:, :C], p_attn[:, :C] = real[0][:C], 1
    for b, r in enumerate(rest):
        p_ids[b, C + W - len(r):], p_attn[b, C + W - len(r):] = r, 1
    cache = None
    if C:
        out = model(p_ids[:1, :C], attention_mask=p_attn[:1, :C], position_ids=torch.arange(C, device=ids.device)[None],
                    use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_repeat_interleave(B)
    if W > 1:
        mask = p_attn[:, :C + W - 1]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, C:]
        out = model(p_ids[:, C:C + W - 1], attention_mask=mask, position_ids=pos, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
    if cache is None:  # one-token prompts: nothing to prefill
        return None, ids, attn
    cache.batch_repeat_interleave(repeats)
    return cache, p_ids.repeat_interleave(repeats, 0), p_attn.repeat_interleave(repeats, 0)


def concat_rollouts(batches: Sequence[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """Concatenate rollout batches of different widths (prompts re-left-padded, responses
    right-padded with masks 0)."""
    if len(batches) == 1:
        return batches[0]
    P = max(b.prompt_ids.shape[1] for b in batches)
    T = max(b.response_ids.shape[1] for b in batches)

    def lpad(x: torch.Tensor, w: int, v: float) -> torch.Tensor:
        return F.pad(x, (w - x.shape[1], 0), value=v)

    def rpad(x: torch.Tensor, w: int, v: float) -> torch.Tensor:
        return F.pad(x, (0, w - x.shape[1]), value=v)

    return RolloutBatch(
        prompt_ids=torch.cat([lpad(b.prompt_ids, P, pad_token_id) for b in batches]),
        prompt_mask=torch.cat([lpad(b.prompt_mask, P, 0) for b in batches]),
        response_ids=torch.cat([rpad(b.response_ids, T, pad_token_id) for b in batches]),
        response_mask=torch.cat([rpad(b.response_mask, T, 0) for b in batches]),
        group_index=torch.cat([b.group_index for b in batches]),
        truncated=torch.cat([b.truncated for b in batches]),
        rollout_log_prob=None if any(b.rollout_log_prob is None for b in batches) else
        torch.cat([rpad(b.rollout_log_prob, T, 0) for b in batches]),
        rollout_entropy=None if any(b.rollout_entropy is None for b in batches) else
        torch.cat([rpad(b.rollout_entropy, T, 0) for b in batches]),
        rollout_sum_pi_squared=None if any(b.rollout_sum_pi_squared is None for b in batches) else
        torch.cat([rpad(b.rollout_sum_pi_squared, T, 0) for b in batches]),
        response_attention_mask=None if all(b.response_attention_mask is None for b in batches) else
        torch.cat([rpad(b.attended_mask, T, 0) for b in batches]),
        episode_stats=None if any(b.episode_stats is None for b in batches) else
        torch.cat([b.episode_stats for b in batches]),
    )


def _supports_shared_prefix(model: Any) -> bool:
    return all(accepts_keyword(model, k) for k in ("past_key_values", "position_ids", "use_cache"))


def _supports_decode_loop(model: Any) -> bool:
    """Whether :func:`~echotrain.runtime.decode.sample_tokens` can drive ``model``'s forward."""
    return _supports_shared_prefix(model) and accepts_keyword(model, "logits_to_keep")


def forward_log_probs(model: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                      response_mask: torch.Tensor, *, temperature: float = 1.0, with_entropy: bool = False,
                      share_prefix: bool = True, pack: bool = True, kv_cache: bool = True,
                      packed_attention: str = "blocks",
                      entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of the response tokens under ``model``.

    Runs prompt + response through the model with position ids that skip the left padding (as
    ``generate`` does), keeps only the logits that predict response tokens, and gathers
    ``log_softmax(logits / temperature)`` at the sampled ids, in float32.

    Exact savings: columns that are padding in every row are trimmed first (the response
    width becomes the longest valid response), and with ``share_prefix`` each distinct prompt
    is run once (the G rollouts of a group share their prompt); gradients flow through the
    shared prompt exactly as through G copies, at a fraction of the compute. Two layouts share
    it: with ``pack`` (models with a custom 4-D mask,
    :func:`echotrain.runtime.packing.supports_packed_forward`) the prompts' common prefix runs
    once per packed row, each distinct prompt's rest once, with its responses back to back after
    it under a block mask (:func:`echotrain.runtime.packing.packed_log_probs`: no response
    padding, no cache); else,
    with ``kv_cache`` (models with ``past_key_values``), the prompt's key/value cache is expanded
    to the G responses.

    Args:
        prompt_ids, prompt_mask: (N, P) int64, left-padded.
        response_ids, response_mask: (N, T) int64 / float, right-padded; ``response_mask`` is
            what the forward attends to (a multi-turn episode's model *and* environment tokens:
            ``RolloutBatch.attended_mask``), not the loss mask, which callers apply.
        temperature: the sampling temperature (so that on-policy ratios are exactly 1).
        with_entropy: also return the per-token entropy (N, T) float32, computed without grad
            (with grad when ``entropy_grad`` and grad is enabled: an entropy term of the loss).
        share_prefix: compute each distinct prompt once (falls back to one full forward when
            no layout below applies or no prompt repeats).
        pack: prefer the packed layout where the model supports it.
        packed_attention: how the packed layout's attention runs
            (:data:`echotrain.runtime.packing.PACKED_ATTENTION_MODES`).
        kv_cache: allow the KV-cache layout (off under gradient checkpointing, where
            transformers turns the cache off).

    Returns:
        ``(log_prob, entropy)``: (N, T) float32 (differentiable if grad is enabled) and (N, T) or None.
        Masked positions hold 0 (trimmed columns) or finite values that callers must ignore.
    """
    if response_ids.shape != response_mask.shape or prompt_ids.shape != prompt_mask.shape:
        raise ValueError(f"shape mismatch: prompt {tuple(prompt_ids.shape)} vs mask {tuple(prompt_mask.shape)}, "
                         f"response {tuple(response_ids.shape)} vs mask {tuple(response_mask.shape)}")
    device = next(model.parameters()).device
    N, T_full = response_ids.shape
    # exact trimming: all-padding columns carry no valid token and are attended by none
    cols = response_mask.bool().any(0).nonzero()  # up to the last attended column (a mask may have holes)
    T = max(1, int(cols[-1]) + 1 if len(cols) else 1)
    keep_from = int(prompt_mask.long().sum(0).nonzero()[0]) if prompt_mask.any() else 0
    prompt_ids, prompt_mask = prompt_ids[:, keep_from:].to(device), prompt_mask[:, keep_from:].long().to(device)
    response_ids, response_mask = response_ids[:, :T].to(device), response_mask[:, :T].long().to(device)

    uniq = p_mask = inv = None
    if share_prefix and pack and supports_packed_forward(model) and is_prefix_mask(response_mask) \
            and bool(prompt_mask.bool().any(-1).all()):
        log_prob, entropy = packed_log_probs(model, prompt_ids, prompt_mask, response_ids, response_mask,
                                             temperature=temperature, with_entropy=with_entropy,
                                             attention=packed_attention, entropy_grad=entropy_grad)
        return F.pad(log_prob, (0, T_full - T)), (F.pad(entropy, (0, T_full - T)) if with_entropy else None)
    if share_prefix and kv_cache and _supports_shared_prefix(model):
        uniq, p_mask, inv = distinct_prompts(prompt_ids, prompt_mask)
        if len(uniq) == N:
            uniq = p_mask = inv = None
    if uniq is None:
        input_ids = torch.cat([prompt_ids, response_ids], dim=1)
        attn = torch.cat([prompt_mask, response_mask], dim=1)
        kwargs: dict[str, Any] = {"attention_mask": attn}
        if accepts_keyword(model, "position_ids"):
            kwargs["position_ids"] = (attn.cumsum(-1) - 1).clamp(min=0)
        if accepts_keyword(model, "logits_to_keep"):
            kwargs["logits_to_keep"] = T + 1
        logits = model(input_ids, **kwargs).logits[:, -(T + 1):-1, :]
    else:
        # one forward per distinct prompt, then the responses on top of its expanded KV cache
        p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
        out = model(uniq, attention_mask=p_mask, position_ids=p_pos, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_select_indices(inv)
        attn = torch.cat([prompt_mask, response_mask], dim=1)
        r_pos = prompt_mask.sum(-1, keepdim=True) + torch.arange(T, device=device)
        out2 = model(response_ids, attention_mask=attn, position_ids=r_pos, past_key_values=cache, use_cache=True,
                     logits_to_keep=T)
        logits = torch.cat([out.logits[:, -1:, :][inv], out2.logits[:, :-1, :]], dim=1)
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    log_prob = torch.gather(logp_all, -1, response_ids.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with contextlib.nullcontext() if entropy_grad else torch.no_grad():
            lp = logp_all if entropy_grad else logp_all.detach()
            entropy = F.pad(-(lp.exp() * lp).sum(-1), (0, T_full - T))
    return F.pad(log_prob, (0, T_full - T)), entropy


def response_log_softmax(model: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                         response_mask: torch.Tensor, *, temperature: float = 1.0, pack: bool = True,
                         packed_attention: str = "blocks") -> torch.Tensor:
    """The full next-token log-softmax at every response position (on-policy distillation's
    student and teacher passes: the divergence needs whole distributions, not the sampled token's
    log-prob; docs/design/objectives.md §12).

    The packed layout where the model supports it (:func:`echotrain.runtime.packing.packed_log_probs`
    with ``full=True``: the prompts' common prefix once, each prompt's rest once, no response
    padding), else one plain forward of prompt + response (position ids skip the left padding, as
    in :func:`forward_log_probs`'s unpacked layout). Differentiable when grad is enabled.

    Args:
        prompt_ids, prompt_mask: (N, P) int64, left-padded.
        response_ids, response_mask: (N, T) int64 / 0-1, right-padded; ``response_mask`` is what
            the forward attends to (``RolloutBatch.attended_mask``).
        temperature: the sampling temperature (the distributions the student sampled from).
        pack, packed_attention: prefer the packed layout, and how its attention runs (as in
            :func:`forward_log_probs`).

    Returns:
        (N, T, V) float32 log-probs on the model's device; columns past the longest attended
        response are 0 (callers mask them).

    Raises:
        ValueError: shape mismatch.
    """
    if response_ids.shape != response_mask.shape or prompt_ids.shape != prompt_mask.shape:
        raise ValueError(f"shape mismatch: prompt {tuple(prompt_ids.shape)} vs mask {tuple(prompt_mask.shape)}, "
                         f"response {tuple(response_ids.shape)} vs mask {tuple(response_mask.shape)}")
    device = next(model.parameters()).device
    T_full = response_ids.shape[1]
    cols = response_mask.bool().any(0).nonzero()
    T = max(1, int(cols[-1]) + 1 if len(cols) else 1)
    if pack and supports_packed_forward(model) and is_prefix_mask(response_mask) \
            and bool(prompt_mask.bool().any(-1).all()):
        keep_from = int(prompt_mask.long().sum(0).nonzero()[0])
        out, _ = packed_log_probs(model, prompt_ids[:, keep_from:].to(device),
                                  prompt_mask[:, keep_from:].long().to(device), response_ids[:, :T].to(device),
                                  response_mask[:, :T].long().to(device), temperature=temperature,
                                  attention=packed_attention, full=True)
        return F.pad(out, (0, 0, 0, T_full - T))
    input_ids = torch.cat([prompt_ids, response_ids[:, :T]], dim=1).to(device)
    attn = torch.cat([prompt_mask.long(), response_mask[:, :T].long()], dim=1).to(device)
    kwargs: dict[str, Any] = {"attention_mask": attn}
    if accepts_keyword(model, "position_ids"):
        kwargs["position_ids"] = (attn.cumsum(-1) - 1).clamp(min=0)
    if accepts_keyword(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = T + 1
    logits = model(input_ids, **kwargs).logits[:, -(T + 1):-1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    return F.pad(torch.log_softmax(logits, dim=-1), (0, 0, 0, T_full - T))


def group_seed(seed: int, draw: int, group: int) -> int:
    """Seed of one prompt group's sampling (``rollout_rng=group``): a function of the run seed,
    the prompt draw counter and the group's index in the draw only, so the sampled tokens do not
    depend on how the groups are split across processes or generate calls."""
    return (seed * 1_000_003 + 7919 * draw + 104_729 * group + 17) % (2**63 - 1)


def generate_rollouts_per_group(model: Any, tokenizer: Any, prompts: Sequence[Any], num_generations: int, *,
                                seeds: Sequence[int], group_offset: int = 0, pad_token_id: int,
                                **kwargs: Any) -> RolloutBatch:
    """:func:`generate_rollouts` one prompt group at a time, each under its own seed (the global
    RNGs are forked, so they are left untouched).

    Args:
        prompts: B prompts; ``seeds``: B ints, one per group.
        group_offset: group id of ``prompts[0]``.
        pad_token_id: padding of the concatenated batch.
        **kwargs: the sampling arguments of :func:`generate_rollouts`.

    Returns:
        A :class:`RolloutBatch` with N = B * G rows; row block g is bit-identical to generating
        ``prompts[g]`` alone under ``torch.manual_seed(seeds[g])``.

    Raises:
        ValueError: ``len(seeds) != len(prompts)``.
    """
    if len(seeds) != len(prompts):
        raise ValueError(f"seeds has {len(seeds)} entries for {len(prompts)} prompts")
    device = next(model.parameters()).device
    devices = rng_devices(device)
    parts = []
    # one context around the groups: their calls share its packed weights (decode_linear=onednn_packed)
    with linear_backend(model, kwargs.get("decode_linear", DEFAULT_DECODE_LINEAR)):
        for g, (prompt, seed) in enumerate(zip(prompts, seeds)):
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(int(seed))
                parts.append(generate_rollouts(model, tokenizer, [prompt], num_generations,
                                               group_offset=group_offset + g, **kwargs))
    return concat_rollouts(parts, pad_token_id)
