"""The package's shape: no import cycle inside ``kvlab``, and kvlab imports inside functions or under
``TYPE_CHECKING`` only where start-up time needs them. The layer contract itself (each layer imports
only the layers below it) is import-linter's, in ``make lint`` (``[tool.importlinter]`` in pyproject)."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
# module -> why its kvlab imports wait inside functions
LAZY_IMPORTS = {
    "kvlab.cli": "`kvlab --help` and each subcommand import only what that subcommand runs (torch takes seconds)",
}


def _cycles(adj: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in adj:
        if root in index:
            continue
        work = [(root, iter(adj[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on.add(w)
                work.append((w, iter(adj[w])))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert _cycles({"a": ["b"], "b": []}) == []


def _package_imports(module: str) -> set[str]:
    """The kvlab packages ``module`` imports names from (``from kvlab.methods import X`` runs the package's
    ``__init__``, which may import ``module`` back); grimp records only the submodule."""
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.is_file():
        return set()
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("kvlab"):
            if (ROOT / n.module.replace(".", "/") / "__init__.py").is_file():
                out.add(n.module)
    return out


def test_no_import_cycle_inside_kvlab():
    graph = grimp.build_graph("kvlab", "kernels")
    mods = sorted(m for m in graph.modules if m.startswith("kvlab"))
    adj = {
        m: sorted(
            {x for x in graph.find_modules_directly_imported_by(m) if x.startswith("kvlab")} | _package_imports(m)
        )
        for m in mods
    }
    assert len(mods) > 80
    assert _cycles(adj) == []


def _deferred_imports(path: Path) -> list[int]:
    """Lines of kvlab/kernels imports inside a function or under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    lines = []
    for node in ast.walk(tree):
        scoped = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
            isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        )
        if not scoped:
            continue
        for n in ast.walk(node):
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(("kvlab", "kernels")):
                lines.append(n.lineno)
            elif isinstance(n, ast.Import) and any(a.name.startswith(("kvlab", "kernels")) for a in n.names):
                lines.append(n.lineno)
    return sorted(set(lines))


def test_kvlab_imports_are_at_module_level():
    found = {}
    for path in sorted((ROOT / "kvlab").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if module not in LAZY_IMPORTS and (lines := _deferred_imports(path)):
            found[module] = lines
    assert found == {}
    assert _deferred_imports(ROOT / "kvlab" / "cli.py"), "the exception above is stale: remove it"
