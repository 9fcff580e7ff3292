"""reasoning-gym tasks: procedural, offline, seeded generators scored by their own scorers.

reasoning-gym (Stojanovski et al., 2025, "REASONING GYM: Reasoning Environments for
Reinforcement Learning with Verifiable Rewards") provides ~100 generators. Each example's
answer is read from the LAST ``<answer>...</answer>`` tag of the completion and passed to the
generator's ``score_answer``; no tag means reward 0.
"""

from __future__ import annotations

from typing import Any

from echotrain.tasks.base import Example, extract_final_answer, register_task, register_task_family
from echotrain.tasks.indexed import IndexedTask

__all__ = ["DEFAULT_SYSTEM_PROMPT", "DEFAULT_TASK", "ReasoningGymTask"]

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Solve the problem and give the final answer inside "
    "<answer> </answer> tags, for example <answer>42</answer>."
)

# Offset between the task's seed and the seed of the generator instance that provides the
# one-shot example, so the example is never one of the task's own questions' generator states.
_ONE_SHOT_SEED_OFFSET = 1_000_003

# The task of `echotrain train` with no arguments: two-term +/- basic_arithmetic with operands
# 0-100 and a worked one-shot exchange. Starting point of SmolLM2-135M-Instruct (embedded GGUF
# default), measured with scripts/measure_start_accuracy.py (64 prompts per seed, 48 new tokens,
# 1 thread):
#   temperature 0.7, seeds 1/2/3: accuracy 37.5/35.9/32.8% (pooled 35.4%, n=192),
#                                 answer-tag format 79.7/79.7/70.3% (pooled 76.6%)
#   temperature 1.0, seed 1:      accuracy 18.8%, format 64.1%
# Failures a short RL run can fix: a missing tag (~23%), and a right "a + b = c" line followed
# by a wrong number in the tag (e.g. "83 + 95 = 178\n<answer>77</answer>"); the rest are
# arithmetic errors (mostly negative results). One-digit operands started too high for headroom
# (pooled 50% at T=0.7, n=176); the bare-answer one-shot ("auto") too low (9%).
DEFAULT_TASK: dict[str, Any] = {
    "dataset": "basic_arithmetic",
    "config": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 2,  # operands 0-100 (reasoning-gym draws up to 10**digits inclusive)
        "operators": ("+", "-"),
        "allow_parentheses": False,
        "allow_negation": False,
    },
    # A worked example: the model writes the "a - b = c" line, then the tag.
    "one_shot": ("Calculate 8 - 2.", "8 - 2 = 6\n<answer>6</answer>"),
}


class ReasoningGymTask(IndexedTask):
    """A reasoning-gym generator as an echotrain task.

    Args:
        dataset: a reasoning-gym dataset name (``reasoning_gym.factory.DATASETS``).
        size: number of distinct examples (the generator's virtual dataset size).
        seed: generator seed; the same seed gives the same questions.
        system: system instruction (default asks for ``<answer>`` tags).
        one_shot: ``"auto"`` (one solved example from the same generator with another seed,
            answered as ``<answer>...</answer>``), ``None`` (no example), or a
            ``(user, assistant)`` pair of strings (a tuple, or a list of two as YAML and JSON give it).
        binary: if True (default), reward 1.0 only when the generator's score is 1.0, else 0.0;
            if False, the generator's own (possibly partial) score in [0, 1].
        **config: the generator's config fields (e.g. ``min_terms=2`` for basic_arithmetic).

    Raises:
        KeyError: unknown ``dataset`` (message lists valid names).
        ValueError: bad ``size``/``one_shot`` or a config the generator rejects.
        TypeError: an unknown config field.
    """

    answer_format = "tag"

    def __init__(
        self,
        dataset: str,
        *,
        size: int = 1000,
        seed: int = 0,
        system: str | None = DEFAULT_SYSTEM_PROMPT,
        one_shot: str | tuple[str, str] | list[str] | None = "auto",
        binary: bool = True,
        **config: Any,
    ):
        import reasoning_gym
        from reasoning_gym.factory import DATASETS

        if dataset not in DATASETS:
            raise KeyError(f"unknown reasoning-gym dataset {dataset!r}; valid names: {', '.join(sorted(DATASETS))}")
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        try:
            self.dataset = reasoning_gym.create_dataset(dataset, size=size, seed=seed, **config)
        except AssertionError as exc:  # reasoning-gym validates configs with asserts
            raise ValueError(f"invalid config for reasoning-gym dataset {dataset!r}: {exc}") from exc
        self.name = f"rg:{dataset}"
        self.dataset_name = dataset
        self.size = size
        self.seed = seed
        self.config = dict(config)
        self.system = system
        self.binary = binary
        if one_shot == "auto":
            shot_ds = reasoning_gym.create_dataset(dataset, size=1, seed=seed + _ONE_SHOT_SEED_OFFSET, **config)
            entry = shot_ds[0]
            self.one_shot: tuple[str, str] | None = (entry["question"], f"<answer>{entry['answer']}</answer>")
        elif one_shot is None:
            self.one_shot = None
        elif isinstance(one_shot, (tuple, list)) and len(one_shot) == 2 and all(isinstance(t, str) for t in one_shot):
            self.one_shot = (one_shot[0], one_shot[1])  # a list from YAML / JSON / the command line is a pair too
        else:
            raise ValueError(f"one_shot must be 'auto', None or a (user, assistant) pair of strings, got {one_shot!r}")

    def __getitem__(self, index: int) -> Example:
        self.check_index(index)
        entry = self.dataset[index]
        return self.chat_example(index, entry["question"], str(entry["answer"]), {"entry": entry})

    def extract(self, completion: str) -> str | None:
        """The content of the last ``<answer>`` tag, or ``None``."""
        return extract_final_answer(completion, self.answer_format)

    def score(self, completion: str, example: Example) -> float:
        """The generator's ``score_answer`` of the extracted answer (binarised by default).

        Returns 0.0 when no answer tag is present.
        """
        answer = self.extract(completion)
        if answer is None:
            return 0.0
        value = float(self.dataset.score_answer(answer, example.metadata["entry"]))
        if self.binary:
            return 1.0 if value >= 1.0 - 1e-9 else 0.0
        return value

    def __repr__(self) -> str:
        return f"ReasoningGymTask({self.dataset_name!r}, size={self.size}, seed={self.seed}, config={self.config})"


@register_task_family("rg:", "<dataset>")
def _reasoning_gym(dataset: str, **options: Any) -> ReasoningGymTask:
    """``rg:<dataset>``: any reasoning-gym dataset; options go to :class:`ReasoningGymTask`."""
    return ReasoningGymTask(dataset, **options)


@register_task("basic_arithmetic")
def _basic_arithmetic(**options: Any) -> ReasoningGymTask:
    return ReasoningGymTask("basic_arithmetic", **options)


@register_task("default")
def _default(**options: Any) -> ReasoningGymTask:
    """The default task (``DEFAULT_TASK``); options override its settings."""
    kwargs: dict[str, Any] = dict(DEFAULT_TASK["config"])
    kwargs["one_shot"] = DEFAULT_TASK["one_shot"]
    kwargs.update(options)
    return ReasoningGymTask(DEFAULT_TASK["dataset"], **kwargs)
