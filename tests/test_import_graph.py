"""No import cycles in src/echotrain: every ``import`` between its modules, at module level or
inside a function (a lazy import still ties the two modules together), under ``TYPE_CHECKING``
or not, and every import by string (``"echotrain.train.commands:register_train"`` in cli.py's
command table, ``importlib.import_module("echotrain.x")``) must form a graph without cycles
(docs/design/architecture.md: one direction of dependency); no module below the CLI imports it;
the runtime layer (``echotrain.runtime``: what training and evaluation share) imports neither
the trainer's orchestration (``echotrain.train``), the benchmark suites (``echotrain.evalsuite``)
nor the CLI; and ``echotrain.evalsuite`` imports nothing from ``echotrain.train``."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "echotrain"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` below ``root`` (a package)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports (``from pkg import sub`` names ``pkg.sub``
    when that is a module, else ``pkg``; a string constant ``"pkg.sub:attr"`` or ``import_module("pkg.sub")``
    naming a module of the tree counts as an import of it); relative imports resolved."""
    mods = module_names(root)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and ":" in node.value:
                # a string import "pkg.mod:attr" (a command table, a registered class) of the tree
                target = node.value.partition(":")[0]
                if target in mods:
                    edges.add(target)
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
                  and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in mods):
                edges.add(node.args[0].value)  # importlib.import_module("pkg.mod")
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for a in node.names:
                    target = f"{base}.{a.name}"
                    edges.add(target if target in mods else base)
        graph[name] = {e for e in edges if e in mods and e != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycles_in_src():
    graph = import_graph(SRC)
    assert len(graph) > 50 and "echotrain.rl.stepwise" in graph["echotrain.rl"]  # the walk sees the tree
    assert cycles(graph) == []


def test_nothing_below_the_cli_imports_it():
    graph = import_graph(SRC)
    assert "echotrain.train.commands" in graph["echotrain.cli"]  # its string-loaded commands are edges
    assert sorted(m for m, deps in graph.items() if "echotrain.cli" in deps) == []


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_runtime_imports_neither_train_nor_evalsuite_nor_cli():
    graph = import_graph(SRC)
    runtime = sorted(m for m in graph if _in(m, "echotrain.runtime"))
    assert {"echotrain.runtime.rollout", "echotrain.runtime.preflight", "echotrain.runtime.loading"} <= set(runtime)
    assert "echotrain.runtime.checkpoints" in graph["echotrain.runtime.loading"]  # lazy imports are edges
    bad = sorted((m, d) for m in runtime for d in graph[m]
                 if any(_in(d, p) for p in ("echotrain.train", "echotrain.evalsuite", "echotrain.cli")))
    assert bad == []


def test_evalsuite_imports_nothing_from_train():
    graph = import_graph(SRC)
    suite = [m for m in graph if _in(m, "echotrain.evalsuite")]
    assert "echotrain.runtime.loading" in graph["echotrain.evalsuite.runner"]  # the walk sees its lazy imports
    assert sorted((m, d) for m in suite for d in graph[m] if _in(d, "echotrain.train")) == []


def test_the_walk_finds_lazy_and_type_checking_cycles(tmp_path):
    """The detector itself: a lazy (function-level) import and a TYPE_CHECKING import each close a
    cycle; ``from pkg import sub`` and relative imports resolve to the submodule."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.d\n")
    (pkg / "d.py").write_text("from pkg.c import y\n")
    (pkg / "e.py").write_text("from pkg import a\n")  # imports into a cycle, not part of one
    (pkg / "f.py").write_text('COMMANDS = {"g": "pkg.g:run"}\n')  # loaded by string
    (pkg / "g.py").write_text("def run():\n    import pkg.f\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"} and graph["pkg.f"] == {"pkg.g"}
    assert sorted(cycles(graph)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"], ["pkg.f", "pkg.g"]]


#: the floors of the house (docs/design/architecture.md), lowest first: a module imports only from
#: its own floor or below. Floor 0 is every top-level module (``echotrain.errors``,
#: ``echotrain.cache``, ``echotrain.atomic``, ``echotrain.registry`` ...) and the package itself.
FLOORS = (
    ("<top-level modules>",),
    ("echotrain.rl", "echotrain.optim", "echotrain.roofline"),
    ("echotrain.rewards",),
    ("echotrain.tasks", "echotrain.envs"),
    ("echotrain.models",),
    ("echotrain.runtime",),
    ("echotrain.evalsuite", "echotrain.experiments", "echotrain.integrations"),
    ("echotrain.train",),
    ("echotrain.compare", "echotrain.devicecheck"),
    ("echotrain.cli",),
)


def floor_of(module: str, root: Path = SRC) -> int:
    """The floor (index into :data:`FLOORS`) of a module of the tree; a top-level module that is
    not a package (``echotrain.errors``) is floor 0, except the CLI, which is the roof."""
    parts = module.split(".")
    top = ".".join(parts[:2])
    for i, names in enumerate(FLOORS):
        if top in names:
            return i
    if len(parts) <= 2 and not (root / parts[-1]).is_dir():
        return 0
    raise AssertionError(f"{module}: a package on no floor; add it to FLOORS (and to architecture.md)")


def arrows_up(graph: dict[str, set[str]], root: Path = SRC) -> list[tuple[str, str]]:
    """Every import from a module to one on a higher floor."""
    return sorted((m, d) for m, deps in graph.items() for d in deps if floor_of(d, root) > floor_of(m, root))


def test_no_arrow_points_up():
    """rewards/custom.py raised runtime's ConfigError and roofline/peaks.py asked models for the
    cache folder: both now come from the ground floor (echotrain.errors, echotrain.cache)."""
    graph = import_graph(SRC)
    assert floor_of("echotrain.errors") == floor_of("echotrain.cache") == 0 < floor_of("echotrain.rewards.custom")
    assert "echotrain.errors" in graph["echotrain.rewards.custom"]  # the walk sees its lazy import
    assert "echotrain.cache" in graph["echotrain.roofline.peaks"]
    assert arrows_up(graph) == []


def test_an_arrow_planted_up_is_found(tmp_path):
    """The check itself, on a copy of the tree with today's two old arrows planted back."""
    import shutil

    root = tmp_path / "echotrain"
    shutil.copytree(SRC, root, ignore=shutil.ignore_patterns("__pycache__", "*.pt", "*.json", "*.gguf"))
    with open(root / "rewards" / "custom.py", "a") as fh:
        fh.write("\n\ndef _planted():\n    from echotrain.runtime.preflight import check_model\n")
    with open(root / "roofline" / "peaks.py", "a") as fh:
        fh.write("\nfrom echotrain.models import gguf as _planted\n")
    assert arrows_up(import_graph(root), root) == [("echotrain.rewards.custom", "echotrain.runtime.preflight"),
                                                   ("echotrain.roofline.peaks", "echotrain.models.gguf")]
