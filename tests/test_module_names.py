"""Every module the package's text names exists: module paths (``spatial/tokens/vit.py``, ``models/vit.TokenEmbedding``)
and dotted module names (``mpi4dl_nb.spatial.guard``, ``tokens.vit``) in the docstrings and comments of mpi4dl_nb/,
in README.md and in docs/ (issue 78: names that exist)."""

from __future__ import annotations

import ast
import io
import os
import re
import sys
import tokenize
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE_NAME = "mpi4dl_nb"
ROOT_FOLDERS = ("tests", "benchmarks", "engines", "notebooks", "docs")   # the repository's folders beside the package
SKIPPED_FOLDERS = ("__pycache__", "node_modules", "build", "dist")       # and hidden ones (.git, .venv), *.egg-info
SOURCE_SUFFIXES = ("py", "md", "ipynb", "toml", "sh", "sbatch")    # the repository's files a text names
DATA_SUFFIXES = ("json", "jsonl", "csv", "tsv", "txt", "yml", "yaml", "png", "svg", "jpg", "html", "log", "cfg", "ini",
                 "tif", "tiff", "svs", "ndpi", "mrxs", "npy", "npz", "pt", "pth", "safetensors", "h5", "zip", "gz",
                 "nii", "geojson", "xml", "lock", "bin")    # a run's outputs and data (``run/map.npy``): not checked
FILE_SUFFIXES = frozenset(SOURCE_SUFFIXES + DATA_SUFFIXES)
OTHER_PROJECTS = frozenset({"nn", "F", "np", "dl", "autograd", "torch", "torchvision", "timm", "mpi4py", "openslide",
                            "tifffile", "ipywidgets", "ipyparallel", "skimage", "scipy", "matplotlib", "PIL",
                            "safetensors", *sys.stdlib_module_names})   # dl: the facade, ``import mpi4dl_nb as dl``
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+", re.I)
# A name: slash-separated words, dot-separated words in the last one, maybe a closing slash; not inside a longer
# token (a URL's tail, timm.models.x, a glob such as bench_*.py, a placeholder such as tests.mpi.<program>).
NAME = re.compile(r"(?<![\w/.*<>{}$\\:-])((?:[\w-]+/)*[\w-]+(?:\.[\w-]+)*/?)(?![\w/*<>{}\\-]|\.\w)")
CODE_SPAN = re.compile(r"(`+)([^`\n]+?)\1")
CLASS_OF_A_MODULE = re.compile(r"[a-z][a-z0-9_]*\.[A-Z]\w*")      # window_roll.TokenExchange
# Names that stand for no file of this repository on purpose, each with its reason (keep it tiny).
NOT_OURS = {
    r"(notebooks/)?NN_name\.(py|ipynb)": "the tutorials' file name pattern (two digits, a name)",
    r"benchmark_(amoebanet|resnet)_sp\.py": "MPI4DL's own benchmark scripts (docs/batch-jobs.md compares them)",
    r"your_own_model\.py": "the script docs/your-own-model.md holds (written out under its <!-- script --> mark)",
}


@dataclass(frozen=True)
class Mention:
    """A name in some text: where (``path:line``) and whether it is a code span's whole content."""

    where: str
    name: str
    whole_span: bool = False


@dataclass
class Tree:
    """The repository's files and folders, found by any tail of their path (``windows/partition.py`` finds
    ``mpi4dl_nb/spatial/windows/partition.py``), and the package's modules by any tail of their dotted name."""

    root: Path
    package: str = PACKAGE_NAME
    by_tail: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    modules: dict[str, Path] = field(default_factory=dict)
    module_tails: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def __post_init__(self) -> None:
        self.package_folders = {self.package}
        for relative in walk(self.root):
            parts = relative.split("/")
            for start in range(len(parts)):
                self.by_tail["/".join(parts[start:])].append(relative)
            if relative.endswith(".py") and parts[0] in (self.package, "tests", "benchmarks"):
                self.add_module(parts)
            if parts[0] == self.package and parts[-1] == "__init__.py":
                self.package_folders.add(parts[-2])

    def add_module(self, parts: list[str]) -> None:
        names = parts[:-1] + ([] if parts[-1] == "__init__.py" else [parts[-1][:-3]])
        dotted = ".".join(names)
        self.modules[dotted] = self.root.joinpath(*parts)
        for start in range(len(names)):
            self.module_tails[".".join(names[start:])].append(dotted)

    def has_path(self, tail: str) -> bool:
        """Whether a file or folder ends with the path ``tail`` (a folder with or without its closing ``/``)."""
        name = tail.rstrip("/")
        return name in self.by_tail or name + "/" in self.by_tail

    def has_attribute(self, modules: Iterable[str], attribute: str) -> bool:
        """Whether one of ``modules`` has ``attribute``: a top-level name, a submodule, or any name through a
        module-level ``__getattr__``."""
        return any(f"{module}.{attribute}" in self.modules or {attribute, "*"} & top_level_names(self.modules[module])
                   for module in modules)


