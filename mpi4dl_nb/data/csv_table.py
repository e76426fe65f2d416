"""The reader of the project's CSV manifests (a cohort's ``--cohort FILE.csv``, a volume folder's ``patients.csv``):
one delimiter rule, rows with their line numbers, a header that disagrees with its rows said once.

The header is the first line that is neither blank nor a ``#`` comment; its most frequent of comma, semicolon and
tab separates every line (a header without any: comma). Blank lines and lines starting with ``#`` are skipped; a
byte-order mark (spreadsheet exports) is ignored. Column names are matched case-insensitively; a reader may take
other tools' names for its columns (aliases, e.g. CLAM's ``slide_id`` for ``slide``), used when its own name is absent.
"""
from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

DELIMITERS = ",;\t"
SHOWN_LINES = 5     # lines named when the rows' delimiter differs from the header's; the rest counted


@dataclass(frozen=True)
class TableRow:
    """One data row: its line in the file (the first line is 1) and its cells by lower-cased column name."""

    line: int
    cells: dict[str, str]


@dataclass(frozen=True)
class CsvTable:
    """A manifest read: the header as written, where it is, its delimiter, the data rows in file order, and the
    columns read under another name (as written, the name they were read as)."""

    columns: tuple[str, ...]
    header_line: int
    delimiter: str
    rows: tuple[TableRow, ...]
    renamed: tuple[tuple[str, str], ...] = ()


def header_delimiter(header: str) -> str:
    """The delimiter of a manifest whose header is ``header``: its most frequent of ``DELIMITERS`` (ties: the
    first; none: comma)."""
    return max(DELIMITERS, key=header.count)


def read_table(path: Path, knob: str, required: Sequence[str], hint: str,
               aliases: Mapping[str, str] | None = None) -> CsvTable:
    """The manifest at ``path``, its header holding ``required`` (ConfigError(``knob``) naming what is missing,
    then ``hint``: the columns it takes); rows split by another delimiter than the header's are refused once.
    ``aliases`` (lower-case other name -> column): a column named so is read as that column when the header lacks
    it (the cells' keys renamed; ``renamed`` says which)."""
    lines = path.read_text(encoding="utf-8-sig").splitlines()
    numbered = [(n, text) for n, text in enumerate(lines, start=1) if text.strip() and not
                text.lstrip().startswith("#")]
    if not numbered:
        raise ConfigError(knob, f"{path} is empty; it needs a header line with the columns {','.join(required)}")
    (header_line, header), body = numbered[0], numbered[1:]
    delimiter = header_delimiter(header)
    columns = tuple(c.strip() for c in _cells(header, delimiter))
    keys, renamed = aliased_keys(columns, aliases or {})
    _check_header(path, knob, header_line, columns, keys, required, hint)
    _check_delimiters(path, knob, header_line, delimiter, columns, body)
    rows = []
    for number, text in body:
        cells = _cells(text, delimiter)
        rows.append(TableRow(number, {k: (cells[i].strip() if i < len(cells) else "") for i, k in enumerate(keys)}))
    return CsvTable(columns, header_line, delimiter, tuple(rows), renamed)


def aliased_keys(columns: Sequence[str], aliases: Mapping[str, str]) -> tuple[list[str], tuple[tuple[str, str], ...]]:
    """(each column's key: its lower-cased name, or the column an alias stands for when the header lacks that one;
    (name as written, key) of each renamed column)."""
    lowered = [c.lower() for c in columns]
    keys, renamed = [], []
    for written, name in zip(columns, lowered, strict=True):
        target = aliases.get(name)
        if target is not None and target not in lowered:
            keys.append(target)
            renamed.append((written, target))
        else:
            keys.append(name)
    return keys, tuple(renamed)


def _cells(text: str, delimiter: str) -> list[str]:
    return next(csv.reader([text], delimiter=delimiter), [])


def _check_header(path: Path, knob: str, line: int, columns: Sequence[str], lowered: Sequence[str],
                  required: Sequence[str], hint: str) -> None:
    missing = [c for c in required if c not in lowered]
    if missing:
        raise ConfigError(knob, f"{path} line {line}: the header ({', '.join(columns)}) lacks the column"
                                f"{'s' if len(missing) > 1 else ''} {', '.join(missing)}; {hint}")
    twice = sorted({c for c in lowered if lowered.count(c) > 1})
    if twice:
        raise ConfigError(knob, f"{path} line {line}: the header names {', '.join(twice)} more than once")


def _check_delimiters(path: Path, knob: str, header_line: int, delimiter: str, columns: Sequence[str],
                      body: Sequence[tuple[int, str]]) -> None:
    """Refuse rows that hold one cell by the header's delimiter but several by another (a header saved with
    semicolons above rows with commas): one message naming both delimiters and the lines."""
    if len(columns) < 2:
        return
    other: dict[str, list[int]] = {}
    for number, text in body:
        if len(_cells(text, delimiter)) > 1:
            continue
        found = next((d for d in DELIMITERS if d != delimiter and len(_cells(text, d)) > 1), None)
        if found is not None:
            other.setdefault(found, []).append(number)
    if not other:
        return
    used, lines = max(other.items(), key=lambda item: len(item[1]))
    shown = ", ".join(str(n) for n in lines[:SHOWN_LINES]) + (", ..." if len(lines) > SHOWN_LINES else "")
    raise ConfigError(knob, f"{path}: the header (line {header_line}) separates its columns with {_name(delimiter)} "
                            f"but {len(lines)} row{'s' if len(lines) > 1 else ''} (line{'s' if len(lines) > 1 else ''} "
                            f"{shown}) with {_name(used)}; use one delimiter on every line")


def _name(delimiter: str) -> str:
    return {",": "commas (,)", ";": "semicolons (;)", "\t": "tabs"}[delimiter]
