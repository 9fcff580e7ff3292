"""Supervised warm-up on an environment's demonstrations before RL (``sft_steps``).

A small chat model does not call a tool it has only read about (SmolLM2-135M-Instruct with the
calculator: 0 calls in 32 episodes; docs/design/environments.md), so RL on tool episodes gets no
signal. The usual recipe is supervised fine-tuning on tool-use traces first, then RL (TRL's
``SFTTrainer`` then ``GRPOTrainer``; verl's SFT trainer then PPO). ``sft_steps=N`` runs that first
phase inside the run: N optimizer steps of next-token cross-entropy on worked episodes that the
environment demonstrates (:meth:`demonstration`), then RL starts from the warmed-up weights, with
a fresh RL optimizer, and the KL reference (when ``kl_coef`` > 0) is the warmed-up policy (with
LoRA the reference stays the base model: the adapters switched off). Under data parallelism every
rank runs the same warm-up and rank 0's weights are then broadcast.

Each demonstration is encoded **exactly as an episode's trajectory**
(:mod:`echotrain.runtime.episodes`): the prompt as the rollouts encode it, each model turn's text
tokenised with its end-of-turn token appended, each environment reply as the
:class:`~echotrain.runtime.episodes.TurnRenderer` delta the episodes insert; only the model turns
are targets (the environment's tokens are inputs with label -100, as ``response_mask`` 0 leaves
them out of the RL loss). A demonstration whose final answer the task does not score 1 is dropped,
and so is one an episode of the run could not hold (a model turn longer than ``max_new_tokens``
with its end-of-turn id, more than ``max_turns`` model turns, more ids after the prompt than the
episode budget): the warm-up teaches only episodes the rollouts can produce.

Or the demonstrations come from a file (``sft_data=PATH``, JSONL; :func:`read_demonstrations`), with or
without an environment: one demonstration a line, TRL's conversational format ``{"messages": [...]}``
(the prompt is every message before the first assistant one), its prompt-completion format
``{"prompt": P, "completion": C}`` (``C`` a string: one model turn; or a list of messages), or
``{"prompt": P, "turns": [...]}`` (what
``env.reset`` and ``env.demonstration`` return: the turns after the prompt); ``P`` is a string for a
model without a chat template (the byte-level testbeds) or a list of chat messages. They are encoded the
same way and left out the same way when an episode (without an environment: one model turn) could not
hold them; the task does not score them (a file line has no task example to score against).

The demonstration contract (optional, an environment without it cannot warm up):
``env.demonstration(example, answer) -> list[{"role": "assistant" | "tool" | "user", "content"}] |
None``: the turns after ``env.reset(example)``'s prompt, starting and ending with an assistant turn;
``answer`` is the task's reference completion (:func:`reference_completion`); None skips the example.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from echotrain.runtime.episodes import TemplateError, TurnRenderer, encode_text, turn_end_id
from echotrain.runtime.precision import autocast
from echotrain.runtime.rollout import encode_prompts, eos_ids_of, render_prompts

__all__ = ["WarmupError", "WarmupResult", "check_sft_data", "demonstration_rows", "encode_demonstration", "file_rows",
           "file_sha256", "read_demonstrations", "reference_completion", "sft_warmup"]

class WarmupError(ValueError):
    """The warm-up cannot run: no demonstration it can use, a chat demonstration for a model without a chat
    template, a loss that is not finite (``echotrain train`` prints it as one error line, exit 2)."""


#: added to the run's seed for the warm-up's example draw and order (the RL prompt stream is untouched)
WARMUP_SEED_OFFSET = 7919


def reference_completion(task: Any, example: Any) -> str:
    """The completion that states ``example``'s gold answer in ``task``'s answer format: the task's
    own ``reference_completion(example)`` when it has one, else ``<answer>A</answer>`` (answer
    format ``tag``), ``\\boxed{A}`` (``boxed``) or the bare answer (a task's own format, e.g. the
    testbeds')."""
    own = getattr(task, "reference_completion", None)
    if callable(own):
        return own(example)
    fmt = getattr(task, "answer_format", None)
    if fmt == "tag":
        return f"<answer>{example.answer}</answer>"
    if fmt == "boxed":
        return f"\\boxed{{{example.answer}}}"
    return str(example.answer)


def demonstration_rows(model: Any, tokenizer: Any, task: Any, examples: Sequence[Any], make_env: Callable[[], Any],
                       *, max_new_tokens: int | None = None, max_turns: int | None = None,
                       max_episode_tokens: int | None = None) -> tuple[list[tuple[list[int], list[int]]], int, int]:
    """The worked episodes of ``examples`` as training rows (module docstring).

    Args:
        model, tokenizer: the policy (its end-of-turn ids: :func:`~echotrain.runtime.rollout.eos_ids_of`).
        task: the task (its scorer checks each demonstration's final turn).
        examples: task examples.
        make_env: a zero-argument factory of fresh environments with a ``demonstration`` method.
        max_new_tokens, max_turns, max_episode_tokens: the run's episode limits (None = no limit):
            a demonstration an episode could not hold is left out.

    Returns:
        ``(rows, dropped, too_long)``: rows ``(ids, labels)`` (equal-length int lists; labels -100
        on the prompt and the environment's ids); the number of examples without a demonstration
        or whose demonstration the task scores below 1; the number beyond the episode limits.

    Raises:
        ValueError: the environment has no ``demonstration`` method, or a demonstration that does
            not start and end with an assistant turn.
    """
    eos = _turn_ends(model, tokenizer)
    rows, dropped, too_long = [], 0, 0
    for ex in examples:
        env = make_env()
        if not callable(getattr(env, "demonstration", None)):
            raise ValueError(f"sft_steps: the environment {type(env).__name__} has no demonstration(example, answer) "
                             "method to warm up on (docs/design/environments.md)")
        prompt = env.reset(ex)
        turns = env.demonstration(ex, reference_completion(task, ex))
        if not turns:
            dropped += 1
            continue
        if turns[0].get("role") != "assistant" or turns[-1].get("role") != "assistant":
            raise ValueError(f"{type(env).__name__}.demonstration must start and end with an assistant turn, "
                             f"got {turns[0].get('role')!r} ... {turns[-1].get('role')!r}")
        if task.score(turns[-1]["content"], ex) < 1.0:
            dropped += 1
            continue
        row = encode_demonstration(tokenizer, eos[not isinstance(prompt, str)], prompt, turns, max_new_tokens=max_new_tokens, max_turns=max_turns,
                                   max_episode_tokens=max_episode_tokens)
        if row is None:
            too_long += 1
        else:
            rows.append(row)
    return rows, dropped, too_long


def _turn_ends(model: Any, tokenizer: Any) -> dict[bool, int]:
    """The end-of-turn id of plain (False) and chat (True) prompts (:func:`~echotrain.runtime.episodes.turn_end_id`),
    decided once per call of the callers (it renders the chat template).

    Raises:
        ValueError: the policy has no eos id.
    """
    if not eos_ids_of(model, tokenizer):
        raise ValueError("the policy has no end-of-turn (eos) token id: a demonstration's turns cannot end")
    return {chat: turn_end_id(model, tokenizer, chat) for chat in (False, True)}


def encode_demonstration(tokenizer: Any, eos_id: int, prompt: Any, turns: Sequence[dict[str, str]], *,
                         max_new_tokens: int | None = None, max_turns: int | None = None,
                         max_episode_tokens: int | None = None) -> tuple[list[int], list[int]] | None:
    """One demonstration as a training row ``(ids, labels)``, encoded as an episode's trajectory.

    ``prompt`` (a string, or chat messages) as the rollouts encode it; each assistant turn's text
    tokenised with ``eos_id`` appended (the targets; the episodes' end-of-turn id,
    :func:`~echotrain.runtime.episodes.turn_end_id`); each run of other messages as the
    :class:`~echotrain.runtime.episodes.TurnRenderer` delta the episodes insert (labels -100).
    None when an episode could not hold it: a model turn longer than ``max_new_tokens`` with its
    end-of-turn id, more than ``max_turns`` model turns, or more than ``max_episode_tokens`` ids
    after the prompt (None = no limit). ``turns`` start and end with an assistant turn (the callers check).
    """
    chat = not isinstance(prompt, str)
    renderer = TurnRenderer(tokenizer, chat, tokenizer.convert_ids_to_tokens(eos_id) if chat else None)
    ids_p, mask_p = encode_prompts(tokenizer, render_prompts(tokenizer, [prompt]))
    ids = ids_p[0][mask_p[0].bool()].tolist()
    labels = [-100] * len(ids)
    history: Any = list(prompt) if chat else prompt
    pending: list[dict[str, str]] = []
    longest_turn, model_turns, prompt_len = 0, 0, len(ids)
    for turn in turns:
        if turn["role"] != "assistant":
            pending.append(dict(turn))
            continue
        if pending:  # the environment's reply to the last model turn, as the episodes insert it
            env_ids = renderer.delta(history, pending)
            ids += env_ids
            labels += [-100] * len(env_ids)
            if chat:
                history = history + pending
            pending = []
        model_ids = encode_text(tokenizer, turn["content"]) + [eos_id]
        ids += model_ids
        labels += model_ids
        longest_turn, model_turns = max(longest_turn, len(model_ids)), model_turns + 1
        if chat:
            history = history + [{"role": "assistant", "content": turn["content"]}]
    if ((max_new_tokens is not None and longest_turn > max_new_tokens)
            or (max_turns is not None and model_turns > max_turns)
            or (max_episode_tokens is not None and len(ids) - prompt_len > max_episode_tokens)):
        return None
    return ids, labels


#: the roles a demonstration's messages may have (after the prompt: assistant turns and what answers them)
_ROLES = ("system", "user", "assistant", "tool")


def read_demonstrations(path: str | Path) -> list[tuple[int, Any, list[dict[str, str]]]]:
    """The demonstrations of an ``sft_data`` JSONL file (module docstring), as ``(line, prompt, turns)``.

    Each line is a JSON object: ``{"messages": [...]}``, ``{"prompt": P, "completion": C}`` or
    ``{"prompt": P, "turns": [...]}``, ``P`` a non-empty string or list of messages, ``C`` a string or
    (TRL's conversational prompt-completion) a list of messages; a message is
    ``{"role": system|user|assistant|tool, "content": str}``, an assistant one possibly with TRL's ``tool_calls``
    (then ``content`` may be null; :func:`_messages`). Blank lines are skipped; a UTF-8 BOM is read.

    Returns:
        ``(line number, prompt, turns)`` per demonstration: ``turns`` start and end with an assistant turn.

    Raises:
        ValueError: the file cannot be read, has no demonstration, or a line that is not one (naming
            ``path:line`` and what is wrong: bad JSON or keys, a malformed message or tool call, turns that do not
            start and end with an assistant turn, an empty or blank assistant turn).
    """
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"sft_data={str(path)!r} cannot be read: {exc}") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"sft_data {path}:{n}"
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{where}: not JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: a line must be a JSON object, got {type(obj).__name__}")
        if "messages" in obj:
            messages = _messages(obj["messages"], where, "messages")
            first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
            if not first:  # None (no assistant turn) or 0 (no prompt before it)
                raise ValueError(f"{where}: messages need a prompt (system/user messages) before the first assistant "
                                 "message, and an assistant message")
            prompt, turns = messages[:first], messages[first:]
        elif "prompt" in obj and ("completion" in obj) != ("turns" in obj):
            prompt = obj["prompt"]
            if isinstance(prompt, str):
                if not prompt:
                    raise ValueError(f"{where}: prompt is empty")
            else:
                prompt = _messages(prompt, where, "prompt")
            if "completion" in obj:
                if isinstance(obj["completion"], list):  # TRL's conversational prompt-completion
                    turns = _messages(obj["completion"], where, "completion")
                elif isinstance(obj["completion"], str):
                    turns = [{"role": "assistant", "content": obj["completion"]}]
                else:
                    raise ValueError(f"{where}: completion must be a string or a list of messages, got "
                                     f"{type(obj['completion']).__name__}")
            else:
                turns = _messages(obj["turns"], where, "turns")
        else:
            raise ValueError(f"{where}: a line is {{\"messages\": [...]}}, {{\"prompt\": ..., \"completion\": ...}} "
                             f"or {{\"prompt\": ..., \"turns\": [...]}}; got the keys {sorted(obj)}")
        if turns[0]["role"] != "assistant" or turns[-1]["role"] != "assistant":
            raise ValueError(f"{where}: the turns after the prompt must start and end with an assistant message, got "
                             f"{turns[0]['role']!r} ... {turns[-1]['role']!r}")
        empty = next((j for j, t in enumerate(turns) if t["role"] == "assistant" and not t["content"].strip()), None)
        if empty is not None:
            nth = sum(t["role"] == "assistant" for t in turns[:empty + 1])
            raise ValueError(f"{where}: assistant turn {nth} is empty (no content, no tool_calls): it would teach the "
                             "end-of-turn token alone")
        out.append((n, prompt, turns))
    if not out:
        raise ValueError(f"sft_data={str(path)!r} has no demonstration (an empty file)")
    return out


