"""The tutorial notebooks: each ``notebooks/NN_name.ipynb`` built deterministically from its jupytext source.

The percent-format ``NN_name.py`` is the source (linted, reviewed, paired with the ``.ipynb`` by
``notebooks/jupytext.toml``). The ``.ipynb`` is written from it with no outputs or execution counts,
cell ids ``"0", "1", ...`` (the ids nbstripout gives, so its git filter leaves a built notebook as it
is), the project's kernelspec and nothing else in the metadata: a rebuild changes no byte that the
source did not change. A notebook edited after its source (cells the ``.py`` lacks) is not overwritten.

``python -m mpi4dl_nb.notebook.tutorials [DIRECTORY] [--check]`` (``make notebooks``)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DIRECTORY = Path(__file__).resolve().parents[2] / "notebooks"   # the checkout's notebooks/
KERNELSPEC = {"name": "mpi4dl-nb", "display_name": "Python (mpi4dl-nb)", "language": "python"}
SOURCE_FORMAT = "py:percent"
# Notebook metadata that a JupyterLab save adds and no source carries; the nbstripout git filter is told to
# strip it too (`git config filter.nbstripout.extrakeys "metadata.language_info metadata.jupytext"`).
GIT_FILTER_EXTRA_KEYS = ("metadata.language_info", "metadata.jupytext")


class NotebookEdited(RuntimeError):
    """Notebooks hold cell edits that their ``.py`` sources lack; building would lose them."""

    def __init__(self, paths: list[Path]) -> None:
        names = ", ".join(str(path) for path in paths)
        super().__init__(
            f"{names}: edited after the .py source and its cells differ from it, so a rebuild would lose those "
            "edits. Carry them into the source with `jupytext --sync NOTEBOOK` (the newer file wins), or delete "
            "the .ipynb to drop them; then rebuild.")
        self.paths = paths


def sources(directory: Path = DIRECTORY) -> list[Path]:
    """The tutorial sources ``NN_name.py`` in ``directory``, in order."""
    return sorted(directory.glob("[0-9][0-9]_*.py"))


def notebook_path(source: Path) -> Path:
    """The ``.ipynb`` built from ``source``."""
    return source.with_suffix(".ipynb")


def render(source: Path) -> str:
    """The exact ``.ipynb`` text built from ``source``."""
    import jupytext
    import nbformat
    from jupytext.config import load_jupytext_config

    notebook = jupytext.read(source, fmt=SOURCE_FORMAT, config=load_jupytext_config(str(source)))
    notebook.nbformat, notebook.nbformat_minor = 4, 5
    notebook.metadata = nbformat.from_dict({"kernelspec": KERNELSPEC})
    for index, cell in enumerate(notebook.cells):
        cell.id = str(index)
        cell.metadata = nbformat.from_dict({})
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nbformat.validate(notebook)
    return nbformat.writes(notebook) + "\n"      # nbformat.write's file layout, trailing newline included


def cell_sources(notebook_text: str) -> list[tuple[str, str]]:
    """``(cell type, source)`` of every cell: what a notebook teaches, without outputs, ids or metadata."""
    import nbformat

    return [(cell.cell_type, cell.source) for cell in nbformat.reads(notebook_text, as_version=4).cells]


def out_of_date(directory: Path = DIRECTORY) -> list[tuple[Path, str]]:
    """``(notebook, built text)`` of every notebook that is missing or differs from the build of its source."""
    built = [(notebook_path(source), render(source)) for source in sources(directory)]
    return [(path, text) for path, text in built if not path.exists() or path.read_text(encoding="utf-8") != text]


def edited_after_source(path: Path, text: str) -> bool:
    """True if notebook ``path`` is newer than its source and its cells differ from ``text``, the source's build."""
    if not path.exists() or path.stat().st_mtime <= path.with_suffix(".py").stat().st_mtime:
        return False
    return cell_sources(path.read_text(encoding="utf-8")) != cell_sources(text)


def orphans(directory: Path = DIRECTORY) -> list[Path]:
    """Tutorial notebooks without a ``.py`` source."""
    return [path for path in sorted(directory.glob("[0-9][0-9]_*.ipynb")) if not path.with_suffix(".py").exists()]


def build(directory: Path = DIRECTORY) -> list[Path]:
    """Write every notebook that is not the build of its source; returns those written.

    Raises ``NotebookEdited`` (writing nothing) if a notebook holds cell edits made after its source.
    """
    pending = out_of_date(directory)
    edited = [path for path, text in pending if edited_after_source(path, text)]
    if edited:
        raise NotebookEdited(edited)
    for path, text in pending:
        path.write_text(text, encoding="utf-8", newline="\n")
    return [path for path, _ in pending]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", type=Path, default=DIRECTORY)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a notebook is not its build")
    args = parser.parse_args(argv)
    if not sources(args.directory):
        parser.error(f"no NN_name.py notebook sources in {args.directory}")
    for path in orphans(args.directory):
        print(f"{path}: no {path.with_suffix('.py').name} source", file=sys.stderr)
    if args.check:
        stale = [path for path, _ in out_of_date(args.directory)]
        for path in stale:
            print(f"{path}: not the build of its .py source (run `make notebooks`)", file=sys.stderr)
        return 1 if stale or orphans(args.directory) else 0
    try:
        written = build(args.directory)
    except NotebookEdited as err:
        print(err, file=sys.stderr)
        return 1
    for path in written:
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
