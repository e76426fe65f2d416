"""docs/architecture.md names every module file of the package (and none that is gone); README's map names
every sub-package and every page of docs/."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "mpi4dl_nb"
ARCHITECTURE = REPO / "docs" / "architecture.md"
README = REPO / "README.md"


def module_files() -> set[str]:
    """Every ``.py`` file of the package, as ``mpi4dl_nb/...`` paths."""
    return {path.relative_to(REPO).as_posix() for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts}


def modules_tree(text: str) -> str:
    """The fenced block of the ``## Modules`` section."""
    section = re.search(r"^## Modules\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, "docs/architecture.md has no '## Modules' section"
    block = re.search(r"^```text\n(.*?)^```", section.group(1), re.S | re.M)
    assert block, "'## Modules' needs a ```text block: the package's tree, one file per line"
    return block.group(1)


def named_files(tree: str) -> set[str]:
    """The file paths a tree names: folders end in ``/``, each level indented two spaces more than its
    folder; deeper-indented lines continue the description above them."""
    folders: list[str] = []
    named = set()
    for line in tree.splitlines():
        match = re.match(r"( *)(\S+)", line)
        if match is None:
            continue
        indent, name = len(match.group(1)), match.group(2)
        level = indent // 2
        if indent % 2 or level > len(folders) or not (name.endswith("/") or name.endswith(".py")):
            continue                      # a description's continuation line
        del folders[level:]
        if name.endswith("/"):
            folders.append(name[:-1])
        else:
            named.add("/".join([*folders, name]))
    return named


def test_named_files_reads_folders_and_continuations() -> None:
    tree = "pkg/\n  a.py      job\n            more.py words\n  sub/      folder\n    b.py    job\n  c.py\n"
    assert named_files(tree) == {"pkg/a.py", "pkg/sub/b.py", "pkg/c.py"}


def test_architecture_names_every_module_file() -> None:
    named = named_files(modules_tree(ARCHITECTURE.read_text()))
    files = module_files()
    missing = sorted(files - named)
    gone = sorted(named - files)
    assert not missing, ("docs/architecture.md's '## Modules' tree does not name these files; add each under "
                         f"its folder with its one-line job (its docstring's first line): {missing}")
    assert not gone, f"docs/architecture.md's '## Modules' tree names files that do not exist: {gone}"


def test_readme_map_names_every_subpackage_and_doc() -> None:
    table = re.search(r"^## Where things are\n(.*?)(?=^## |\Z)", README.read_text(), re.S | re.M)
    assert table, "README.md has no '## Where things are' section"
    packages = sorted(f"`mpi4dl_nb/{p.name}/`" for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    docs = sorted(f"`{p.name}`" for p in (REPO / "docs").glob("*.md"))
    missing = [name for name in packages + docs if name not in table.group(1)]
    assert not missing, f"README's 'Where things are' does not name {missing}"
