"""echotrain.envs: environments for multi-turn, tool-using RL (docs/design/environments.md).

``Environment`` (protocol): ``reset(example) -> prompt``, ``step(completion) -> EnvReply``; one
instance per episode. ``register_env(name)`` adds one (plugins welcome); ``env=<name>`` with
``env_options.KEY=VALUE`` selects it in ``echotrain train``. Shipped: ``calculator``
(:mod:`echotrain.envs.calculator`), ``python`` (model-written code in a limited subprocess), ``trl`` (a TRL 1.16
``environment_factory`` class by import path, :mod:`echotrain.envs.trl_env`), ``verifiers`` (a prime-rl
``verifiers``-style multi-turn environment object by import path, :mod:`echotrain.envs.verifiers_env`),
``tools`` (any plain callables by import path, the trainer's ``tools=`` key) and ``feedback`` (a scripted
reply after every turn, for tests and ablations).

Tools are plain callables (:mod:`echotrain.envs.tools`: schema from the signature and docstring,
Hermes/Qwen ``<tool_call>`` parsing, calls that fail as counted errors);
:mod:`echotrain.envs.python_exec` runs model-written Python in a limited subprocess.
"""

from __future__ import annotations

from echotrain.envs.base import (ENVIRONMENTS, EnvReply, Environment, ToolEnvironment, env_names, get_env_factory,
                                 register_env, tool_system_prompt)
from echotrain.envs import calculator as _calculator  # noqa: F401  registers env=calculator
from echotrain.envs import library as _library  # noqa: F401  registers env=tools, env=python, env=feedback
from echotrain.envs import trl_env as _trl_env  # noqa: F401  registers env=trl (TRL's environment_factory)
from echotrain.envs import verifiers_env as _verifiers_env  # noqa: F401  registers env=verifiers
from echotrain.envs.tools import ToolCall, ToolResult, call_tool, parse_tool_calls, tool_schema

__all__ = ["ENVIRONMENTS", "EnvReply", "Environment", "ToolCall", "ToolEnvironment", "ToolResult", "call_tool",
           "env_names", "get_env_factory", "parse_tool_calls", "register_env", "tool_schema", "tool_system_prompt"]
