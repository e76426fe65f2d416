"""Names mean one thing across the package: no two modules define a class or a public top-level function of the
same name (importing one to re-export it is not a second definition), and one function is named ``agreed``
(comm/agreement.py's)."""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "mpi4dl_nb"
ONE_OF_A_KIND = ("agreed",)     # functions of which the package holds exactly one
# Top-level function names more than one module may define, each module's own:
ALLOWED_TWICE = ("main",)       # a command module's entry point (python -m mpi4dl_nb.<module>)


def sources() -> dict[str, str]:
    """Every module of the package by its path under the repository."""
    return {path.relative_to(REPO).as_posix(): path.read_text()
            for path in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in path.parts}


def class_homes(modules: dict[str, str]) -> dict[str, list[str]]:
    """Class name -> the modules that define it (module level: ``class X``, not ``from m import X``)."""
    homes: dict[str, list[str]] = defaultdict(list)
    for path, text in modules.items():
        for node in ast.parse(text, path).body:
            if isinstance(node, ast.ClassDef):
                homes[node.name].append(path)
    return homes


def function_homes(modules: dict[str, str]) -> dict[str, list[str]]:
    """Public top-level function name -> the modules that define it (``def f`` at module level; names starting
    with ``_`` are a module's own and may repeat)."""
    homes: dict[str, list[str]] = defaultdict(list)
    for path, text in modules.items():
        for node in ast.parse(text, path).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_") \
                    and path not in homes[node.name]:        # a module's typing.overload variants are one function
                homes[node.name].append(path)
    return homes


def shared(homes: dict[str, list[str]]) -> dict[str, list[str]]:
    """The names defined in more than one module."""
    return {name: paths for name, paths in sorted(homes.items()) if len(paths) > 1}


def functions_named(modules: dict[str, str], names: Iterable[str]) -> dict[str, list[str]]:
    """For each of ``names``, ``path:line`` of every function or method of that name (any depth)."""
    wanted = set(names)
    found: dict[str, list[str]] = {name: [] for name in wanted}
    for path, text in modules.items():
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in wanted:
                found[node.name].append(f"{path}:{node.lineno}")
    return found


def test_the_checks_see_a_clash_and_let_a_reexport_pass() -> None:
    modules = {"pkg/a.py": "class Region:\n    pass\n\ndef agreed():\n    pass\n",
               "pkg/b.py": "class Region:\n    x = 1\n",
               "pkg/c.py": "from .a import Region\n\nclass Other:\n    def agreed(self):\n        pass\n"}
    assert shared(class_homes(modules)) == {"Region": ["pkg/a.py", "pkg/b.py"]}
    assert shared(class_homes({k: v for k, v in modules.items() if k != "pkg/b.py"})) == {}
    assert functions_named(modules, ["agreed"]) == {"agreed": ["pkg/a.py:4", "pkg/c.py:4"]}
    functions = {"pkg/a.py": "def read(x):\n    pass\n\ndef _step():\n    pass\n",
                 "pkg/b.py": "from .a import read\n\ndef _step():\n    pass\n\nclass C:\n    def read(self):\n"
                             "        pass\n",
                 "pkg/c.py": "def read(path):\n    pass\n"}
    assert shared(function_homes(functions)) == {"read": ["pkg/a.py", "pkg/c.py"]}    # not methods, imports, _own


def test_no_two_modules_define_a_function_of_the_same_name() -> None:
    """One name, one meaning: two top-level functions of one name in different modules are renamed to say what
    each is (or folded into one when they mean the same), but for ``ALLOWED_TWICE``."""
    clashes = {name: paths for name, paths in shared(function_homes(sources())).items() if name not in ALLOWED_TWICE}
    assert not clashes, ("functions of the same name in different modules (rename one to say what it is, or keep "
                         "one): " + "; ".join(f"{name}: {', '.join(paths)}" for name, paths in clashes.items()))


def test_no_two_modules_define_a_class_of_the_same_name() -> None:
    clashes = shared(class_homes(sources()))
    assert not clashes, ("classes of the same name in different modules (rename one to say what it is, or import "
                         "it from the other): " + "; ".join(f"{name}: {', '.join(paths)}"
                                                            for name, paths in clashes.items()))


def test_one_rank_agreement_helper() -> None:
    for name, places in functions_named(sources(), ONE_OF_A_KIND).items():
        assert len(places) == 1, f"{len(places)} functions named {name!r} ({', '.join(places)}); keep one"
