"""The package's shape: the ``dl.`` facade survives importing every submodule, a small root, and the layers of
docs/architecture.md's ``## Package order``: no import from a layer above, no import cycle, every module in a layer."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import mpi4dl_nb
from tests.support.mpirun import REPO

PACKAGE = Path(mpi4dl_nb.__file__).resolve().parent
ARCHITECTURE = REPO / "docs" / "architecture.md"
FACADE = "facade"    # the layer of the package's __init__.py and __main__.py: the top
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


# ----------------------------------------------------------------- the package order
def package_order(text: str) -> list[str]:
    """The layers of the ``## Package order`` section's one ```text block, bottom first."""
    section = re.search(r"^## Package order\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, "docs/architecture.md has no '## Package order' section"
    blocks = re.findall(r"^```text\n(.*?)^```", section.group(1), re.S | re.M)
    assert len(blocks) == 1, f"'## Package order' needs exactly one ```text block, found {len(blocks)}"
    layers = [line.strip() for line in blocks[0].splitlines() if line.strip()]
    assert len(set(layers)) == len(layers), f"a layer listed twice: {layers}"
    assert layers and layers[-1] == FACADE, f"the last layer must be {FACADE!r} (the package's __init__ and __main__)"
    return layers


def layer_of(module: str, layers: Iterable[str]) -> str | None:
    """The listed layer of a dotted module name: its sub-package or root module, FACADE for the package's
    ``__init__`` and ``__main__``; None when no listed layer holds it."""
    parts = module.split(".")
    name = FACADE if parts[1:] in ([], ["__main__"]) else parts[1]
    return name if name in layers else None


# ----------------------------------------------------------------- import graph
@dataclass(frozen=True)
class Import:
    """One import statement's edge: ``module`` (``path`` from the package's folder, ``line``) imports ``target``."""

    module: str
    path: Path
    line: int
    target: str

    def where(self) -> str:
        return f"{self.path.as_posix()}:{self.line}"


def module_files(package_dir: Path) -> Iterator[tuple[str, Path]]:
    """(dotted module name, file) of every module under ``package_dir`` (packages by their __init__)."""
    base = package_dir.parent
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> list[str]:
    """The package modules one import statement names: ``from pkg import submodule`` means the submodule,
    ``from pkg import name`` the package itself (``from .. import x`` at the top: the package's __init__)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    source = node.module or ""
    if node.level:
        anchor = module.split(".")
        anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
        source = ".".join(anchor + ([node.module] if node.module else []))
    return [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names]


def package_imports(package_dir: Path) -> list[Import]:
    """Every import of a package module by another, wherever it stands: module level, in functions, under
    ``if TYPE_CHECKING:``."""
    modules = dict(module_files(package_dir))
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported_names(node, name, path.name == "__init__.py", set(modules)):
                    if target in modules and target != name:
                        found.append(Import(name, path.relative_to(package_dir.parent), node.lineno, target))
    return found


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports (every import statement, see ``package_imports``)."""
    graph: dict[str, set[str]] = {name: set() for name, _ in module_files(package_dir)}
    for edge in package_imports(package_dir):
        graph[edge.module].add(edge.target)
    return graph


def upward_imports(imports: Iterable[Import], layers: list[str]) -> list[str]:
    """One line per import from a layer above the importing module's own (modules in no layer are left out)."""
    problems = []
    for edge in imports:
        own, theirs = layer_of(edge.module, layers), layer_of(edge.target, layers)
        if own and theirs and layers.index(theirs) > layers.index(own):
            problems.append(f"{edge.where()}: {edge.module} (layer {own}) imports {edge.target} "
                            f"(layer {theirs}, above {own})")
    return problems


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


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


# ----------------------------------------------------------------- the rules, on mpi4dl_nb
def test_package_order_names_existing_layers():
    layers = package_order(ARCHITECTURE.read_text())
    missing = [layer for layer in layers[:-1]
               if not (PACKAGE / f"{layer}.py").is_file() and not (PACKAGE / layer / "__init__.py").is_file()]
    assert not missing, f"docs/architecture.md's package order lists layers that do not exist: {missing}"


def test_every_module_belongs_to_a_listed_layer():
    layers = package_order(ARCHITECTURE.read_text())
    orphans = [name for name, _ in module_files(PACKAGE) if layer_of(name, layers) is None]
    assert not orphans, (f"modules in no layer of docs/architecture.md's '## Package order': {orphans}; "
                         f"list their package there, in its place")


def test_no_module_imports_from_a_layer_above_its_own():
    layers = package_order(ARCHITECTURE.read_text())
    problems = upward_imports(package_imports(PACKAGE), layers)
    assert not problems, ("imports from a layer above (order: " + " < ".join(layers) + "):\n" + "\n".join(problems))


def test_no_import_cycle_among_package_modules():
    graph = import_graph(PACKAGE)
    assert len(graph) > 40 and graph["mpi4dl_nb.spatial.fused"] >= {"mpi4dl_nb.spatial.registry"}
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


def test_only_the_notebook_package_imports_it():
    notebook = f"{PACKAGE.name}.notebook"
    problems = [f"{edge.where()}: {edge.module} imports {edge.target}" for edge in package_imports(PACKAGE)
                if in_package(edge.target, notebook) and not in_package(edge.module, notebook)]
    assert not problems, "only mpi4dl_nb/notebook/ may import mpi4dl_nb.notebook:\n" + "\n".join(problems)


def test_inference_imports_neither_the_training_loop_nor_the_cli():
    above = (f"{PACKAGE.name}.run", f"{PACKAGE.name}.cli")
    problems = [f"{edge.where()}: {edge.module} imports {edge.target}" for edge in package_imports(PACKAGE)
                if in_package(edge.module, f"{PACKAGE.name}.infer") and any(in_package(edge.target, p) for p in above)]
    assert not problems, "mpi4dl_nb/infer/ imports the training loop or the CLI:\n" + "\n".join(problems)


def test_the_spatial_engine_reaches_the_attention_rooms_only_through_the_table():
    """docs/architecture.md's rooms: the modules directly in spatial/ (the engine) import spatial/tokens/ and
    spatial/windows/ only from families.py, the one table of conversions; the rooms build on the engine."""
    spatial = f"{PACKAGE.name}.spatial"
    rooms = (f"{spatial}.tokens", f"{spatial}.windows")
    table = f"{spatial}.families"
    problems = [f"{edge.where()}: {edge.module} imports {edge.target}" for edge in package_imports(PACKAGE)
                if edge.module.rpartition(".")[0] == spatial and edge.module != table
                and any(in_package(edge.target, room) for room in rooms)]
    assert not problems, "the spatial engine imports an attention room outside families.py:\n" + "\n".join(problems)
    assert any(edge.module == table and in_package(edge.target, rooms[0]) for edge in package_imports(PACKAGE))


# ----------------------------------------------------------------- the checker, on a made-up package
def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / "pkg"


def test_import_finder_sees_type_checking_function_level_and_relative_imports(tmp_path):
    pkg = write_package(tmp_path, {
        "pkg/__init__.py": "from .a import thing\n",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\nthing = 1\n",
        "pkg/c.py": "from pkg import a\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "def f():\n    from .. import a\n    import pkg as p\n    return a, p\n",
    })
    graph = import_graph(pkg)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.c"}, "pkg.c": {"pkg.a"}, "pkg.sub": set(),
                     "pkg.sub.b": {"pkg.a", "pkg"}}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.a"]]
    (pkg / "a.py").write_text("thing = 1\ndef g():\n    from .sub.b import f\n    return f\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import thing\n    return thing\n")
    (pkg / "c.py").write_text("")
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.sub.b", "pkg.a"]]


def test_layer_check_names_module_line_import_and_both_layers(tmp_path):
    pkg = write_package(tmp_path, {
        "pkg/__init__.py": "from .low import x\n",
        "pkg/low.py": "x = 1\ndef late():\n    from .high import run\n    return run\n",
        "pkg/high/__init__.py": "",
        "pkg/high/run.py": "from ..low import x\nimport pkg as dl\n",
        "pkg/stray.py": "",
    })
    layers = package_order("## Package order\n\n```text\nlow\nhigh\nfacade\n```\n\n## Next\n")
    assert layers == ["low", "high", FACADE]
    assert sorted(upward_imports(package_imports(pkg), layers)) == [
        "pkg/high/run.py:2: pkg.high.run (layer high) imports pkg (layer facade, above high)",
        "pkg/low.py:3: pkg.low (layer low) imports pkg.high.run (layer high, above low)"]
    assert [name for name, _ in module_files(pkg) if layer_of(name, layers) is None] == ["pkg.stray"]
