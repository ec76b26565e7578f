"""The runtime's import rules (docs/architecture.md, "Import rules"), checked on the source with ``ast``.

Every module of ``src/gemscout`` is parsed, and every import in it is collected: module-level ones, function-local
(lazy) ones, ``if TYPE_CHECKING:`` ones and ``importlib.import_module("literal")`` calls. The rules:

1. the runtime never imports the harness (``qualification``), by any kind of import;
2. a core module (outside ``gemscout.adapters``) imports no optional framework at module level: a framework is
   imported where it is used, so ``import gemscout`` works without it;
3. ``gemscout.state`` (the state codec and digests both capabilities build on) imports neither ``gemscout.gemini``
   nor ``gemscout.scout``, by any kind of import;
4. no import cycle among the runtime's modules: none through module-level imports, and none through lazy ones
   either (a lazy import that closes a cycle is a design cycle hidden from the interpreter).

A violation names the module, the line and the import. The rules are also run against a small synthetic tree that
breaks each one, so a checker that silently finds nothing fails here too. A last test imports gemscout in a fresh
interpreter and checks that torch.distributed is left as it was and that no harness dependency was loaded.
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

SRC = Path(__file__).resolve().parents[2] / "src"

# Optional frameworks (and the one optional binding) a core module may import only inside the function that uses it.
OPTIONAL = ("deepspeed", "megatron", "torchtitan", "transformers", "torchdata", "torchft", "pynvml")
HARNESS = "qualification"
# The qualification harness's dependencies (the `qualify` extra): a plain `import gemscout` loads none of them.
HARNESS_DEPS = ("pandas", "jinja2", "typer", "rich", "jsonschema", "cryptography")

# Lazy imports allowed to close a cycle, each with the reason it is still here. An entry that no longer matches a
# lazy import fails the test: delete it when the cycle is fixed. The cycle rule for module-level imports has no
# allow-list.
ALLOWED_LAZY_CYCLE_EDGES: Mapping[tuple[str, str], str] = {}


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement's target as seen from the importing module."""

    importer: str  # dotted module name, e.g. gemscout.scout.engine
    target: str  # dotted name imported: a module, or the module a name is imported from
    path: str  # relative to src/, e.g. gemscout/scout/engine.py
    line: int
    lazy: bool  # inside a function body: runs when the function does
    type_only: bool  # under `if TYPE_CHECKING:`: never runs

    @property
    def eager(self) -> bool:
        return not self.lazy and not self.type_only

    def where(self) -> str:
        kind = "type-only" if self.type_only else "lazy" if self.lazy else "module-level"
        return f"{self.importer} ({self.path}:{self.line}) imports {self.target} ({kind})"


def modules(src: Path) -> dict[str, tuple[Path, bool]]:
    """Every module under ``src/gemscout``: dotted name -> (file, is a package ``__init__``)."""
    found: dict[str, tuple[Path, bool]] = {}
    for path in sorted((src / "gemscout").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(
    src: Path, name: str, path: Path, is_package: bool, known: Mapping[str, object]
) -> list[Import]:
    """All imports in one module. ``from pkg import mod`` resolves to ``pkg.mod`` when that is a runtime module."""
    package = name if is_package else name.rpartition(".")[0]
    shown = path.relative_to(src).as_posix()
    found: list[Import] = []

    def absolute(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = package.split(".")
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def visit(node: ast.AST, lazy: bool, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, lazy, True)
            for child in node.orelse:
                visit(child, lazy, type_only)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(name, alias.name, shown, node.lineno, lazy, type_only))
        elif isinstance(node, ast.ImportFrom):
            module = absolute(node)
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                target = submodule if submodule in known else module
                found.append(Import(name, target, shown, node.lineno, lazy, type_only))
        elif (
            isinstance(node, ast.Call)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (
                    isinstance(node.func, ast.Name)
                    and node.func.id in ("import_module", "__import__")
                )
            )
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append(Import(name, node.args[0].value, shown, node.lineno, lazy, type_only))
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner, type_only)

    visit(ast.parse(path.read_text(), filename=str(path)), False, False)
    return found


@functools.cache  # parsed once per tree: every rule reads the same imports
def all_imports(src: Path) -> tuple[Import, ...]:
    known = modules(src)
    return tuple(
        imp
        for name, (path, is_pkg) in known.items()
        for imp in imports_of(src, name, path, is_pkg, known)
    )


