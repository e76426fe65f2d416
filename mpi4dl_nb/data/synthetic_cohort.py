"""Synthetic cohorts: pyramidal slides with MPP whose label hangs on sparse structures a few µm wide, and their
manifest.

Each slide is glass with one elliptical piece of tissue (pink stroma with purple nuclei about 6 µm across, in
both classes). A ``positive`` slide also carries a few small clusters of ``structures``: dark dots about 2 µm
across, which an area average at 4 µm per pixel or coarser blurs into the stroma, while the nuclei stay visible:
what tells the classes apart is only seen at fine resolution. Patients alternate between the classes (all
slides of a patient share its label); slides are dealt to patients in turn.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .slide_writer import write_slide

CLASSES = ("negative", "positive")
GLASS = (238, 236, 240)
STROMA = (228, 160, 196)
NUCLEUS = (120, 70, 150)
STRUCTURE = (40, 20, 90)
NUCLEUS_UM, STRUCTURE_UM = 6.0, 2.0          # diameters


@dataclass(frozen=True)
class SyntheticSlide:
    """One written slide: its file, label, patient and the centres (row, column, level-0 px) of its structures."""

    path: Path
    label: str
    patient: str
    structures: tuple[tuple[int, int], ...]


def write_synthetic_cohort(folder: str | Path, *, slides: int = 6, patients: int | None = None,
                           side_um: float = 512.0, mpp: float = 0.5, clusters: int = 3, seed: int = 0,
                           levels: int = 4) -> tuple[Path, list[SyntheticSlide]]:
    """``slides`` slides of ``side_um`` µm squared at ``mpp`` µm per pixel (level 0) in ``folder``, with
    ``cohort.csv`` (slide, label, patient; ``patients`` default an even two thirds of the slides); (manifest path,
    the slides)."""
    if slides < 2:
        raise ValueError(f"a cohort needs at least 2 slides, got {slides}")
    count = patients if patients is not None else 2 * max(1, slides // 3)     # even: the classes balanced
    if not 2 <= count <= slides:
        raise ValueError(f"{count} patients for {slides} slides: give 2 <= patients <= slides")
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    size = int(round(side_um / mpp))
    written = []
    for number in range(slides):
        patient = number % count
        label = CLASSES[patient % 2]
        rng = np.random.default_rng([seed, number])
        image, centres = slide_image(rng, size, mpp, clusters if label == "positive" else 0)
        path = write_slide(root / f"slide-{number:02d}.tif", image, levels=levels, mpp=mpp, averaged=True)
        written.append(SyntheticSlide(path, label, f"patient-{patient:02d}", tuple(centres)))
    manifest = root / "cohort.csv"
    with manifest.open("w", newline="") as handle:
        table = csv.writer(handle)
        table.writerow(["slide", "label", "patient", "structures"])
        for slide in written:
            table.writerow([slide.path.name, slide.label, slide.patient, len(slide.structures)])
    return manifest, written


def slide_image(rng: np.random.Generator, size: int, mpp: float,
                clusters: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """One slide's level 0 (size x size RGB) and the centres of its structures (``clusters`` clusters of them)."""
    rows, cols = np.mgrid[0:size, 0:size].astype(np.float32)
    centre = rng.uniform(0.35, 0.65, 2) * size
    axes = rng.uniform(0.2, 0.33, 2) * size
    tissue = ((rows - centre[0]) / axes[0]) ** 2 + ((cols - centre[1]) / axes[1]) ** 2 <= 1.0
    image = np.empty((size, size, 3), dtype=np.float32)
    image[:] = GLASS
    image[tissue] = STROMA
    image += rng.normal(0.0, 6.0, image.shape).astype(np.float32) * tissue[:, :, None]
    inside = np.argwhere(tissue)
    nuclei = inside[rng.choice(len(inside), size=max(1, int(tissue.sum() * mpp ** 2 / 400.0)))]
    stamp(image, nuclei, NUCLEUS_UM / mpp / 2.0, NUCLEUS)
    centres: list[tuple[int, int]] = []
    for _ in range(clusters):
        seed_point = inside[rng.integers(len(inside))]
        spread = rng.normal(0.0, 8.0 / mpp, (8, 2))
        points = np.clip(np.rint(seed_point + spread), 0, size - 1).astype(np.int64)
        points = points[tissue[points[:, 0], points[:, 1]]]
        stamp(image, points, STRUCTURE_UM / mpp / 2.0, STRUCTURE)
        centres += [(int(r), int(c)) for r, c in points]
    return np.clip(np.rint(image), 0, 255).astype(np.uint8), centres


def stamp(image: np.ndarray, centres: np.ndarray, radius: float, colour: tuple[int, int, int]) -> None:
    """Paint discs of ``radius`` pixels at ``centres`` (row, column) in ``colour``."""
    reach = int(np.ceil(radius))
    offsets = np.mgrid[-reach:reach + 1, -reach:reach + 1].reshape(2, -1).T
    disc = offsets[(offsets ** 2).sum(axis=1) <= max(radius, 0.5) ** 2]
    for r, c in centres:
        at = disc + (r, c)
        keep = (at[:, 0] >= 0) & (at[:, 0] < image.shape[0]) & (at[:, 1] >= 0) & (at[:, 1] < image.shape[1])
        image[at[keep, 0], at[keep, 1]] = colour
