"""The task protocol, the ``Example`` record, chat-prompt building and the task registry."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

from echotrain.registry import Registry
from echotrain.rewards.extract import extract_answer_tag, extract_boxed

__all__ = [
    "ANSWER_FORMATS",
    "Example",
    "Task",
    "build_messages",
    "extract_final_answer",
    "get_task",
    "register_task",
    "register_task_family",
    "sample_indices",
    "task_names",
]

ANSWER_FORMATS = ("tag", "boxed")


@dataclass
class Example:
    """One prompt of a task.

    Attributes:
        messages: chat messages ``[{"role": "system"|"user"|"assistant", "content": str}]``:
            system instruction, optional one-shot user/assistant exchange, the user question;
            or a plain ``str`` prompt, used as-is without a chat template (the ``testbed`` task).
        question: the bare question text.
        answer: the gold answer as text.
        task: the name of the task that made it.
        index: its index in the task's dataset.
        metadata: what the task's scorer needs (reasoning-gym entry, dataset row fields).
    """

    messages: list[dict[str, str]] | str
    question: str
    answer: str
    task: str
    index: int
    metadata: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Task(Protocol):
    """What every task provides (see ``echotrain.tasks`` for the contract)."""

    name: str
    answer_format: str

    def sample(self, n: int, seed: int) -> list[Example]: ...

    def __iter__(self) -> Iterator[Example]: ...

    def __len__(self) -> int: ...

    def extract(self, completion: str) -> str | None: ...

    def score(self, completion: str, example: Example) -> float: ...

    def is_formatted(self, completion: str) -> bool: ...


def extract_final_answer(completion: str, answer_format: str) -> str | None:
    """The final answer of ``completion`` in ``answer_format`` (``"tag"`` or ``"boxed"``), or ``None``.

    Raises:
        ValueError: unknown ``answer_format``.
    """
    if answer_format == "tag":
        return extract_answer_tag(completion)
    if answer_format == "boxed":
        return extract_boxed(completion)
    raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")


def build_messages(
    question: str,
    *,
    system: str | None,
    one_shot: tuple[str, str] | None = None,
) -> list[dict[str, str]]:
    """Chat messages: optional system instruction, optional one-shot (user, assistant), question."""
    messages: list[dict[str, str]] = []
    if system:
        messages.append({"role": "system", "content": system})
    if one_shot is not None:
        messages.append({"role": "user", "content": one_shot[0]})
        messages.append({"role": "assistant", "content": one_shot[1]})
    messages.append({"role": "user", "content": question})
    return messages


def sample_indices(size: int, n: int, seed: int) -> list[int]:
    """``n`` dataset indices drawn reproducibly from ``range(size)`` (without replacement while
    ``n <= size``, then cycling through fresh permutations).

    Raises:
        ValueError: ``n`` negative or ``size`` < 1.
    """
    if size < 1:
        raise ValueError(f"cannot sample from an empty task (size={size})")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        perm = list(range(size))
        rng.shuffle(perm)
        out.extend(perm[: n - len(out)])
    return out


#: task name -> factory ``factory(**options) -> Task``; fill it with :func:`register_task`.
TASKS: Registry[Callable[..., Task]] = Registry("task", "task")
#: name prefix -> factory ``factory(member, **options) -> Task``; its registration declares
#: ``placeholder`` (naming the member in :func:`task_names`). Fill it with :func:`register_task_family`.
TASK_FAMILIES: Registry[Callable[..., Task]] = Registry("task family", "task")


def register_task(name: str, *, for_testbed: bool = False) -> Callable[[Callable[..., Task]], Callable[..., Task]]:
    """Decorator registering a task factory ``factory(**options) -> Task`` under ``name``.

    ``for_testbed``: its prompts are the bare byte-level text the CPU testbed policy
    (``model=testbed``) speaks (no chat template); ``model=testbed`` accepts only such tasks
    (:func:`task_for_testbed`).

    A factory may carry ``hub_dataset`` (a Hugging Face data set id it downloads without
    ``task_options.path``), which the preflight checks (:func:`task_hub_dataset`).

    Raises:
        ValueError: ``name`` is already registered.
    """
    return TASKS.register(name, for_testbed=for_testbed)


def task_for_testbed(name: str) -> bool:
    """Whether task ``name`` was registered ``for_testbed`` (False for unknown names and families)."""
    return name in TASKS and bool(TASKS.info(name).get("for_testbed"))


def register_task_family(prefix: str, placeholder: str) -> Callable[[Callable[..., Task]], Callable[..., Task]]:
    """Decorator registering ``factory(member, **options) -> Task`` for every task name
    ``prefix + member`` (``"rg:"`` + any reasoning-gym dataset); ``placeholder`` names the
    member in :func:`task_names` (``"<dataset>"``).

    Raises:
        ValueError: ``prefix`` is already registered.
    """
    return TASK_FAMILIES.register(prefix, placeholder=placeholder)


def task_names() -> list[str]:
    """Registered task names, plus each family's pattern (``"rg:<dataset>"``: any reasoning-gym dataset)."""
    return sorted(TASKS) + [prefix + TASK_FAMILIES.info(prefix)["placeholder"] for prefix in TASK_FAMILIES]


def task_hub_dataset(name: str) -> str | None:
    """The Hugging Face data set id task ``name``'s factory downloads (its ``hub_dataset``), or
    None (unknown name, a family member, or a task that needs no download)."""
    return getattr(TASKS.get(name), "hub_dataset", None)


def get_task(name: str, **options: Any) -> Task:
    """Build the task called ``name`` with ``options`` (see ``echotrain.tasks``).

    Raises:
        KeyError: unknown name (the message lists the valid ones).
        ValueError / TypeError: bad options (from the task's constructor).
    """
    if not isinstance(name, str):
        raise TypeError(f"task name must be a str, got {type(name).__name__}")
    for prefix, factory in TASK_FAMILIES.items():
        if name.startswith(prefix):
            return factory(name[len(prefix):], **options)
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; valid names: {', '.join(task_names())}")
    return TASKS[name](**options)
