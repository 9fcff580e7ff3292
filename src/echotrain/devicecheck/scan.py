"""Static guards of the CUDA path, run by the CPU test suite (tests/test_device_guards.py).

Two scans of echotrain's source (Python ``ast``, no import of the scanned modules):

- :func:`hard_coded_cpu`: every place where the string ``"cpu"`` picks a device: an argument of
  ``torch.device(...)``, ``.to(...)``, ``torch.Generator(...)``, a ``device=`` / ``map_location=``
  keyword, a parameter default named ``device`` / ``map_location``, an assignment to a name
  ending in ``device``, and ``fork_rng(devices=[])`` (it forks the CPU generator only, so
  seeding or sampling on the GPU inside it moves the run's CUDA stream). A comparison (``device.type == "cpu"``) is a test, not a choice, and
  ``.cpu()`` moves a result to host memory on purpose (metrics, the trainer's per-token
  log-probs); neither is reported. A CUDA run passes through every reported place, so each
  must be listed in :data:`ALLOWED_CPU` with the reason it is right on CUDA too.
- :func:`cuda_branches`: every function holding a branch taken only on CUDA: an ``if`` /
  conditional expression / boolean operand whose test mentions ``"cuda"``, ``torch.cuda.*`` or
  ``.is_cuda``. The device check (:mod:`echotrain.devicecheck`) names the check that executes
  each one (:data:`echotrain.devicecheck.CUDA_BRANCHES`), so no CUDA-only line is left that no
  check reaches.

Both return :class:`Finding` s keyed by ``module:qualname`` (the enclosing function or class
method, ``<module>`` at top level), so an allowance survives edits that move lines.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Iterator

#: The package root scanned by default.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]

#: Folders/files not on a training path (owned elsewhere or CPU-only by design), never scanned.
SKIPPED = ("compare/", "train/async_rollouts.py", "devicecheck/")

#: ``module:qualname`` -> why a hard-coded "cpu" there is right on a CUDA run as well.
ALLOWED_CPU: dict[str, str] = {
    "runtime/checkpoints.py:load_checkpoint": "map_location default: a checkpoint is read into host memory and "
                                             "its tensors moved by load_state_dict (module.to / the optimizer's "
                                             "own cast to each parameter's device)",
    "runtime/loading.py:load_for_eval": "parameter default of the eval API; echotrain eval / the trainer pass "
                                       "their device",
    "models/hf.py:load_policy": "parameter default; the trainer passes str(self.device)",
    "models/hf.py:global_rng_kept": "parameter default; the CUDA RNG is forked when a CUDA device is given",
    "models/testbed.py:load_testbed": "parameter default; load_policy passes the run's device",
    "models/testbed.py:_one_thread_and_own_rng": "the testbed is built on the CPU; load_policy's "
                                                 "global_rng_kept restores the CUDA generators around it",
    "train/checkpoint.py:resume_from": "a checkpoint is read into host memory: RNG states must be CPU byte "
                                        "tensors; load_state_dict moves the rest to each parameter's device",
    "evalsuite/runner.py:evaluate_run_dir": "parameter default of the eval suite API (--device sets it)",
    "runtime/device.py:resolve_device_why": "device=auto without a usable CUDA GPU: the CPU, by definition",
    "train/checkpoint.py:cpu_snapshot.snap": "the CPU snapshot of async_save is a host copy by definition",
    "train/dist.py:init_distributed": "no device given (a CPU run): the gloo backend",
    "rl/stepwise.py:compute_step_stats": "fallback when no micro-batch holds a tensor; otherwise the masks' device",
    "optim/adamw4bit.py:AdamW4bit.load_state_dict": "the step count stays a host scalar, as torch's AdamW keeps it",
}


@dataclasses.dataclass(frozen=True)
class Finding:
    """One reported place: ``where`` = ``module:qualname`` (module relative to the package root),
    ``line`` (1-based) and ``what`` (the source text of the expression)."""

    where: str
    line: int
    what: str


def _qualnames(tree: ast.AST) -> dict[ast.AST, str]:
    """Each node -> the qualified name of the innermost function/class around it."""
    out: dict[ast.AST, str] = {}

    def walk(node: ast.AST, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = name
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = child.name if name == "<module>" else f"{name}.{child.name}"
            out[child] = inner
            walk(child, inner)

    out[tree] = "<module>"
    walk(tree, "<module>")
    return out


def _is_cpu(node: ast.AST | None) -> bool:
    """``node`` chooses "cpu": the constant, or a conditional expression / ``or`` that can."""
    if isinstance(node, ast.IfExp):
        return _is_cpu(node.body) or _is_cpu(node.orelse)
    if isinstance(node, ast.BoolOp):
        return any(_is_cpu(v) for v in node.values)
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split(":")[0] == "cpu"


def _call_name(node: ast.Call) -> str:
    f = node.func
    parts = []
    while isinstance(f, ast.Attribute):
        parts.append(f.attr)
        f = f.value
    if isinstance(f, ast.Name):
        parts.append(f.id)
    return ".".join(reversed(parts))


_DEVICE_KEYWORDS = ("device", "map_location")
_DEVICE_CALLS = ("torch.device", "device", "torch.Generator", "Generator")


def _cpu_choices(tree: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``tree`` where "cpu" is chosen as a device (the module docstring's list)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _call_name(node)
            if name in _DEVICE_CALLS or name == "to" or name.endswith(".to"):
                if node.args and _is_cpu(node.args[0]):
                    yield node
                    continue
            if any(kw.arg in _DEVICE_KEYWORDS and _is_cpu(kw.value) for kw in node.keywords):
                yield node
            elif name.endswith("fork_rng") and any(kw.arg == "devices" and isinstance(kw.value, (ast.List, ast.Tuple))
                                                   and not kw.value.elts for kw in node.keywords):
                yield node  # fork_rng(devices=[]): the CPU generator only
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            pos = a.posonlyargs + a.args
            pairs = list(zip(pos[len(pos) - len(a.defaults):], a.defaults)) + list(zip(a.kwonlyargs, a.kw_defaults))
            if any(arg.arg in _DEVICE_KEYWORDS and _is_cpu(d) for arg, d in pairs):
                yield node
        elif isinstance(node, ast.Assign) and _is_cpu(node.value):
            if any(isinstance(t, ast.Name) and t.id.endswith("device") for t in node.targets):
                yield node


def _mentions_cuda(test: ast.AST) -> bool:
    for node in ast.walk(test):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split(":")[0] == "cuda":
            return True
        if isinstance(node, ast.Attribute) and (node.attr == "is_cuda" or (
                node.attr == "cuda" and isinstance(node.value, ast.Name) and node.value.id == "torch")):
            return True
    return False


def _cuda_tests(tree: ast.AST) -> Iterator[ast.AST]:
    """The branch tests of ``tree`` that mention CUDA."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)) and _mentions_cuda(node.test):
            yield node
        elif isinstance(node, ast.BoolOp) and any(_mentions_cuda(v) for v in node.values[:-1]):
            yield node  # ``x.is_cuda and ...``: a short circuit is a branch too