def _messages(value: Any, where: str, key: str) -> list[dict[str, str]]:
    """``value`` checked as a non-empty list of ``{"role", "content"}`` messages (copies). An assistant message's
    ``tool_calls`` (TRL / OpenAI: ``[{"type": "function", "function": {"name", "arguments"}}]``, arguments a dict
    or a JSON string; ``content`` then may be null or missing) become text after its content, one
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` a call (``json.dumps``, non-ASCII kept; arguments
    null or "" are ``{}``), on lines of their own:
    what the episodes parse (:mod:`echotrain.envs.tools`), so the warm-up teaches calls the environment runs."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: {key} must be a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        calls = m.get("tool_calls") if isinstance(m, dict) and m.get("role") == "assistant" else None
        content = m.get("content") if isinstance(m, dict) else None
        if calls is not None and content is None:
            content = ""
        if not (isinstance(m, dict) and m.get("role") in _ROLES and isinstance(content, str)):
            raise ValueError(f"{where}: {key}[{i}] must be {{\"role\": one of {list(_ROLES)}, \"content\": a string}}, "
                             f"got {m!r}"[:300])
        if calls is not None:
            if not isinstance(calls, list):
                raise ValueError(f"{where}: {key}[{i}].tool_calls must be a list, got {type(calls).__name__}")
            lines = [content] if content else []
            lines += [_tool_call_text(c, f"{where}: {key}[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
            content = "\n".join(lines)
        out.append({"role": m["role"], "content": content})
    return out


def _tool_call_text(call: Any, where: str) -> str:
    """One TRL/OpenAI tool call as the Hermes/Qwen text the episodes parse."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    args = fn.get("arguments") if isinstance(fn, dict) else None
    if args is None or args == "":  # (exports write a call without arguments so)
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            args = None
    if not (isinstance(name, str) and name and isinstance(args, dict)):
        raise ValueError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": a string, "
                         f"\"arguments\": an object or its JSON}}}}, got {call!r}"[:300])
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}</tool_call>"