def walk(root: Path) -> Iterator[str]:
    """Every file and folder under ``root`` as a relative path, folders ending in ``/``, skipping hidden, cache and
    build folders."""
    for folder, folders, files in os.walk(root):
        folders[:] = sorted(name for name in folders if not name.startswith(".") and name not in SKIPPED_FOLDERS
                            and not name.endswith(".egg-info"))
        base = Path(folder).relative_to(root).as_posix()
        prefix = "" if base == "." else base + "/"
        for name in folders:
            yield f"{prefix}{name}/"
        for name in files:
            yield prefix + name


@cache
def top_level_names(path: Path) -> set[str]:
    """The names a module defines or imports at its top level (``*`` for one with a module ``__getattr__``)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name))
    return names | ({"*"} if "__getattr__" in names else set())


# ----------------------------------------------------------------- the texts
def comments_and_docstrings(source: str) -> Iterator[tuple[int, str]]:
    """(first line, text) of every comment and docstring of a Python source (a string standing as a statement), in
    the order of their lines."""
    found = [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT]
    found += [(node.lineno, node.value.value) for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Expr)
              and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)]
    yield from sorted(found)


def package_texts(root: Path) -> Iterator[tuple[str, int, str]]:
    """(path, first line, text) of the package's comments and docstrings, README.md and every page under docs/."""
    for path in sorted((root / PACKAGE_NAME).rglob("*.py")):
        if "__pycache__" not in path.parts:
            for line, text in comments_and_docstrings(path.read_text()):
                yield path.relative_to(root).as_posix(), line, text
    for path in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        yield path.relative_to(root).as_posix(), 1, path.read_text()


def mentions(where: str, first_line: int, text: str) -> Iterator[Mention]:
    """Every name of ``text`` (URLs left out), each with its line."""
    text = URL.sub(lambda url: " " * len(url.group(0)), text)
    spans = {match.start(2): match.group(2) for match in CODE_SPAN.finditer(text)}
    for match in NAME.finditer(text):
        line = first_line + text.count("\n", 0, match.start())
        whole = spans.get(match.start()) == match.group(1)
        yield Mention(f"{where}:{line}", match.group(1), whole)


# ----------------------------------------------------------------- what a name means
def is_module_name(mention: Mention, tree: Tree) -> bool:
    """Whether a name claims to be a module (or file) of this repository: a ``.py`` file; a slashed path from a
    package folder or a repository folder that names a source file, a folder (``/`` at its end), a module's
    attribute (``run/job.TrainJob``) or is a code span of its own; a dotted name from the package or one of its
    folders (``mpi4dl_nb.spatial.guard``, ``tokens.vit``); a lower-case name before a class (``window_roll.X``) that
    is no module of ours (then it is none) nor another project's."""
    name = mention.name
    if any(re.fullmatch(pattern, name) for pattern in NOT_OURS):
        return False
    head, *rest = re.split(r"[/.]", name.rstrip("/"))
    suffix = rest[-1] if rest and "." in name.rsplit("/", 1)[-1] else ""
    if suffix in FILE_SUFFIXES:
        if "/" not in name:
            return suffix == "py"          # a bare name: a module; FILE.toml, config.toml: the user's files
        return suffix in SOURCE_SUFFIXES and head in (*tree.package_folders, *ROOT_FOLDERS)
    if "/" in name:
        looks_like_a_file = bool(suffix) or name.endswith("/") or mention.whole_span
        return head in (*tree.package_folders, *ROOT_FOLDERS) and looks_like_a_file
    if head in (*tree.package_folders, "tests", "benchmarks"):
        return bool(rest)
    return (CLASS_OF_A_MODULE.match(name) is not None and head not in OTHER_PROJECTS
            and not tree.module_tails.get(head))


