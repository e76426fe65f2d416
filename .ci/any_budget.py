"""The ``Any`` budget: ``Any`` tokens per 1,000 non-blank lines of each package of mpi4dl_nb/ and in total.

    python .ci/any_budget.py [PACKAGE_DIR] [--limit 0.3]

Counts every name token ``Any`` (annotations, ``typing.Any``, its imports; not comments or strings) with
``tokenize``, and every non-blank line of the ``.py`` files. A package is a sub-package of PACKAGE_DIR; the
modules at its root count together as ``(root)``. Exit code 1 when the total exceeds ``--limit`` per 1,000.
"""

from __future__ import annotations

import argparse
import sys
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PACKAGE = Path(__file__).resolve().parents[1] / "mpi4dl_nb"
DEFAULT_LIMIT = 0.30
ROOT = "(root)"


@dataclass(frozen=True)
class Count:
    """``Any`` tokens and non-blank lines of one package (or of everything)."""

    name: str
    anys: int
    lines: int

    @property
    def per_thousand(self) -> float:
        return 1000 * self.anys / self.lines if self.lines else 0.0


def any_tokens(path: Path) -> int:
    """Name tokens ``Any`` in one source file."""
    with tokenize.open(path) as source:
        return sum(1 for token in tokenize.generate_tokens(source.readline)
                   if token.type == tokenize.NAME and token.string == "Any")


def line_count(path: Path) -> int:
    """Non-blank lines of one source file."""
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())


def package_of(path: Path, package_dir: Path) -> str:
    parts = path.relative_to(package_dir).parts
    return parts[0] if len(parts) > 1 else ROOT


def counts(package_dir: Path) -> list[Count]:
    """One Count per package, by name, then the total (named after ``package_dir``)."""
    anys: dict[str, int] = {}
    lines: dict[str, int] = {}
    for path in sorted(package_dir.rglob("*.py")):
        name = package_of(path, package_dir)
        anys[name] = anys.get(name, 0) + any_tokens(path)
        lines[name] = lines.get(name, 0) + line_count(path)
    rows = [Count(name, anys[name], lines[name]) for name in sorted(anys)]
    return rows + [Count(package_dir.name, sum(anys.values()), sum(lines.values()))]


def table(rows: Sequence[Count], limit: float) -> str:
    head = f"{'package':<14}{'lines':>8}{'Any':>6}{'per 1,000':>11}"
    body = [f"{r.name:<14}{r.lines:>8}{r.anys:>6}{r.per_thousand:>11.2f}" for r in rows]
    total = rows[-1]
    verdict = "within" if total.per_thousand <= limit else "OVER"
    return "\n".join([head, *body[:-1], "-" * len(head), body[-1],
                      f"{verdict} the budget of {limit:g} Any per 1,000 non-blank lines"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", type=Path, default=DEFAULT_PACKAGE, help="package folder")
    parser.add_argument("--limit", type=float, default=DEFAULT_LIMIT, help="most Any per 1,000 non-blank lines, in all")
    args = parser.parse_args(argv)
    rows = counts(args.package)
    print(table(rows, args.limit))
    return 0 if rows[-1].per_thousand <= args.limit else 1


if __name__ == "__main__":
    sys.exit(main())
