"""The groups of a folder of volumes a held-out split keeps whole: each volume's patient from ``patients.csv``, else
the volume alone.

``<datapath>/patients.csv`` (optional) has a header with the columns ``volume`` (a file name in ``images/``, with or
without its ending) and ``patient``, any order, separated by commas, semicolons or tabs; blank lines and lines
starting with ``#`` are skipped. When it is there every volume must be listed once: a split then holds out whole
patients. Without it each volume is its own group (a volume is the unit: its tiles are never split).
"""
from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigError
from .groups import GroupKind, Groups
from .volume_files import volume_stem

PATIENTS_FILE = "patients.csv"
COLUMNS = ("volume", "patient")
DELIMITERS = ",;\t"


def volume_groups(root: Path, files: Sequence[Path]) -> Groups:
    """The group of each of ``files`` (volumes of ``root/images``): patients from ``root/patients.csv`` when it
    exists, else each volume alone, named by its file stem. ConfigError naming the manifest and what is wrong."""
    stems = tuple(volume_stem(f) for f in files)
    manifest = root / PATIENTS_FILE
    if not manifest.is_file():
        return Groups(GroupKind.UNGROUPED, stems, stems)
    patients = read_patients(manifest)
    missing = [f.name for f, stem in zip(files, stems, strict=True) if stem not in patients]
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ConfigError("--datapath", f"{manifest} lists no patient for {len(missing)} of {len(files)} volumes "
                                        f"({shown}); give every volume of images/ a row (volume,patient)")
    return Groups(GroupKind.PATIENT, tuple(patients[s] for s in stems), stems)


def read_patients(manifest: Path) -> dict[str, str]:
    """Volume stem -> patient of a ``patients.csv``; ConfigError naming the line of a problem."""
    lines = [(n, text) for n, text in enumerate(manifest.read_text(encoding="utf-8-sig").splitlines(), start=1)
             if text.strip() and not text.lstrip().startswith("#")]
    if not lines:
        raise ConfigError("--datapath", f"{manifest} is empty; give a header volume,patient and a row per volume")
    header_line, header = lines[0]
    delimiter = next((d for d in DELIMITERS if d in header), ",")
    columns = [c.strip().lower() for c in next(csv.reader([header], delimiter=delimiter))]
    if any(c not in columns for c in COLUMNS):
        raise ConfigError("--datapath", f"{manifest} line {header_line}: the header {header.strip()!r} needs the "
                                        f"columns {','.join(COLUMNS)}")
    where = [columns.index(c) for c in COLUMNS]
    found: dict[str, str] = {}
    for number, text in lines[1:]:
        row = [v.strip() for v in next(csv.reader([text], delimiter=delimiter))]
        volume, patient = (row[i] if i < len(row) else "" for i in where)
        if not volume or not patient:
            raise ConfigError("--datapath", f"{manifest} line {number}: {text.strip()!r} needs a volume and a patient")
        stem = volume_stem(Path(volume))
        if stem in found:
            raise ConfigError("--datapath", f"{manifest} line {number}: volume {volume!r} is listed twice")
        found[stem] = patient
    return found
