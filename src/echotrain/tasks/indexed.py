"""A mixin for tasks that are a fixed sequence of examples (JSONL math sets, multiple-choice
benchmarks, the testbed): iteration, reproducible sampling and the format check, written once.

A class that defines ``__getitem__`` (an :class:`~echotrain.tasks.base.Example` per index,
``IndexError`` outside ``range(len(self))``, e.g. by :meth:`IndexedTask.check_index`), ``extract``
and either a ``size`` attribute or its own ``__len__`` gets the rest of the
:class:`~echotrain.tasks.base.Task` protocol's sequence part from :class:`IndexedTask`.
"""

from __future__ import annotations

from typing import Any, Iterator

from echotrain.tasks.base import Example, build_messages, sample_indices


class IndexedTask:
    """``__iter__``, ``sample``, ``is_formatted`` and a chat :class:`Example` builder for a task
    held as ``len(self)`` indexed examples (see the module docstring)."""

    name: str
    system: str | None = None
    one_shot: tuple[str, str] | None = None

    def __len__(self) -> int:
        """The task's ``size`` (a class holding its examples otherwise defines its own)."""
        return self.size  # type: ignore[attr-defined]

    def check_index(self, index: int) -> None:
        """Raises:
        IndexError: ``index`` outside ``range(len(self))``, naming the task and its size."""
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for task {self.name} of size {len(self)}")

    def __iter__(self) -> Iterator[Example]:
        for i in range(len(self)):  # type: ignore[arg-type]
            yield self[i]  # type: ignore[index]

    def sample(self, n: int, seed: int) -> list[Example]:
        """``n`` examples drawn reproducibly (``seed``) without replacement while ``n <= len(self)``
        (:func:`~echotrain.tasks.base.sample_indices`).

        Raises:
            ValueError: ``n`` negative.
        """
        return [self[i] for i in sample_indices(len(self), n, seed)]  # type: ignore[arg-type, index]

    def is_formatted(self, completion: str) -> bool:
        """Whether ``extract`` finds an answer in the completion."""
        return self.extract(completion) is not None  # type: ignore[attr-defined]

    def chat_example(self, index: int, question: str, answer: str, metadata: dict[str, Any]) -> Example:
        """The :class:`Example` at ``index``: chat messages of ``question`` after the task's
        ``system`` instruction and ``one_shot`` exchange (:func:`~echotrain.tasks.base.build_messages`)."""
        return Example(messages=build_messages(question, system=self.system, one_shot=self.one_shot),
                       question=question, answer=answer, task=self.name, index=index, metadata=metadata)