def warmup_reruns_on_resume(cfg: Any, lora: bool | None = None) -> bool:
    """Whether a resumed run warms up again (``sft_steps``): only to rebuild a KL reference (``kl_coef`` > 0,
    not LoRA, whose reference is the base model): the warmed-up weights come from the checkpoint.
    ``lora``: whether the policy has LoRA adapters (default: ``cfg.lora_r`` > 0, before the model is loaded)."""
    lora = bool(cfg.lora_r) if lora is None else lora
    return bool(cfg.sft_steps) and cfg.kl_coef > 0 and not lora


def check_sft_data(cfg: Any, *, resume: bool) -> None:
    """``sft_data``'s file is a JSONL file of demonstrations (:func:`read_demonstrations`), checked by
    ``echotrain train`` before the model loads; not read when a resumed run will not warm up again.

    Raises:
        ConfigError: the file cannot be read, is empty, or has a line that is not a demonstration (``path:line``).
    """
    from echotrain.errors import ConfigError

    if not cfg.sft_data or (resume and not warmup_reruns_on_resume(cfg)):
        return
    try:
        read_demonstrations(cfg.sft_data)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def file_rows(model: Any, tokenizer: Any, path: str | Path, *, max_new_tokens: int | None = None,
              max_turns: int | None = None, max_episode_tokens: int | None = None
              ) -> tuple[list[tuple[list[int], list[int]]], int]:
    """The demonstrations of ``path`` (:func:`read_demonstrations`) as training rows
    (:func:`encode_demonstration`); ``(rows, too_long)``.

    Raises:
        ValueError: as :func:`read_demonstrations`.
        WarmupError: chat messages for a tokenizer without a chat template, an assistant turn that contains the
            end-of-turn token (appended here; an episode's turn ends at it), or a demonstration the tokenizer or its
            chat template cannot encode (naming ``path:line``).
        TemplateError: the chat template refuses an environment message of a line (``path:line`` and the remedy).
    """
    eos = _turn_ends(model, tokenizer)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    rows, too_long = [], 0
    for line, prompt, turns in read_demonstrations(path):
        if not isinstance(prompt, str) and not has_template:
            raise WarmupError(f"sft_data {path}:{line}: a chat prompt, but the model's tokenizer has no chat template: "
                              "give the prompt as a string")
        if max_turns is not None and sum(t["role"] == "assistant" for t in turns) > max_turns:
            too_long += 1  # (not encoded: its later turns may be more than a template can render)
            continue
        eos_id = eos[not isinstance(prompt, str)]
        holding = next((t["content"] for t in turns if t["role"] == "assistant"
                        and eos_id in encode_text(tokenizer, t["content"])), None)
        if holding is not None:  # an episode's turn ends at its first end-of-turn id: it cannot hold one inside
            raise WarmupError(f"sft_data {path}:{line}: the assistant turn {holding[:60]!r} contains the end-of-turn "
                              f"token {tokenizer.convert_ids_to_tokens(eos_id)!r}: a model turn ends there (the "
                              "warm-up appends it to every assistant turn), so leave it out of the text")
        try:
            row = encode_demonstration(tokenizer, eos_id, prompt, turns,
                                       max_new_tokens=max_new_tokens, max_turns=max_turns,
                                       max_episode_tokens=max_episode_tokens)
        except TemplateError as exc:  # the template refuses an environment reply: whole (its remedy is at the end)
            raise TemplateError(f"sft_data {path}:{line}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a template or tokenizer error: name the line, one error line
            raise WarmupError(f"sft_data {path}:{line}: cannot be encoded as an episode of this model: "
                              f"{type(exc).__name__}: {exc}"[:500]) from None
        if row is None:
            too_long += 1
        else:
            rows.append(row)
    return rows, too_long


@dataclass
class WarmupResult:
    """What :func:`sft_warmup` did: ``steps`` optimizer steps over ``examples`` demonstrations
    (``dropped`` examples had none the task scores 1, ``too_long`` were beyond the episode
    limits), per-step mean cross-entropy ``losses`` (nats per target token), ``target_tokens``
    per step on average, ``seconds`` of wall time."""

    steps: int
    examples: int
    dropped: int
    too_long: int
    losses: list[float]
    target_tokens: float
    seconds: float
    #: with ``data``: the file, its SHA-256 and how many of its demonstrations an episode holds (``examples``
    #: of them were trained on: at most ``steps x batch_size``)
    data: str | None = None
    data_sha256: str | None = None
    data_rows: int | None = None

    def summary(self) -> dict[str, Any]:
        """The run_info.json record."""
        out = {"steps": self.steps, "examples": self.examples, "dropped": self.dropped, "too_long": self.too_long,
               "loss_first": self.losses[0] if self.losses else None,
               "loss_last": self.losses[-1] if self.losses else None,
               "target_tokens_per_step": self.target_tokens, "seconds": round(self.seconds, 1)}
        if self.data is not None:
            out.update(data=self.data, data_sha256=self.data_sha256, data_rows=self.data_rows)
        return out


def file_sha256(path: str | Path) -> str:
    """SHA-256 (hex) of the file at ``path``: what a resumed run compares before it warms up on it again."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def sft_warmup(model: Any, tokenizer: Any, task: Any, make_env: Callable[[], Any] | None, *, steps: int,
               batch_size: int, lr: float, seed: int, micro_batch_size: int, max_grad_norm: float = 1.0,
               autocast_dtype: torch.dtype | None = None, max_new_tokens: int | None = None,
               max_turns: int | None = None, max_episode_tokens: int | None = None,
               data: str | Path | None = None) -> WarmupResult:
    """``steps`` AdamW steps of cross-entropy on demonstrations (module docstring), in place.

    Args:
        model: the policy (trained in place, in train mode; left in the mode it came in).
        tokenizer, task, make_env: as :func:`demonstration_rows`; ``steps * batch_size`` examples are
            drawn with ``task.sample(n, seed + WARMUP_SEED_OFFSET)``. Not used with ``data``.
        data: an ``sft_data`` JSONL file (:func:`file_rows`): its demonstrations instead of the
            environment's, in an order drawn from the seed: the first ``steps * batch_size`` of that
            order, cycling through them again when the file holds fewer.
        steps: optimizer steps (>= 1).
        batch_size: demonstrations per step (>= 1); a step's loss is the mean over its target
            tokens (micro-batches of ``micro_batch_size`` rows accumulate the token sum).
        lr: AdamW's constant learning rate (weight decay 0); the optimizer is discarded afterwards.
        seed: the run's seed.
        max_grad_norm: clip the gradient norm before each step (0 = off).
        autocast_dtype: the run's forward precision (None = the parameters' dtype).
        max_new_tokens, max_turns, max_episode_tokens: the run's episode limits
            (:func:`demonstration_rows`).

    Returns:
        :class:`WarmupResult`.

    Raises:
        ValueError: ``steps``, ``batch_size`` or ``micro_batch_size`` < 1, ``lr`` not > 0; an
            unreadable ``data`` file or a line of it that is not a demonstration (:func:`read_demonstrations`).
        WarmupError: no example with a demonstration (no file demonstration an episode can hold), a chat
            demonstration for a tokenizer without a chat template, or a loss that is not finite.
    """
    for name, v in (("sft_steps", steps), ("sft_batch_size", batch_size), ("micro_batch_size", micro_batch_size)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if not lr > 0:
        raise ValueError(f"sft_lr must be > 0, got {lr}")
    t0 = time.perf_counter()
    limits = f"max_new_tokens={max_new_tokens}, max_turns={max_turns}, max_episode_tokens={max_episode_tokens}"
    if data is not None:
        rows, too_long = file_rows(model, tokenizer, data, max_new_tokens=max_new_tokens, max_turns=max_turns,
                                   max_episode_tokens=max_episode_tokens)
        dropped = 0
        if not rows:
            raise WarmupError(f"sft_data {data}: all {too_long} demonstrations are longer than an episode allows "
                             f"({limits})")
    else:
        if make_env is None:
            raise WarmupError("sft_steps: no demonstrations: give an environment with a demonstration method or data")
        examples = task.sample(steps * batch_size, seed + WARMUP_SEED_OFFSET)
        rows, dropped, too_long = demonstration_rows(model, tokenizer, task, examples, make_env,
                                                     max_new_tokens=max_new_tokens, max_turns=max_turns,
                                                     max_episode_tokens=max_episode_tokens)
        if not rows:
            raise WarmupError(f"sft_steps: none of {len(examples)} examples has a demonstration the task scores 1 "
                             f"within the episode limits ({dropped} without one, {too_long} too long for {limits})")
    order = list(range(len(rows)))
    random.Random(seed + WARMUP_SEED_OFFSET).shuffle(order)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    was_training = model.training
    model.train()
    losses, targets = [], 0
    for step in range(steps):
        pick = [rows[order[(step * batch_size + k) % len(order)]] for k in range(batch_size)]
        n_target = sum(sum(t != -100 for t in lab[1:]) for _, lab in pick)
        total = 0.0
        opt.zero_grad(set_to_none=True)
        for start in range(0, len(pick), micro_batch_size):
            chunk = pick[start: start + micro_batch_size]
            # right-padded: positions start at 0 in every row
            ids = pad_sequence([torch.tensor(r) for r, _ in chunk], batch_first=True, padding_value=pad).to(device)
            lab = pad_sequence([torch.tensor(r) for _, r in chunk], batch_first=True, padding_value=-100).to(device)
            attn = pad_sequence([torch.ones(len(r), dtype=torch.long) for r, _ in chunk], batch_first=True).to(device)
            with autocast(model, autocast_dtype):
                logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                     lab[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
            (loss / n_target).backward()
            total += float(loss.detach())
        mean = total / n_target
        if not math.isfinite(mean):
            raise WarmupError(f"sft_steps: the warm-up loss at step {step + 1} is {mean} (lower sft_lr)")
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        losses.append(mean)
        targets += n_target
    opt.zero_grad(set_to_none=True)
    del opt
    model.train(was_training)  # the trainer's policy runs in eval mode (train/features.py)
    file = {} if data is None else {"data": str(data), "data_sha256": file_sha256(data), "data_rows": len(rows)}
    return WarmupResult(steps=steps, examples=min(len(rows), steps * batch_size), dropped=dropped, too_long=too_long,
                        losses=losses, target_tokens=targets / steps, seconds=time.perf_counter() - t0, **file)
