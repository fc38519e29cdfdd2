"""No import cycle in loraplane/ (issue 32, point 5): kernels depend on data types, the CLI's
sub-commands on a leaf of exit codes, the engine's commands and the server's metrics on a
snapshot module, the model families on a config module that imports none of them.

Every import counts, at module level or inside a function (a deferred import that breaks a
cycle at run time still ties the two modules together), except those under
`if TYPE_CHECKING:`, which never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "loraplane"


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(
    module: str, path: Path, node: ast.Import | ast.ImportFrom, known: set[str]
) -> set[str]:
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the module's package, up level - 1 packages
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join([*package, base] if base else package)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    found = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module and not module.startswith(name + "."):
            found.add(name)  # a package's own __init__ is not a cycle of its children
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the modules of `root`'s package it imports (TYPE_CHECKING blocks left out)."""
    modules = _modules(root)
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        graph[module] = {t for node in _imports(tree) for t in _targets(module, path, node, known)}
    return graph


def _imports(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import under `node` that runs (none under `if TYPE_CHECKING:`)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            found.append(child)
        found += _imports(child)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_loraplane_has_no_import_cycle() -> None:
    graph = import_graph(PACKAGE)
    assert len(graph) > 200  # the whole package was read
    assert cycles(graph) == []


def test_the_check_finds_a_cycle_through_a_deferred_import_and_not_through_type_checking(
    tmp_path: Path,
) -> None:
    """The negative control: a cycle closed by an import inside a function is found; one
    closed only under TYPE_CHECKING, or by a child importing its own package, is not."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    modules = {  # module path (without its suffix, so no doc scan takes them for ours) -> text
        "__init__": "from pkg import a\n",
        "a": "from pkg.b import thing\n",
        "b": "def f():\n    from pkg import a\n",
        "c": "from pkg import d\n",
        "d": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n",
        "sub/__init__": "",
        "sub/e": "from .. import c\nfrom . import f\n",
        "sub/f": "from pkg.sub import e\n",
    }
    for name, text in modules.items():
        (package / name).with_suffix(".py").write_text(text)
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.b"], ["pkg.sub.e", "pkg.sub.f"]]
