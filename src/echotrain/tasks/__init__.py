"""echotrain.tasks: prompts and gold answers for RL from verifiable rewards.

Public API
----------
``Example`` (dataclass): one prompt.
    ``messages``  chat messages ``[{"role": ..., "content": ...}]``: system instruction, an
                  optional one-shot user/assistant exchange, then the user question. Render with
                  ``tokenizer.apply_chat_template(ex.messages, add_generation_prompt=True)``.
    ``question``  the bare question text; ``answer`` the gold answer as text;
    ``metadata``  what the task's scorer needs (the reasoning-gym entry, the dataset row);
    ``task``      the task name; ``index`` the example's index in its dataset.

``Task`` (protocol) — every task has:
    ``name: str``, ``answer_format: "tag" | "boxed"``,
    ``sample(n, seed) -> list[Example]``  n examples, reproducible for a given seed,
    ``__iter__() / __len__()``            the examples in dataset order,
    ``extract(completion) -> str | None`` the final answer (``<answer>..</answer>`` or the last
                                          ``\\boxed{}``), ``None`` when absent (no fallback),
    ``score(completion, example) -> float`` 1.0 correct / 0.0 otherwise (binary by default),
    ``is_formatted(completion) -> bool``  whether an answer in the task's format is present.
    Optional: ``eval_task() -> Task``     the task's held-out split; the trainer's fixed greedy
                                          evaluation uses it when present (the ``testbed`` task).
    Optional: ``step_metrics(completions, examples, scores) -> dict[str, float]``  metrics of each
                                          step's rollouts, names declared with ``reduce="step"``
                                          (``echotrain.train.task_metrics``).
    ``answer_format`` values other than "tag" / "boxed" name a task's own form ("integer" ...)
    when the task brings its own ``extract``; testbed tasks (plain-string ``messages``, no chat
    template) register with ``register_task(name, for_testbed=True)``.
    Score the batch through ``echotrain.rewards.RewardFunction(task)`` (timeouts, counted errors).

``get_task(name, **options) -> Task``; ``task_names() -> list[str]``; ``register_task(name)``.
    ``"default"``           the task of ``echotrain train`` with no arguments
                            (``echotrain.tasks.gym.DEFAULT_TASK``): reasoning-gym basic_arithmetic,
                            two terms, + and -, operands 0-100, worked one-shot prompt.
                            SmolLM2-135M-Instruct starts at 35% accuracy / 77% format
                            (temperature 0.7, 192 prompts; ``scripts/measure_start_accuracy.py``),
    ``"basic_arithmetic"``  reasoning-gym basic_arithmetic with our one-shot prompt,
    ``"rg:<dataset>"``      any reasoning-gym dataset; options go to its config
                            (``size=``, ``seed=``, ``min_terms=`` ...), scored by its own scorer,
    ``"gsm8k"``             GSM8K (``path=`` a local JSONL file or folder, else the hub
                            ``openai/gsm8k``), math-verify equivalence,
    ``"math500"``           MATH-500 (``path=`` local JSONL, else ``HuggingFaceH4/MATH-500``).
    ``"jsonl"``             any prompt/answer JSONL (``path=``, ``prompt_field=``, ``answer_field=``;
                            ``echotrain.tasks.jsonl``), math-verify equivalence.
    ``"testbed"``           bare ``81-88=`` -> ``-7`` arithmetic of the CPU testbed policy
                            (``model=testbed``; ``echotrain.tasks.testbed``), exact integer match,
                            with a held-out split its ``eval_task()`` returns.
    ``"testbed-calc"``      four-digit ``4817+2933=`` in the testbed's format, for ``env=calculator``
                            (``echotrain.tasks.testbed_calc``): larger than the testbed adds alone.
    ``"testbed-length"``    sums of 2-8 terms worked step by step (``7+25=32;32+3=35;#35``) for the
                            length testbed policy (``model=testbed-length``;
                            ``echotrain.tasks.testbed_length``), scored on the final ``#<int>``.
    Unknown names raise ``KeyError`` listing the valid ones.
"""

from __future__ import annotations

from echotrain.tasks.base import (
    TASK_FAMILIES,
    TASKS,
    Example,
    Task,
    get_task,
    register_task,
    register_task_family,
    task_for_testbed,
    task_hub_dataset,
    task_names,
)
from echotrain.tasks.gym import DEFAULT_TASK, ReasoningGymTask
from echotrain.tasks.math_sets import JsonlMathTask, load_gsm8k, load_math500
from echotrain.tasks import jsonl as _jsonl  # noqa: F401  registers task=jsonl
from echotrain.tasks.testbed import TestbedTask
from echotrain.tasks.testbed_length import LengthTestbedTask
from echotrain.tasks import testbed_calc as _testbed_calc  # noqa: F401  registers task=testbed-calc

__all__ = [
    "TASKS",
    "TASK_FAMILIES",
    "register_task_family",
    "task_for_testbed",
    "task_hub_dataset",
    "DEFAULT_TASK",
    "Example",
    "JsonlMathTask",
    "LengthTestbedTask",
    "ReasoningGymTask",
    "Task",
    "TestbedTask",
    "get_task",
    "load_gsm8k",
    "load_math500",
    "register_task",
    "task_names",
]