def exists(name: str, tree: Tree) -> bool:
    """Whether a module name resolves: a path by any tail of a repository path (a module path maybe followed by
    ``.attribute``), a dotted name by any tail of a module's dotted name, its next part an attribute of it."""
    if "/" in name or name.endswith(".py"):
        if tree.has_path(name):
            return True
        folder, _, last = name.rpartition("/")
        module, _, attribute = last.partition(".")
        stem = f"{folder}/{module}" if folder else module
        if not attribute or not (tree.has_path(stem + ".py") or tree.has_path(stem + "/__init__.py")):
            return False
        dotted = stem.replace("/", ".")
        return tree.has_attribute(tree.module_tails.get(dotted, []), attribute.split(".")[0])
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        modules = tree.module_tails.get(".".join(parts[:cut]), [])
        if modules:
            return cut == len(parts) or tree.has_attribute(modules, parts[cut])
    return False


def missing_names(texts: Iterable[tuple[str, int, str]], tree: Tree) -> list[str]:
    """``where: name`` of every module name in ``texts`` that does not exist."""
    return [f"{mention.where}: {mention.name}" for where, line, text in texts for mention in mentions(where, line, text)
            if is_module_name(mention, tree) and not exists(mention.name, tree)]


# ----------------------------------------------------------------- the checks
def test_every_module_name_in_the_package_text_exists() -> None:
    tree = Tree(REPO)
    missing = missing_names(package_texts(REPO), tree)
    assert not missing, ("names of modules (or their attributes) that do not exist; write the module's path as it "
                         "is now:\n" + "\n".join(missing))


def write_repo(root: Path, files: dict[str, str]) -> Tree:
    """A made-up repository of ``files`` (path: text) under ``root``, as a Tree."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return Tree(root)


def test_the_matcher_resolves_names_as_the_texts_mean_them_and_catches_a_wrong_one(tmp_path: Path) -> None:
    tree = write_repo(tmp_path, {
        "mpi4dl_nb/__init__.py": '"""Package."""\n',
        "mpi4dl_nb/spatial/__init__.py": "",
        "mpi4dl_nb/spatial/windows/__init__.py": "",
        "mpi4dl_nb/spatial/windows/plan.py": "class TileGather:\n    pass\n",
        "mpi4dl_nb/spatial/windows/swin.py": (
            '"""Sibling ``plan.py``, ``models/swin.py``, ``windows.plan.TileGather``, ``windows/plan.TileGather``,\n'
            "``mpi4dl_nb.spatial.windows``, ``spatial/windows/``, ``tests/test_x.py``, timm.models.swin_transformer,\n"
            "https://x.org/spatial/gone.py, nn.Linear, a pattern bench_*.py, ``notebooks/NN_name.ipynb``.\n"
            '\nWrong: ``spatial/windows/gone.py`` and ``windows.TileScatter``."""\n'
            "# and in a comment, ``window_roll.TokenExchange``\n"),
        "mpi4dl_nb/models/__init__.py": "",
        "mpi4dl_nb/models/swin.py": "",
        "tests/test_x.py": "",
        "README.md": "See `mpi4dl_nb/spatial/windows/swin.py` and `spatial/windows/`.\n",
        "docs/page.md": "`windows/plan.py`, `spatial/windows/plan.TileGather` and `spatial/old_name.py`\n",
    })
    texts = list(package_texts(tmp_path))
    assert missing_names(texts, tree) == [
        "mpi4dl_nb/spatial/windows/swin.py:5: spatial/windows/gone.py",
        "mpi4dl_nb/spatial/windows/swin.py:5: windows.TileScatter",
        "mpi4dl_nb/spatial/windows/swin.py:6: window_roll.TokenExchange",
        "docs/page.md:1: spatial/old_name.py"]


def test_prose_slashes_and_variables_are_no_module_names(tmp_path: Path) -> None:
    tree = write_repo(tmp_path, {"mpi4dl_nb/__init__.py": "", "mpi4dl_nb/run/__init__.py": "",
                                 "mpi4dl_nb/data/__init__.py": ""})
    text = ("checkpoint/resume, spatial/layer/pipeline parallelism, images/s, config.toml, run/map.npy, "
            "engine.train_step, settings.dtype, data.csv")
    found = [mention.name for mention in mentions("x", 1, text) if is_module_name(mention, tree)]
    assert found == []
    assert [m.name for m in mentions("x", 1, "``data.stain``") if is_module_name(m, tree)] == ["data.stain"]
    assert not exists("data.stain", tree) and exists("mpi4dl_nb.run", tree)
