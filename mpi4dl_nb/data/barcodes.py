"""TCGA barcodes: the patient a slide's name belongs to (its barcode's first 12 characters, ``TCGA-A1-A0SB``)."""
from __future__ import annotations

import re
from collections.abc import Sequence

# TCGA-<tissue source site>-<participant>, then the sample, portion, ... parts a slide's name carries
PATIENT = re.compile(r"(TCGA-[A-Za-z0-9]{2}-[A-Za-z0-9]{4})(?:[-_.]|$)")
ORIGIN = "from TCGA barcodes"     # what a split printed says of patients read from slide names


def tcga_patient(name: str) -> str | None:
    """The patient barcode ``name`` starts with (``TCGA-A1-A0SB-01Z-00-DX1`` -> ``TCGA-A1-A0SB``); None: no TCGA
    barcode."""
    match = PATIENT.match(name)
    return match.group(1) if match is not None else None


def tcga_patients(slides: Sequence[str]) -> tuple[str, ...] | None:
    """The patient of each slide when every slide's name is a TCGA barcode (None otherwise)."""
    found = [tcga_patient(name) for name in slides]
    if not found or any(patient is None for patient in found):
        return None
    return tuple(patient for patient in found if patient is not None)