def _root(dotted: str) -> str:
    return dotted.split(".")[0]


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def harness_imports(src: Path) -> list[str]:
    return [imp.where() for imp in all_imports(src) if _root(imp.target) == HARNESS]


def framework_imports_in_core(src: Path) -> list[str]:
    return [
        imp.where()
        for imp in all_imports(src)
        if imp.eager
        and _root(imp.target) in OPTIONAL
        and not _within(imp.importer, "gemscout.adapters")
    ]


def state_layer_imports(src: Path) -> list[str]:
    return [
        imp.where()
        for imp in all_imports(src)
        if _within(imp.importer, "gemscout.state")
        and (_within(imp.target, "gemscout.gemini") or _within(imp.target, "gemscout.scout"))
    ]


def module_graph(
    src: Path, *, lazy: bool, allowed: Mapping[tuple[str, str], str] | None = None
) -> dict[str, dict[str, Import]]:
    """importer -> {imported runtime module: the import that makes the edge}.

    ``import gemscout.scout.reports`` also runs ``gemscout/scout/__init__.py`` first, so an import from outside a
    package adds an edge to that package too (a sibling's import of its own package is already under way).
    Type-only imports never run and make no edge; lazy ones do when ``lazy`` is set. ``allowed`` edges are left out.
    """
    known = modules(src)
    allowed = allowed or {}
    graph: dict[str, dict[str, Import]] = {name: {} for name in known}
    for imp in all_imports(src):
        if imp.type_only or (imp.lazy and not lazy) or not _within(imp.target, "gemscout"):
            continue
        target = imp.target
        while target not in known and "." in target:
            target = target.rpartition(".")[0]
        own_package = imp.importer if known[imp.importer][1] else imp.importer.rpartition(".")[0]
        targets = [target]
        ancestor = target.rpartition(".")[0]
        while ancestor and ancestor != "gemscout":
            if not _within(own_package, ancestor):
                targets.append(ancestor)
            ancestor = ancestor.rpartition(".")[0]
        for node in targets:
            if node != imp.importer and (imp.importer, node) not in allowed:
                graph[imp.importer].setdefault(node, imp)
    return graph


