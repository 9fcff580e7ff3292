"""Multi-turn episodes: the policy and an environment take turns; one trajectory of token ids.

:func:`run_episodes` plays ``G`` episodes of each of ``B`` task examples, turn by turn, with the
turns of all live episodes batched into one decode call. The trajectory of an episode is

    prompt ids | model turn 1 (sampled ids) | environment ids | model turn 2 | ... | last model turn

where every model id is the id the sampler drew (never decoded and re-encoded) and every
environment id comes from rendering only the environment's messages through the chat template as
a *delta* after the model's end-of-turn token (:class:`TurnRenderer`). The episode becomes one row
of a :class:`~echotrain.runtime.rollout.RolloutBatch`:

* ``response_ids``: everything after the prompt (model and environment ids);
* ``response_mask``: 1 on model ids, 0 on environment ids (a mask with holes), so the loss, the
  old / rollout / reference log-probs and every count read only the model's tokens;
* ``response_attention_mask``: 1 on every id of the trajectory (what the forward attends to);
* ``rollout_log_prob`` / ``rollout_entropy``: the sampler's numbers at the model's ids, 0 elsewhere;
* ``truncated``: the episode was cut by the token budget (a model turn without its end-of-turn
  token, or no room for the environment's reply);
* ``episode_stats``: (N, len(EPISODE_STATS)) per-episode counts (:data:`EPISODE_STATS`).

An episode ends at the environment's ``done`` (the final answer), after ``max_turns`` model
turns, or when the trajectory would pass ``max_episode_tokens`` (model + environment ids after
the prompt). Each turn re-encodes nothing. With echotrain's decode loop each episode's KV cache
is kept between turns (:mod:`~echotrain.runtime.turn_cache`): a turn prefills only the ids not yet
in it (the last turn's end-of-turn token and the environment's ids); with ``kv_cache=False``, with
``generate``, or with a cache that is not a plain one, the whole trajectory is run through the
model again (docs/design/environments.md §3).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from echotrain.runtime.cpu_linear import DEFAULT_DECODE_LINEAR, check_decode_linear, linear_backend
from echotrain.runtime.decode import sample_tokens
from echotrain.runtime.packing import has_window_attention
from echotrain.runtime.rollout import (RolloutBatch, RolloutLogProbRecorder, _supports_decode_loop, encode_prompts,
                                       eos_ids_of, left_pad, render_prompts)
from echotrain.runtime.turn_cache import RowCache, cached_length, stack_row_caches

__all__ = ["EPISODE_STATS", "EpisodeResult", "TemplateError", "TurnRenderer", "encode_text", "run_episodes", "turn_end_id"]

#: Columns of ``RolloutBatch.episode_stats``: model turns, tool calls, failed tool calls,
#: environment tokens, model tokens, cut by the token budget (0/1), cut by max_turns (0/1), the
#: summed per-turn shaping reward.
EPISODE_STATS = ("turns", "tool_calls", "tool_errors", "env_tokens", "model_tokens", "cut_by_tokens",
                 "cut_by_turns", "shaping")

_DUMMY = "\u2063echotrain-turn\u2063"


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` on its own (no special tokens added): how a turn's text becomes ids
    between the ids already in a trajectory."""
    enc = tokenizer(text, add_special_tokens=False, return_tensors=None)
    ids = enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc
    return [int(i) for i in ids]


def turn_end_id(model: Any, tokenizer: Any, chat: bool) -> int | None:
    """The end-of-turn id that closes a model turn: for chat prompts, of the model's eos ids
    (:func:`~echotrain.runtime.rollout.eos_ids_of`) the one whose token the chat template writes first after
    an assistant message (Llama-3: ``<|eot_id|>``, not its generation config's first id ``<|end_of_text|>``;
    ChatML: ``<|im_end|>``); else, or when the template writes none of them, the first eos id. None without one.
    """
    eos = eos_ids_of(model, tokenizer)
    if not eos:
        return None
    if not chat or not getattr(tokenizer, "chat_template", None):
        return eos[0]
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": _DUMMY}],
                                             tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render this: the first eos id, as before
        return eos[0]
    after = text.split(_DUMMY, 1)[1] if _DUMMY in text else ""
    found = [(after.find(t), e) for e in eos if (t := tokenizer.convert_ids_to_tokens(e)) and t in after]
    return min(found)[1] if found else eos[0]


