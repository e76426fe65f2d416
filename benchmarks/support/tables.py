"""Tables printed two ways: Markdown (BENCHMARKS.md) and plain aligned columns (a terminal)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Table:
    """Columns with a header each (``>`` before a header aligns it right); rows of already formatted cells."""

    columns: Sequence[str]
    rows: list[list[str]] = field(default_factory=list)

    @property
    def headers(self) -> list[str]:
        return [c.removeprefix(">") for c in self.columns]

    @property
    def right(self) -> list[bool]:
        return [c.startswith(">") for c in self.columns]

    def add(self, *cells: object) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{len(cells)} cells for {len(self.columns)} columns")
        self.rows.append([str(c) for c in cells])

    def markdown(self) -> str:
        rule = ["---:" if r else "---" for r in self.right]
        return "\n".join("| " + " | ".join(cells) + " |" for cells in [self.headers, rule, *self.rows])

    def plain(self) -> str:
        widths = [max(len(row[i]) for row in [self.headers, *self.rows]) for i in range(len(self.columns))]

        def line(cells: list[str]) -> str:
            return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, self.right)).rstrip()
        return "\n".join([line(self.headers), "  ".join("-" * w for w in widths), *map(line, self.rows)])

    def text(self, markdown: bool = True) -> str:
        return self.markdown() if markdown else self.plain()