def cycles(graph: Mapping[str, Mapping[str, Import]]) -> list[str]:
    """One cycle per strongly connected component of ``graph``, written out with the import that makes each edge."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def strongconnect(node: str) -> None:  # Tarjan; the graph is ~150 nodes, recursion is fine
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                strongconnect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            strongconnect(node)

    def one_cycle(component: set[str]) -> list[str]:
        start = min(component)
        parent: dict[str, str] = {}
        frontier = [start]
        while frontier:  # breadth first inside the component, back to start
            nxt: list[str] = []
            for node in frontier:
                for succ in sorted(graph[node]):
                    if succ == start:
                        path = [node]
                        while path[-1] != start:
                            path.append(parent[path[-1]])
                        return [start, *reversed(path[:-1]), start]
                    if succ in component and succ not in parent:
                        parent[succ] = node
                        nxt.append(succ)
            frontier = nxt
        raise AssertionError(f"no cycle through {start} in {sorted(component)}")

    described = []
    for component in components:
        path = one_cycle(component)
        edges = [graph[a][b].where() for a, b in zip(path, path[1:], strict=False)]
        described.append(" -> ".join(path) + "\n    " + "\n    ".join(edges))
    return described


def _fail_if(found: list[str], rule: str) -> None:
    assert not found, f"{rule}:\n  " + "\n  ".join(found)


def test_the_runtime_never_imports_the_harness() -> None:
    _fail_if(harness_imports(SRC), "the runtime imports the qualification harness")


def test_core_modules_import_no_optional_framework_at_module_level() -> None:
    _fail_if(
        framework_imports_in_core(SRC),
        "a core module imports an optional framework at module level (import it in the function that uses it,"
        " or move the code to gemscout/adapters/)",
    )


def test_state_imports_neither_gemini_nor_scout() -> None:
    _fail_if(state_layer_imports(SRC), "gemscout.state imports a capability built on it")


def test_no_import_cycle_through_module_level_imports() -> None:
    _fail_if(cycles(module_graph(SRC, lazy=False)), "import cycle among runtime modules")


def test_no_import_cycle_through_lazy_imports_except_the_allowed_ones() -> None:
    _fail_if(
        cycles(module_graph(SRC, lazy=True, allowed=ALLOWED_LAZY_CYCLE_EDGES)),
        "import cycle among runtime modules through a lazy import",
    )
    lazy_edges = {
        (imp.importer, imp.target) for imp in all_imports(SRC) if imp.lazy and not imp.type_only
    }
    stale = [f"{a} -> {b}" for a, b in ALLOWED_LAZY_CYCLE_EDGES if (a, b) not in lazy_edges]
    _fail_if(stale, "ALLOWED_LAZY_CYCLE_EDGES names a lazy import that is gone: delete the entry")
    still_cyclic = [
        f"{a} -> {b}"
        for a, b in ALLOWED_LAZY_CYCLE_EDGES
        if not cycles(
            module_graph(
                SRC,
                lazy=True,
                allowed={k: v for k, v in ALLOWED_LAZY_CYCLE_EDGES.items() if k != (a, b)},
            )
        )
    ]
    _fail_if(
        still_cyclic,
        "ALLOWED_LAZY_CYCLE_EDGES names an edge that closes no cycle any more: delete the entry",
    )


def _tree(root: Path, files: Mapping[str, str]) -> Path:
    for relative, text in files.items():
        path = root / "gemscout" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_rules_catch_each_kind_of_violation(tmp_path: Path) -> None:
    """The checker run on a tree that breaks every rule once: each break is reported, and only those."""
    src = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "adapters/__init__.py": "",
            "adapters/ds.py": "import deepspeed\n",  # allowed: adapters may import their framework
            "core.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torchft\n"
            "def f():\n    import transformers\n    from qualification.cells import x\n",
            "eager.py": "try:\n    import megatron.core\nexcept ImportError:\n    pass\n",
            "state/__init__.py": "",
            "state/codec.py": "def f():\n    from ..scout import engine\n",
            "scout/__init__.py": "from .engine import Scout\n",
            "scout/engine.py": "from gemscout import a\n",
            "a.py": "import gemscout.b\n",
            "b.py": "from gemscout.scout.reports import X\n",  # runs scout/__init__ -> engine -> a -> b
            "scout/reports.py": "",
            "gemini/__init__.py": "",
            "gemini/x.py": "def f():\n    from gemscout.gemini import y\n",
            "gemini/y.py": "import importlib\ndef g():\n    importlib.import_module('gemscout.gemini.x')\n",
        },
    )
    assert harness_imports(src) == [
        "gemscout.core (gemscout/core.py:6) imports qualification.cells (lazy)"
    ]
    assert framework_imports_in_core(src) == [
        "gemscout.eager (gemscout/eager.py:2) imports megatron.core (module-level)"
    ]
    assert state_layer_imports(src) == [
        "gemscout.state.codec (gemscout/state/codec.py:2) imports gemscout.scout.engine (lazy)"
    ]
    (eager_cycle,) = cycles(module_graph(src, lazy=False))
    assert eager_cycle.startswith(
        "gemscout.a -> gemscout.b -> gemscout.scout -> gemscout.scout.engine -> gemscout.a"
    )
    lazy_cycles = cycles(module_graph(src, lazy=True))
    assert len(lazy_cycles) == 2 and any(
        c.startswith("gemscout.gemini.x -> gemscout.gemini.y") for c in lazy_cycles
    )
    assert (
        len(
            cycles(
                module_graph(
                    src, lazy=True, allowed={("gemscout.gemini.y", "gemscout.gemini.x"): ""}
                )
            )
        )
        == 1
    )


# Checked in a fresh interpreter: this test process has imported the harness and may have patched torch.
_PROBE = f"""
import json, sys
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

def callables():
    return {{f"{{mod.__name__}}.{{k}}": v for mod in (dist, c10d) for k, v in vars(mod).items() if callable(v)}}

before = callables()
import gemscout
after = callables()
changed = sorted(k for k in before.keys() | after.keys() if before.get(k) is not after.get(k))
loaded = sorted(m for m in {HARNESS_DEPS!r} if m in sys.modules)
watched = "torch.distributed.destroy_process_group" in before and "torch.distributed.all_reduce" in before
print(json.dumps({{"changed": changed, "loaded": loaded, "watched": watched}}))
"""


def test_import_gemscout_patches_nothing_in_torch_distributed_and_loads_no_harness_dependency() -> (
    None
):
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=100, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # Every callable of torch.distributed and distributed_c10d: destroy_process_group and the collectives among them.
    assert result["watched"], (
        "the probe no longer sees destroy_process_group / all_reduce in torch.distributed"
    )
    assert result["changed"] == [], f"import gemscout replaced: {result['changed']}"
    assert result["loaded"] == [], (
        f"import gemscout loaded harness dependencies: {result['loaded']}"
    )
