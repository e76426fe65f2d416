"""The venv ``benchmarks/gpu_check.sh --wheels`` installs into on a GPU node: it sees the packages of the python that
makes it (the image's torch), also when that python is itself a venv's, whose packages a venv made from it would not
see (``--system-site-packages`` reaches only the base interpreter's): a ``.pth`` file adds them, after its own.

``python3 -m benchmarks.support.node_venv VENV`` makes VENV (no pip of its own: the maker's is visible in it).
"""

from __future__ import annotations

import argparse
import site
import subprocess
import venv
from collections.abc import Sequence
from pathlib import Path

PTH_NAME = "gpu_check_outer_site.pth"


def venv_python(path: Path) -> Path:
    """The interpreter of the venv at ``path``."""
    return path / "bin" / "python"


def _ask(python: Path, code: str) -> list[str]:
    """The lines ``code`` prints when ``python`` runs it."""
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()


def make_venv(path: Path) -> list[str]:
    """Create the venv at ``path`` with this interpreter's packages visible in it; returns the site-packages folders a
    ``.pth`` in it had to add (none when this interpreter is no venv's)."""
    # symlinks as `python3 -m venv` makes them: a copied interpreter may not find its libpython
    venv.EnvBuilder(system_site_packages=True, with_pip=False, symlinks=True).create(path)
    python = venv_python(path)
    seen = set(_ask(python, "import sys; print('\\n'.join(sys.path))"))
    missing = [folder for folder in site.getsitepackages() if folder not in seen and Path(folder).is_dir()]
    if missing:
        own = Path(_ask(python, "import site; print(site.getsitepackages()[0])")[0])
        # an "import" line of a .pth runs: addsitedir also reads the outer folder's own .pth files
        (own / PTH_NAME).write_text("".join(f"import site; site.addsitedir({folder!r})\n" for folder in missing))
    return missing


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("venv", type=Path, help="the venv to make (must not exist)")
    args = parser.parse_args(argv)
    if args.venv.exists():
        parser.error(f"{args.venv} exists: give a new folder, or use that venv as it is")
    added = make_venv(args.venv)
    shown = ", ".join(added) if added else "none needed"
    print(f"node_venv: made {args.venv}; the maker's site-packages added by {PTH_NAME}: {shown}")


if __name__ == "__main__":
    main()