class TemplateError(ValueError):
    """The chat template cannot render an episode's environment turn (:meth:`TurnRenderer.delta_text`): it
    refuses the environment's messages (Gemma's template, for one, has no ``tool`` role and requires
    user/assistant to alternate), rewrites history, or does not close an assistant turn with the end-of-turn
    token. A setting of the run (``model``, ``chat_template``, ``env``), not a fault of one episode."""


class TurnRenderer:
    """Token ids of an environment's messages, inserted after a model turn.

    Chat prompts: the ids of ``template(history + [assistant X] + env_messages, add_generation_prompt)``
    minus ``template(history + [assistant X])``, plus what the template writes after the
    end-of-turn token that closed ``X`` (ChatML: ``"\\n"``), tokenised on their own; the model's
    ids are never part of the text tokenised. ``X`` is a placeholder for the model's turn: when the
    history already ends with that assistant turn, ``X`` takes its place (two assistant turns in a
    row are refused by templates that require alternating roles). Plain-string prompts (byte-level policies, no
    template): a ``tool`` message is ``<tool_response>...</tool_response>`` + newline, any other
    message its content + newline.

    Args:
        tokenizer: the policy's tokenizer.
        chat: whether the prompts are chat messages (else plain strings).
        eos_text: the end-of-turn token's text (ChatML: ``<|im_end|>``); None for plain prompts.

    Raises:
        TemplateError: (at :meth:`delta`) a template that cannot render the environment's messages after a
            model turn (its own error named), whose rendering of a longer conversation does not start with its
            rendering of the shorter one (it rewrites history), or that does not write ``eos_text`` after an
            assistant turn.
    """

    def __init__(self, tokenizer: Any, chat: bool, eos_text: str | None):
        self.tokenizer, self.chat, self.eos_text = tokenizer, chat, eos_text

    def delta_text(self, history: list[dict[str, str]] | str, env_messages: list[dict[str, str]]) -> str:
        """The text of the environment's turn (see the class docstring)."""
        if not self.chat:
            return "".join(f"<tool_response>{m['content']}</tool_response>\n" if m["role"] == "tool"
                           else f"{m['content']}\n" for m in env_messages)
        # the model's turn (the history's last message when it is one) stands as the placeholder turn: a
        # template that requires alternating roles (Mistral, Llama-2) refuses two assistant turns in a row, and
        # the delta depends only on what follows the placeholder's end-of-turn
        convo = list(history)
        if convo and convo[-1].get("role") == "assistant":
            convo = convo[:-1]
        convo.append({"role": "assistant", "content": _DUMMY})
        try:
            base = self.tokenizer.apply_chat_template(convo, tokenize=False)
            full = self.tokenizer.apply_chat_template(convo + list(env_messages), tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - jinja's TemplateError, a template's raise_exception, ...
            roles = ", ".join(sorted({repr(m.get("role")) for m in env_messages}))
            raise TemplateError(
                f"the chat template cannot render the environment's reply (role {roles}) after a model turn: "
                f"{type(exc).__name__}: {exc}. Give a template that renders it (echotrain train's chat_template=FILE; "
                "for tool results, one with a 'tool' role), or an environment whose replies have roles this "
                "template accepts") from exc
        if not full.startswith(base):
            raise TemplateError("the chat template renders a conversation differently once more turns follow "
                                "(it rewrites history); multi-turn token continuity needs a prefix-stable template")
        at = base.rfind(_DUMMY)
        close = base.find(self.eos_text, at) if self.eos_text else -1
        if close < 0:
            raise TemplateError(f"the chat template does not close an assistant turn with {self.eos_text!r}")
        return base[close + len(self.eos_text):] + full[len(base):]

    def delta(self, history: list[dict[str, str]] | str, env_messages: list[dict[str, str]]) -> list[int]:
        """Token ids of :meth:`delta_text`."""
        return encode_text(self.tokenizer, self.delta_text(history, env_messages))


@dataclass
class EpisodeResult:
    """What :func:`run_episodes` returns.

    Attributes:
        batch: the N = B * G trajectories (module docstring), ``episode_stats`` filled.
        final_texts: (N) the decoded last model turn of each episode (what the reward scores).
        transcripts: (N) the messages of each episode (the prompt, the model's turns as decoded
            text, the environment's messages), for samples.jsonl.
    """

    batch: RolloutBatch
    final_texts: list[str]
    transcripts: list[list[dict[str, str]] | list[Any]]


@dataclass
class Turn:
    """One model turn of the live episodes, from :func:`_sample`: ``tokens``, ``log_prob``,
    ``entropy`` (n, T); ``row_caches`` (n) each row's cache after the turn (module
    :mod:`~echotrain.runtime.turn_cache`), or None where none was kept."""

    tokens: torch.Tensor
    log_prob: torch.Tensor
    entropy: torch.Tensor
    row_caches: list[RowCache | None] | None = None


def _sample(model: Any, ids: torch.Tensor, attn: torch.Tensor, *, max_new_tokens: int, eos: list[int], pad_id: int,
            temperature: float, top_p: float, top_k: int, decode_loop: str, sampler: str,
            past: Any = None, keep_cache: bool = False, do_sample: bool = True) -> Turn:
    """One turn of every live episode (n rows of ``ids``/``attn``, left-padded; ``past`` a cache of
    their first columns, echotrain's decode loop only; ``keep_cache``: return each row's cache)."""
    device = next(model.parameters()).device
    ids, attn = ids.to(device), attn.to(device)
    # not inference_mode: autocast re-casts the weights every forward there (rollout.py)
    with torch.no_grad():  # the linear layers as run_episodes' decode_linear context says
        if decode_loop == "echotrain" and _supports_decode_loop(model):
            dec = sample_tokens(model, ids, attn, max_new_tokens=max_new_tokens, eos_token_ids=eos, pad_token_id=pad_id,
                                do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, sampler=sampler,
                                past_key_values=past, return_cache=keep_cache)
            return Turn(dec.tokens.cpu().clone(), dec.log_prob.cpu().clone(), dec.entropy.cpu().clone(),
                        dec.row_caches)
        if past is not None:
            raise ValueError("a kept turn cache needs echotrain's decode loop")
        recorder = RolloutLogProbRecorder(model, temperature if do_sample else 1.0)
        sampling = (dict(temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else None) if do_sample
                    else dict(temperature=None, top_p=None, top_k=None))
        if not do_sample and not hasattr(model, "generation_config"):  # echotrain's own models: plain defaults
            sampling = {}
        with recorder:
            out = model.generate(ids, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=do_sample,
                                 pad_token_id=pad_id, eos_token_id=eos or None, use_cache=True, **sampling)
        new = out[:, ids.shape[1]:]
        lp = recorder.finish(new)
        return Turn(new.cpu().clone(), lp.clone(), recorder.entropy(new).clone())


def run_episodes(model: Any, tokenizer: Any, examples: Sequence[Any], num_generations: int,
                 make_env: Callable[[], Any], *, max_new_tokens: int, max_turns: int, max_episode_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, group_offset: int = 0,
                 decode_loop: str = "echotrain", sampler: str = "inverse_cdf", kv_cache: bool = True,
                 do_sample: bool = True, decode_linear: str = DEFAULT_DECODE_LINEAR) -> EpisodeResult:
    """Play ``num_generations`` episodes of each example; the turns of live episodes batched.

    Args:
        examples: B task examples (``env.reset(example)`` gives each episode's prompt).
        num_generations: G >= 1 episodes per example (rows ``g*G .. g*G+G-1``: group
            ``group_offset + g``).
        make_env: a zero-argument factory of fresh environments (one per episode).
        max_new_tokens: the most tokens of one model turn.
        max_turns: the most model turns of an episode (>= 1).
        max_episode_tokens: the most ids after the prompt (model + environment), >= 1.
        temperature, top_p, top_k, decode_loop, sampler, decode_linear: as
            :func:`~echotrain.runtime.rollout.generate_rollouts` (one ``decode_linear`` context for all
            the turns: packed weights are made once).
        kv_cache: keep each episode's KV cache between turns and prefill only the new ids (echotrain's
            decode loop and a plain cache; else ignored). The tokens drawn are those of the
            uncached path up to float rounding (the same RNG draws; logits may round differently).
        do_sample: False = greedy turns (evaluation); temperature / top_p / top_k then unused.

    Returns:
        :class:`EpisodeResult`. Sampling uses torch's global RNG (reproducible given its state).

    Raises:
        ValueError: ``num_generations``, ``max_turns``, ``max_new_tokens`` or
            ``max_episode_tokens`` < 1, no examples, or an unknown ``decode_linear``.
    """
    for name, v in (("num_generations", num_generations), ("max_turns", max_turns),
                    ("max_new_tokens", max_new_tokens), ("max_episode_tokens", max_episode_tokens)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if not examples:
        raise ValueError("examples is empty")
    check_decode_linear(decode_linear)
    eos = eos_ids_of(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    rows = [ex for ex in examples for _ in range(num_generations)]
    envs = [make_env() for _ in rows]
    prompts = [env.reset(ex) for env, ex in zip(envs, rows)]
    chat = not isinstance(prompts[0], str)
    eos_text = tokenizer.convert_ids_to_tokens(turn_end_id(model, tokenizer, chat)) if chat and eos else None
    renderer = TurnRenderer(tokenizer, chat, eos_text)
    prompt_ids, prompt_mask = encode_prompts(tokenizer, render_prompts(tokenizer, prompts), pad_id)
    real = [p[m.bool()].tolist() for p, m in zip(prompt_ids, prompt_mask)]
    N = len(rows)
    resp: list[list[int]] = [[] for _ in range(N)]
    is_model: list[list[int]] = [[] for _ in range(N)]
    lps: list[list[float]] = [[] for _ in range(N)]
    ents: list[list[float]] = [[] for _ in range(N)]
    stats = torch.zeros(N, len(EPISODE_STATS))
    col = {k: i for i, k in enumerate(EPISODE_STATS)}
    history: list[Any] = [list(p) if chat else p for p in prompts]
    transcripts: list[list[Any]] = [list(p) if chat else [{"role": "prompt", "content": p}] for p in prompts]
    final = [""] * N
    truncated = torch.zeros(N, dtype=torch.bool)
    live = list(range(N))
    eos_set = set(eos)
    # a column-counting attention window would see the padding between a kept cache and the new ids
    keep = (kv_cache and decode_loop == "echotrain" and _supports_decode_loop(model)
            and not has_window_attention(model))
    kv: list[RowCache | None] = [None] * N  # episode i's cache: every trajectory id but the last
    was_training = model.training
    model.eval()
    backend = contextlib.ExitStack()
    backend.enter_context(linear_backend(model, decode_linear))  # one for every turn: weights packed once
    try:
        for turn in range(max_turns):
            if not live:
                break
            past = None
            if keep and all(kv[i] is not None for i in live):  # prefill only what the caches lack
                past, past_mask = stack_row_caches([kv[i] for i in live])
                new_ids, new_mask = left_pad([(real[i] + resp[i])[cached_length(kv[i]):] for i in live], pad_id)
                ids = torch.cat([torch.full_like(past_mask, pad_id), new_ids], dim=1)
                attn = torch.cat([past_mask, new_mask], dim=1)
                for i in live:
                    kv[i] = None  # copied into ``past``: free the row caches before the turn runs
            else:
                ids, attn = left_pad([real[i] + resp[i] for i in live], pad_id)
            caps = [min(max_new_tokens, max_episode_tokens - len(resp[i])) for i in live]
            out = _sample(model, ids, attn, max_new_tokens=max(caps), eos=eos, pad_id=pad_id, temperature=temperature,
                          top_p=top_p, top_k=top_k, decode_loop=decode_loop, sampler=sampler, past=past,
                          keep_cache=keep and turn < max_turns - 1, do_sample=do_sample)
            toks, lp, ent = out.tokens, out.log_prob, out.entropy
            row_caches, out.row_caches = out.row_caches, None  # kv holds the only references from here
            del past, out
            still = []
            for r, i in enumerate(live):
                kv[i] = row_caches[r] if row_caches is not None else None
                row = toks[r].tolist()[:caps[r]]
                n = next((k + 1 for k, t in enumerate(row) if t in eos_set), len(row))
                ended = n <= len(row) and n > 0 and row[n - 1] in eos_set
                row = row[:n]
                resp[i] += row
                is_model[i] += [1] * n
                lps[i] += lp[r, :n].tolist()
                ents[i] += ent[r, :n].tolist()
                stats[i, col["turns"]] += 1
                stats[i, col["model_tokens"]] += n
                text = tokenizer.decode(row, skip_special_tokens=True)
                final[i] = text
                transcripts[i].append({"role": "assistant", "content": text})
                if not ended:  # the turn ran out of tokens: cut by the budget
                    stats[i, col["cut_by_tokens"]] = 1
                    truncated[i] = True
                    continue
                if kv[i] is not None and cached_length(kv[i]) != len(real[i]) + len(resp[i]) - 1:
                    raise RuntimeError(f"episode {i}: its kept cache holds {cached_length(kv[i])} positions, its "
                                       f"trajectory {len(real[i]) + len(resp[i])} ids (expected one fewer)")
                reply = envs[i].step(text)
                stats[i, col["tool_calls"]] += reply.tool_calls
                stats[i, col["tool_errors"]] += reply.tool_errors
                stats[i, col["shaping"]] += float(reply.reward)
                if reply.done:
                    continue
                if turn == max_turns - 1:
                    stats[i, col["cut_by_turns"]] = 1
                    continue
                if chat:
                    history[i] = history[i] + [{"role": "assistant", "content": text}]
                env_ids = renderer.delta(history[i], reply.messages)
                if chat:
                    history[i] = history[i] + list(reply.messages)
                transcripts[i].extend(reply.messages)
                if len(resp[i]) + len(env_ids) >= max_episode_tokens:  # no room for the reply and a model token
                    stats[i, col["cut_by_tokens"]] = 1
                    truncated[i] = True
                    continue
                resp[i] += env_ids
                is_model[i] += [0] * len(env_ids)
                lps[i] += [0.0] * len(env_ids)
                ents[i] += [0.0] * len(env_ids)
                stats[i, col["env_tokens"]] += len(env_ids)
                still.append(i)
            for i in set(live) - set(still):
                kv[i] = None  # the episode ended: free its cache
            del row_caches
            live = still
    finally:
        backend.close()
        model.train(was_training)
    T = max(1, max(len(r) for r in resp))
    response_ids = torch.full((N, T), pad_id, dtype=torch.long)
    response_mask = torch.zeros(N, T)
    attn_mask = torch.zeros(N, T)
    rollout_log_prob = torch.zeros(N, T)
    rollout_entropy = torch.zeros(N, T)
    for i in range(N):
        n = len(resp[i])
        response_ids[i, :n] = torch.tensor(resp[i], dtype=torch.long)
        response_mask[i, :n] = torch.tensor(is_model[i], dtype=torch.float32)
        attn_mask[i, :n] = 1.0
        rollout_log_prob[i, :n] = torch.tensor(lps[i])
        rollout_entropy[i, :n] = torch.tensor(ents[i])
    group_index = torch.arange(len(examples)).repeat_interleave(num_generations) + group_offset
    batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                         response_mask=response_mask, group_index=group_index, truncated=truncated,
                         rollout_log_prob=rollout_log_prob * response_mask,
                         rollout_entropy=rollout_entropy * response_mask,
                         response_attention_mask=attn_mask, episode_stats=stats)
    return EpisodeResult(batch=batch, final_texts=final, transcripts=transcripts)