def _source_files(root: Path) -> Iterator[tuple[str, Path]]:
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if not any(rel.startswith(s) or rel == s for s in SKIPPED):
            yield rel, path


def _findings(source: str, rel: str, picker) -> list[Finding]:
    tree = ast.parse(source)
    names = _qualnames(tree)
    seen: dict[tuple[str, int], Finding] = {}
    for node in picker(tree):
        where = f"{rel}:{names.get(node, '<module>')}"
        text = ast.get_source_segment(source, node) or ""
        line = getattr(node, "lineno", 0)
        seen.setdefault((where, line), Finding(where, line, text.splitlines()[0][:120] if text else ""))
    return sorted(seen.values(), key=lambda f: (f.where, f.line))


def hard_coded_cpu(source: str, rel: str = "<string>") -> list[Finding]:
    """The places of one module's ``source`` where ``"cpu"`` is chosen as a device (module doc).

    Args:
        source: Python source text.
        rel: the module's path relative to the package root, the prefix of each ``where``.
    Raises:
        SyntaxError: ``source`` does not parse.
    """
    return _findings(source, rel, _cpu_choices)


def cuda_branches(source: str, rel: str = "<string>") -> list[Finding]:
    """The branches of one module's ``source`` taken only on CUDA (module doc).

    Raises:
        SyntaxError: ``source`` does not parse.
    """
    return _findings(source, rel, _cuda_tests)


def scan_package(root: Path = PACKAGE_ROOT) -> tuple[list[Finding], list[Finding]]:
    """``(hard_coded_cpu, cuda_branches)`` findings of every module under ``root`` but
    :data:`SKIPPED`."""
    cpu, cuda = [], []
    for rel, path in _source_files(root):
        text = path.read_text()
        cpu += hard_coded_cpu(text, rel)
        cuda += cuda_branches(text, rel)
    return cpu, cuda


def unexplained_cpu(findings: list[Finding], allowed: dict[str, str] | None = None) -> list[Finding]:
    """The findings whose ``where`` has no entry in ``allowed`` (default :data:`ALLOWED_CPU`)."""
    allowed = ALLOWED_CPU if allowed is None else allowed
    return [f for f in findings if f.where not in allowed]
