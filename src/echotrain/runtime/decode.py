"""echotrain's own decode loop for Hugging Face causal LMs: rows that reached EOS leave the batch.

``transformers``' ``generate`` keeps every row in the forward pass until the *last* row finishes
(or ``max_new_tokens``), so with responses of mixed length a large part of decoding computes
tokens that are thrown away (the default job: mean response 17 of at most 32 tokens, so about
45% of the row-steps). :func:`sample_tokens` runs the same sampling, one forward per new token
with the model's KV cache, and after each step drops the rows that just emitted an EOS token from
the cache (``Cache.batch_select_indices``), the attention mask and the position ids.

The logits go through the same warpers as in ``generate``, in its order
(``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper`` of ``transformers``). The
next token is then drawn from the warped distribution in one of two ways (``sampler``, the
setting of the same name; :data:`SAMPLERS`):

- ``inverse_cdf`` (the default): one uniform u per active row and the first token whose
  cumulative probability (float64 cumulative sum) exceeds u times the total; tokens of
  probability 0 (filtered by top-k / top-p) are never drawn. Exactly the warped distribution,
  from one random number a row, found in two levels (blocks of 256 tokens, then the token in
  its block: no (N, V) float64 copy or sequential cumulative sum; 0.4x the time of one cumulative
  sum over the row, docs/benchmarks.md): a few ms a step for 64 rows x 49,152 tokens against
  ~70 ms for ``torch.multinomial``, which draws one exponential per vocabulary entry.
- ``multinomial``: ``torch.multinomial`` over all N rows, the finished rows holding a one-hot
  placeholder: a CPU ``multinomial`` consumes the global RNG per row whatever the probabilities
  are, so the active rows draw exactly what ``generate`` would have drawn from the same RNG state
  (tested against ``generate``; the logits themselves agree to float rounding, a batch of fewer
  rows may round differently).

Both draw from the same distribution; only ``multinomial`` reproduces ``generate``'s tokens for a
seed. Greedy decoding (``do_sample=False``) takes the argmax.

The sampler's own per-token log-probs, entropies and ``sum_v pi(v)^2`` (``rollout_log_prob``,
``rollout_entropy``, ``rollout_sum_pi_squared``) come out of the same pass: ``log_softmax(logits / temperature)`` before top-k / top-p, as
:class:`~echotrain.runtime.rollout.RolloutLogProbRecorder` records them inside ``generate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

#: The values of the ``decode_loop`` setting: ours (:func:`sample_tokens`) or transformers' ``generate``.
DECODE_LOOPS = ("echotrain", "generate")
#: The values of the ``sampler`` setting: how :func:`sample_tokens` draws a token (module docstring).
SAMPLERS = ("inverse_cdf", "multinomial")
#: The defaults of the two settings (the trainer's ``decode_loop`` / ``sampler`` keys and
#: ``echotrain eval`` of a model that is not a run directory).
DEFAULT_DECODE_LOOP, DEFAULT_SAMPLER = "echotrain", "inverse_cdf"


#: Vocabulary entries per block of :func:`inverse_cdf_sample`'s two-level search.
CDF_BLOCK = 256


def _last_positive(x: torch.Tensor) -> torch.Tensor:
    """(...,) int64 index of the last entry > 0 along the last dim of ``x`` (the last index when none
    is: callers use it on rows or blocks with mass)."""
    return x.shape[-1] - 1 - (x.flip(-1) > 0).to(torch.int8).argmax(-1)


def inverse_cdf_sample(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (N, V) (non-negative, rows with a positive sum), by
    inversion: u ~ U[0, 1) in float64 per row, the first index whose float64 cumulative sum
    exceeds u times the row's total. A token of probability 0 is never drawn. Uses the global
    RNG (N float64 uniforms); returns (N,) int64 on ``probs``' device. Raises ValueError when a
    row has a NaN/Inf entry or sums to 0 (as ``torch.multinomial`` does).

    Two levels, so that no (N, V) float64 copy or sequential (N, V) cumulative sum is made: the
    float64 sums of blocks of :data:`CDF_BLOCK` entries and their cumulative sum pick the block
    that u falls in; a float64 cumulative sum of that block alone picks the token. The same
    inversion as one cumulative sum over V, up to float64 rounding at a boundary: where the
    block's own cumulative sum ends below u by rounding, the block's last positive entry is taken
    (and the row's, should u reach the row's total, which ``torch.rand`` < 1 keeps from
    happening)."""
    N, V = probs.shape
    nb = -(-V // CDF_BLOCK)
    pad = nb * CDF_BLOCK - V
    blocks = (probs if pad == 0 else torch.nn.functional.pad(probs, (0, pad))).view(N, nb, CDF_BLOCK)
    sums = blocks.sum(-1, dtype=torch.float64)                                         # (N, nb)
    coarse = sums.cumsum(-1)
    total = coarse[:, -1:]
    if not bool((torch.isfinite(total) & (total > 0)).all()):  # multinomial raises here too
        raise ValueError("probs: a row has a NaN/Inf entry or no positive probability (a diverged policy?)")
    u = torch.rand(N, 1, dtype=torch.float64, device=probs.device) * total
    j = torch.searchsorted(coarse, u, right=True).squeeze(1)
    j = torch.where(j >= nb, _last_positive(sums), j)                                 # u at the total (defensive)
    rows = torch.arange(N, device=probs.device)
    base = torch.where(j > 0, coarse[rows, (j - 1).clamp(min=0)], torch.zeros_like(total[:, 0]))
    block = blocks[rows, j].double()                                                   # (N, CDF_BLOCK)
    k = torch.searchsorted(block.cumsum(-1), (u[:, 0] - base)[:, None], right=True).squeeze(1)
    k = torch.where(k >= CDF_BLOCK, _last_positive(block), k)                          # the block's sum rounded
    return j * CDF_BLOCK + k


def distribution_stats(log_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The entropy -sum_v p log p (nats) and ``sum_v pi(v)^2`` (the collision probability, what
    verl's optimal token baselines read, docs/design/objectives.md §1) of each row of the (N, V)
    log-softmax ``log_p``, from one ``exp``: two (N,) float32 tensors on CPU. A token of log-prob
    -inf (a masked vocabulary entry) adds 0 to the entropy (0 log 0 = 0); a NaN stays NaN."""
    p = log_p.exp()
    finite_log_p = log_p.clamp(min=torch.finfo(log_p.dtype).min)  # -inf -> a finite value times p = 0
    return -(p * finite_log_p).sum(-1).float().cpu(), (p * p).sum(-1).float().cpu()


@dataclass
class Decoded:
    """Output of :func:`sample_tokens` for N rows and T = the number of decode steps run.

    Attributes:
        tokens: (N, T) int64; ``pad_token_id`` after a row's EOS.
        log_prob: (N, T) float32 log-probs of ``tokens`` under ``log_softmax(logits / temperature)``;
            0 after a row's EOS. None when not recorded.
        entropy: (N, T) float32 entropies (nats) of those distributions; 0 after EOS; or None.
        sum_pi_squared: (N, T) float32 ``sum_v pi(v)^2`` of those distributions; 0 after EOS;
            or None.
        row_caches: with ``return_cache=True``, per row the
            :data:`~echotrain.runtime.turn_cache.RowCache` of every id the model read for it (the
            input's attended ids and the drawn tokens but the last), taken when the row finished;
            None entries when the model's cache is not a plain one
            (:func:`~echotrain.runtime.turn_cache.layers_of`); else None.
    """

    tokens: torch.Tensor
    log_prob: torch.Tensor | None
    entropy: torch.Tensor | None
    sum_pi_squared: torch.Tensor | None = None
    row_caches: list | None = None


def _warpers(temperature: float, top_k: int, top_p: float) -> Any:
    """The warpers ``generate`` builds for sampling, in its order (temperature, top-k, top-p)."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    out = LogitsProcessorList()
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        out.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p))
    return out


def sample_tokens(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                  eos_token_ids: Sequence[int], pad_token_id: int, do_sample: bool = True, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, past_key_values: Any = None,
                  record_log_prob: bool = True, sampler: str = "inverse_cdf", return_cache: bool = False) -> Decoded:
    """Decode up to ``max_new_tokens`` tokens for each row, dropping rows from the batch at EOS.

    Args:
        model: a Hugging Face causal LM whose forward takes ``attention_mask``, ``position_ids``,
            ``past_key_values``, ``use_cache`` and ``logits_to_keep`` (a peft model of one works).
        input_ids, attention_mask: (N, P) int64 prompts, left-padded (or, with the prefill's
            cache, in its layout ``[common prefix | padding | rest]``: padding may sit anywhere).
        max_new_tokens: >= 1.
        eos_token_ids: the ids that end a row (may be empty: every row runs ``max_new_tokens``).
        pad_token_id: written after a row's EOS.
        do_sample: False = greedy (argmax); temperature / top_k / top_p are then unused.
        temperature, top_k, top_p: sampling parameters (top_k = 0 and top_p = 1 disable theirs).
        past_key_values: optional cache of the first S < P columns of ``input_ids`` for all N
            rows (S = P - 1 for the prefill of :func:`~echotrain.runtime.rollout._prefill`; the
            episodes' kept turn caches, :mod:`~echotrain.runtime.turn_cache`, cover less); the
            loop's first forward then runs only columns S.. (the attention mask covers all P).
        return_cache: also return each row's cache when it finishes (``Decoded.row_caches``).
        record_log_prob: also return the sampler's log-probs, entropies and ``sum_v pi(v)^2``.
        sampler: one of :data:`SAMPLERS` (module docstring).

    Returns:
        :class:`Decoded`. T is the step at which the last row finished, or ``max_new_tokens``.

    Raises:
        ValueError: ``max_new_tokens`` < 1, shapes of ``input_ids`` and ``attention_mask`` differ,
            a sampling ``temperature`` <= 0, an unknown ``sampler``, or a ``past_key_values`` that
            covers all P columns (nothing left to run).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    device = input_ids.device
    N = input_ids.shape[0]
    warp = _warpers(float(temperature), int(top_k), float(top_p)) if do_sample else None
    eos = torch.tensor(sorted(set(int(e) for e in eos_token_ids)), dtype=torch.long, device=device)
    tokens = torch.full((N, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    log_prob = torch.zeros(N, max_new_tokens) if record_log_prob else None
    entropy = torch.zeros(N, max_new_tokens) if record_log_prob else None
    sum_sq = torch.zeros(N, max_new_tokens) if record_log_prob else None

    attn = attention_mask.long()
    pos = attn.cumsum(-1) - 1
    pos = pos.masked_fill(attn == 0, 1)
    past = 0 if past_key_values is None else int(past_key_values.get_seq_length())
    if past >= input_ids.shape[1]:
        raise ValueError(f"past_key_values covers {past} columns of input_ids {tuple(input_ids.shape)}: "
                         "at least the last column must be left to run")
    step_ids, step_pos = input_ids[:, past:], pos[:, past:]
    next_pos = pos[:, -1:] + 1
    cache = past_key_values
    rows = torch.arange(N, device=device)  # the original row of each active row
    row_caches: list | None = [None] * N if return_cache else None
    steps = 0
    for t in range(max_new_tokens):
        out = model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        logits = out.logits[:, -1, :].float()
        if do_sample:
            # the warpers may write into their input; with none (temperature 1, no top-k / top-p) no copy is needed
            probs = torch.softmax(warp(step_ids, logits.clone()) if len(warp) else logits, dim=-1)
            if sampler == "inverse_cdf":
                nxt = inverse_cdf_sample(probs)
            elif len(rows) < N:  # the same RNG draws as generate, which samples every row
                full = probs.new_zeros(N, probs.shape[-1])
                full[:, 0] = 1.0
                full[rows] = probs
                nxt = torch.multinomial(full, 1).squeeze(1)[rows]
            else:
                nxt = torch.multinomial(probs, 1).squeeze(1)
        else:
            nxt = logits.argmax(-1)
        tokens[rows, t] = nxt
        if record_log_prob:
            lp = torch.log_softmax(logits / temperature if do_sample and temperature != 1.0 else logits, dim=-1)
            on_cpu = rows.cpu()  # the recorded columns live on the CPU
            log_prob[on_cpu, t] = lp.gather(-1, nxt[:, None]).squeeze(-1).cpu()
            entropy[on_cpu, t], sum_sq[on_cpu, t] = distribution_stats(lp)
        steps = t + 1
        alive = ~torch.isin(nxt, eos) if len(eos) else torch.ones_like(nxt, dtype=torch.bool)
        last = not bool(alive.any()) or steps == max_new_tokens
        if row_caches is not None and (last or not bool(alive.all())):
            _take_row_caches(row_caches, cache, attn, rows, torch.ones_like(alive) if last else ~alive)
        if last:
            break
        if not bool(alive.all()):
            keep = alive.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, nxt, attn, next_pos = rows[keep], nxt[keep], attn[keep], next_pos[keep]
        attn = torch.cat([attn, attn.new_ones(len(rows), 1)], dim=1)
        step_ids, step_pos = nxt[:, None], next_pos
        next_pos = next_pos + 1
    return Decoded(tokens=tokens[:, :steps], log_prob=None if log_prob is None else log_prob[:, :steps],
                   entropy=None if entropy is None else entropy[:, :steps],
                   sum_pi_squared=None if sum_sq is None else sum_sq[:, :steps], row_caches=row_caches)


def _take_row_caches(out: list, cache: Any, attn: torch.Tensor, rows: torch.Tensor, finished: torch.Tensor) -> None:
    """Store in ``out[rows[r]]`` the row cache of each active row r with ``finished[r]`` (the cache
    holds, per active row, the columns of ``attn``; its attended ones are kept)."""
    from echotrain.runtime.turn_cache import layers_of, row_cache

    layers = layers_of(cache)
    if layers is None:
        return
    for r in finished.nonzero().squeeze(1).tolist():
        out[int(rows[r])] = row_cache(layers, r, attn[r])
