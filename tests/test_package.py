"""The package's shape: the ``dl.`` facade survives importing every submodule, no import cycle, a small root."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import mpi4dl_nb
from tests.support.mpirun import REPO

PACKAGE = Path(mpi4dl_nb.__file__).resolve().parent
PUBLIC_CALLABLES = ("spatialize", "scatter_tiles", "gather_tiles", "HybridEngine",
                    "reduce_tile_gradients", "init", "layout", "TileGrid")

FACADE_PROBE = textwrap.dedent(f"""
    import importlib, pkgutil, types
    import mpi4dl_nb as dl

    early = {{name: getattr(dl, name) for name in dl.__all__}}     # cached before the imports
    imported = [info.name for info in pkgutil.walk_packages(dl.__path__, "mpi4dl_nb.")]
    for module in imported:
        importlib.import_module(module)
    problems = []
    for name in {PUBLIC_CALLABLES!r}:
        value = getattr(dl, name)
        if isinstance(value, types.ModuleType) or not callable(value) or value.__name__ != name:
            problems.append(f"dl.{{name}} is {{value!r}}")
    for name in dl.__all__:
        value = getattr(dl, name)
        if isinstance(value, types.ModuleType) or value is not early[name]:
            problems.append(f"dl.{{name}} changed to {{value!r}} after importing the submodules")
    print(len(imported), "modules imported")
    assert not problems, problems
""")


def test_facade_survives_importing_every_submodule():
    """In a fresh interpreter: import every submodule, then each public name is still the callable."""
    assert set(PUBLIC_CALLABLES) <= set(mpi4dl_nb.__all__)
    result = subprocess.run([sys.executable, "-c", FACADE_PROBE], capture_output=True, text=True,
                            cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    imported = int(result.stdout.split()[0])
    assert imported == len(list(module_files(PACKAGE))) - 1   # every module but the root itself


def test_package_root_has_at_most_12_modules():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 12, f"{len(root)} modules at the package root: {root}; move some into a subpackage"


# ----------------------------------------------------------------- import graph
def module_files(package_dir: Path) -> Iterator[tuple[str, Path]]:
    """(dotted module name, file) of every module under ``package_dir`` (packages by their __init__)."""
    base = package_dir.parent
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at module or function level, outside ``if TYPE_CHECKING:`` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and is_type_checking(node.test):
            for child in node.orelse:
                yield from runtime_imports(ast.Module(body=[child], type_ignores=[]))
        else:
            yield from runtime_imports(node)


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports (``from pkg import submodule`` means the submodule)."""
    modules = dict(module_files(package_dir))
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    anchor = name.split(".")
                    anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
                    source = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                           for alias in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> ... -> a) through each strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def connect(node: str) -> None:     # Tarjan
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [cycle_through(graph, set(component), component[0]) for component in components]


def cycle_through(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """Shortest path start -> ... -> start inside ``component`` (breadth first)."""
    paths = {nxt: [start, nxt] for nxt in sorted(graph[start] & component)}
    todo = list(paths)
    while start not in paths:
        node = todo.pop(0)
        for nxt in sorted(graph[node] & component):
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                todo.append(nxt)
    return paths[start]


def test_no_import_cycle_among_package_modules():
    graph = import_graph(PACKAGE)
    assert len(graph) > 40 and graph["mpi4dl_nb.spatial.fused"] >= {"mpi4dl_nb.spatial.registry"}
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


def test_cycle_finder_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import thing\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from .c import C\nthing = 1\n")
    (pkg / "c.py").write_text("from pkg import a\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n    return a\n")
    graph = import_graph(pkg)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": set(), "pkg.c": {"pkg.a"}, "pkg.sub": set(),
                     "pkg.sub.b": {"pkg.a"}}
    assert cycles(graph) == []
    (pkg / "a.py").write_text("thing = 1\ndef g():\n    from .sub.b import f\n    return f\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import thing\n    return thing\n")
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.sub.b", "pkg.a"]]

