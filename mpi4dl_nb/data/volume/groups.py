"""The groups of a folder of volumes a held-out split keeps whole: each volume's patient from ``patients.csv``, else
the volume alone.

``<datapath>/patients.csv`` (optional) has a header with the columns ``volume`` (a file name in ``images/``, with or
without its ending) and ``patient``, any order, read as every manifest is (data/csv_table.py: commas, semicolons
or tabs, the header decides; blank lines and ``#`` comments skipped). When it is there every volume must be listed
once: a split then holds out whole patients. Without it each volume is its own group (a volume is the unit: its
tiles are never split).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ...errors import ConfigError
from ..csv_table import read_table
from ..groups import GroupKind, Groups
from .files import volume_stem

PATIENTS_FILE = "patients.csv"
COLUMNS = ("volume", "patient")
KNOB = "--datapath"


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
        raise ConfigError(KNOB, f"{manifest} lists no patient for {len(missing)} of {len(files)} volumes "
                            f"({shown}); give every volume of images/ a row (volume,patient)")
    return Groups(GroupKind.PATIENT, tuple(patients[s] for s in stems), stems)


def read_patients(manifest: Path) -> dict[str, str]:
    """Volume stem -> patient of a ``patients.csv`` (read as every manifest is: data/csv_table.py); ConfigError
    naming the line of a problem."""
    table = read_table(manifest, KNOB, COLUMNS, f"give the columns {','.join(COLUMNS)} (any order)")
    found: dict[str, str] = {}
    for row in table.rows:
        volume, patient = (row.cells[c] for c in COLUMNS)
        if not volume or not patient:
            raise ConfigError(KNOB, f"{manifest} line {row.line}: a row needs a volume and a patient")
        stem = volume_stem(Path(volume))
        if stem in found:
            raise ConfigError(KNOB, f"{manifest} line {row.line}: volume {volume!r} is listed twice")
        found[stem] = patient
    return found
