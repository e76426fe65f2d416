"""docs/architecture.md names every module file of the package (and none that is gone); the docs index
(docs/README.md) names every page of docs/ with a line and maps every sub-package; README stays short and points
to it."""

from __future__ import annotations

import re
from itertools import takewhile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "mpi4dl_nb"
ARCHITECTURE = REPO / "docs" / "architecture.md"
README = REPO / "README.md"
DOCS_INDEX = REPO / "docs" / "README.md"


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
    folder, a folder's files on lines of ``.py`` names (up to the first other word); deeper-indented lines
    continue the description above them."""
    folders: list[str] = []
    named: set[str] = set()
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
            files = takewhile(lambda word: word.endswith(".py"), line.split())
            named.update("/".join([*folders, file]) for file in files)
    return named


def test_named_files_reads_folders_and_continuations() -> None:
    tree = "pkg/\n  a.py      job\n            more.py words\n  sub/      folder\n    b.py    job\n  c.py d.py x e.py\n"
    assert named_files(tree) == {"pkg/a.py", "pkg/sub/b.py", "pkg/c.py", "pkg/d.py"}


def test_architecture_names_every_module_file() -> None:
    named = named_files(modules_tree(ARCHITECTURE.read_text()))
    files = module_files()
    missing = sorted(files - named)
    gone = sorted(named - files)
    assert not missing, ("docs/architecture.md's '## Modules' tree does not name these files; add each to its "
                         f"folder's lines of file names: {missing}")
    assert not gone, f"docs/architecture.md's '## Modules' tree names files that do not exist: {gone}"


def test_docs_index_maps_every_subpackage() -> None:
    table = re.search(r"^## Where things are\n(.*?)(?=^## |\Z)", DOCS_INDEX.read_text(), re.S | re.M)
    assert table, "docs/README.md has no '## Where things are' section"
    packages = sorted(f"`mpi4dl_nb/{p.name}/`" for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    missing = [name for name in packages if name not in table.group(1)]
    assert not missing, f"docs/README.md's 'Where things are' does not name {missing}"


def test_docs_index_links_every_page_once_with_a_line() -> None:
    text = DOCS_INDEX.read_text()
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md") if p.name != "README.md")
    rows = {name: re.findall(rf"^\| \[{re.escape(name)}\]\({re.escape(name)}\) \| \S.*\|$", text, re.M)
            for name in pages}
    wrong = [name for name, found in rows.items() if len(found) != 1]
    assert not wrong, f"docs/README.md needs one table row '| [page.md](page.md) | what it covers |' for {wrong}"


def test_readme_is_short_and_links_the_docs_index() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250, "README.md is the tour (at most 250 lines): the manual goes to docs/"
    assert "(docs/README.md)" in text and "make demo" in text and "make test" in text
