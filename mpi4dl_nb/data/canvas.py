"""Whole-slide samples: each slide's tissue centred on one square canvas at the resolution read, read box by box.

A canvas of ``image_size`` pixels (at ``--mpp``, or the ``--slide-level`` as stored) is placed on the slide so that
the bounding box of its tissue (found once on the slide's coarsest level) sits in the middle: tissue larger than
the canvas is cut around its centre (the share cut is reported), smaller tissue is surrounded by the slide's own
glass, and any part of the canvas beyond the slide's edge is white background. ``read(i, box)`` reads only
``box`` of slide ``i``'s canvas from the slide file, so a spatial rank never holds more than its tile.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .dataset import Box, check_box, to_tensor
from .files import class_of, require_path
from .manifest import Cohort
from .pathology import Slide, coarse_tissue, open_slide, read_extent, resolved_pixels, slide_overview
from .resolution import LevelChoice, common_mpp, slide_choice
from .stain_reads import StainedReads

BACKGROUND = 255        # white: what a brightfield canvas shows beyond the slide's edge


@dataclass(frozen=True)
class CanvasPlacement:
    """Where one slide's canvas lies, in pixels of the resolution read, and what it holds of the tissue."""

    slide: str
    top: int                 # the canvas's first row on the slide (negative: it starts above the slide)
    left: int                # its first column
    size: int                # its side
    extent: tuple[int, int]  # the slide's (width, height) at the resolution read
    tissue: Box              # the tissue's bounding box (r0, r1, c0, c1) at that resolution
    tissue_share: float      # share of the canvas that is tissue
    cut_share: float         # share of the slide's tissue outside the canvas

    def source_box(self, box: Box) -> Box:
        """``box`` of the canvas as a box on the slide (may reach beyond its edges)."""
        r0, r1, c0, c1 = box
        return (self.top + r0, self.top + r1, self.left + c0, self.left + c1)

    def summary(self, mpp: float | None) -> str:
        """One line: the tissue's size, how much of the canvas it fills, how much of it is cut."""
        r0, r1, c0, c1 = self.tissue
        at = f" at {mpp:g} µm/px" if mpp is not None else ""
        return (f"{self.slide}: tissue {c1 - c0}x{r1 - r0} px{at} on a {self.size} px canvas, "
                f"{self.tissue_share:.0%} of it tissue, {self.cut_share:.0%} of the tissue cut")

    def to_dict(self) -> dict[str, object]:
        """What a checkpoint records of the canvas."""
        return {"slide": self.slide, "top": self.top, "left": self.left, "size": self.size,
                "extent": list(self.extent), "tissue": list(self.tissue), "tissue_share": self.tissue_share,
                "cut_share": self.cut_share}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> CanvasPlacement:
        """The placement ``to_dict`` stored; ValueError naming a bad field."""
        try:
            extent, tissue = data["extent"], data["tissue"]
            if not (isinstance(extent, list) and len(extent) == 2 and isinstance(tissue, list) and len(tissue) == 4):
                raise ValueError("extent or tissue of another length")
            return cls(str(data["slide"]), int(str(data["top"])), int(str(data["left"])), int(str(data["size"])),
                       (int(extent[0]), int(extent[1])), (int(tissue[0]), int(tissue[1]), int(tissue[2]),
                                                          int(tissue[3])),
                       float(str(data["tissue_share"])), float(str(data["cut_share"])))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"checkpoint record: a canvas {dict(data)!r} is not one ({err!r})") from None


def place_canvas(name: str, mask: np.ndarray, extent: tuple[int, int], size: int) -> CanvasPlacement:
    """The canvas of ``size`` pixels centred on the tissue ``mask`` marks (a coarse boolean image of the whole slide)
    on a slide of ``extent`` (width, height) pixels; ValueError naming the slide when it shows no tissue."""
    width, height = extent
    rows, cols = np.nonzero(mask)
    if rows.size == 0:
        raise ValueError(f"slide {name} shows no tissue at its coarsest level (no stained, non-black pixel); "
                         f"remove it from the cohort or check the scan")
    scale_r, scale_c = height / mask.shape[0], width / mask.shape[1]
    tissue = (int(math.floor(rows.min() * scale_r)), min(height, int(math.ceil((rows.max() + 1) * scale_r))),
              int(math.floor(cols.min() * scale_c)), min(width, int(math.ceil((cols.max() + 1) * scale_c))))
    top, left = (tissue[0] + tissue[1] - size) // 2, (tissue[2] + tissue[3] - size) // 2
    centre_r = (np.arange(mask.shape[0]) + 0.5) * scale_r          # each coarse pixel's centre at the read scale
    centre_c = (np.arange(mask.shape[1]) + 0.5) * scale_c
    inside = (((centre_r >= top) & (centre_r < top + size))[:, None]
              & ((centre_c >= left) & (centre_c < left + size))[None, :])
    total = int(mask.sum())
    kept = int((mask & inside).sum())
    return CanvasPlacement(name, top, left, size, extent, tissue,
                           tissue_share=min(1.0, kept * scale_r * scale_c / size ** 2),
                           cut_share=1.0 - kept / total)


class SlideCanvases(StainedReads):
    """One sample per slide: its tissue on a ``image_size`` canvas at the resolution ``mpp`` (or ``level``) reads.

    ``labels``: each slide's class (index into ``classes``); ``patients``: each slide's patient (None: the slide
    itself), the group a held-out split keeps on one side. ``opener`` opens a slide file (OpenSlide by default).
    ``tissue_channel``: each sample carries its tissue mask (1 on tissue, 0 elsewhere and beyond the slide) as a
    fourth channel (``--pool tissue-mean``), looked up in the slide's coarse mask pixel by pixel (any box alone).
    """

    def __init__(self, slides: Sequence[str | Path], labels: Sequence[int], classes: Sequence[str],
                 image_size: int, *, patients: Sequence[str] | None = None, level: int = 0,
                 mpp: float | None = None, source_mpp: float | None = None,
                 opener: Callable[[Path], Slide] = open_slide, tissue_channel: bool = False) -> None:
        if image_size < 1:
            raise ValueError(f"--image-size must be >= 1, got {image_size}")
        self.paths = [require_path(p, "--cohort") for p in slides]
        if not self.paths:
            raise FileNotFoundError("no slide given")
        if len(labels) != len(self.paths):
            raise ValueError(f"{len(labels)} labels for {len(self.paths)} slides; give one per slide")
        self.image_size = image_size
        self.tissue_channel = tissue_channel
        self.channels = 4 if tissue_channel else 3
        self.classes = list(classes)
        self.num_classes = len(self.classes)
        self.slide_labels = [int(v) for v in labels]
        self.names = [p.stem for p in self.paths]
        self.patients = list(patients) if patients is not None else list(self.names)
        self._opener = opener
        self._open: dict[int, Slide] = {}
        self.choices: list[LevelChoice] = []
        self.placements: list[CanvasPlacement] = []
        self.masks: list[np.ndarray] = []         # each slide's coarse tissue mask
        problems: list[str] = []
        for number, path in enumerate(self.paths):
            slide = self.slide(number)
            choice = slide_choice(slide, path, level, mpp, source_mpp)
            self.choices.append(choice)
            self.masks.append(coarse_tissue(slide))
            try:
                self.placements.append(place_canvas(self.names[number], self.masks[-1],
                                                    read_extent(slide, choice), image_size))
            except ValueError as err:
                problems.append(str(err))
        if problems:
            raise ValueError("; ".join(problems))
        self.mpp = common_mpp(c.mpp for c in self.choices)

    def slide(self, number: int) -> Slide:
        """The (lazily opened, cached) slide ``number``."""
        if number not in self._open:
            self._open[number] = self._opener(self.paths[number])
        return self._open[number]

    def __len__(self) -> int:
        return len(self.paths)

    def label(self, index: int) -> int:
        return self.slide_labels[index]

    def stain_pixels(self, index: int) -> np.ndarray:
        """A canvas's stain is its slide's, estimated from the slide's overview (as tiles of slides and inference)."""
        return slide_overview(self.slide(index))

    def read_pixels(self, index: int, box: Box | None = None) -> torch.Tensor:
        """``box`` of slide ``index``'s canvas (C, H, W) in [0, 1]: the slide's pixels where the canvas covers the
        slide, white beyond its edges."""
        box = check_box(box, self.image_size)
        placement = self.placements[index]
        r0, r1, c0, c1 = placement.source_box(box)
        width, height = placement.extent
        pixels = np.full((r1 - r0, c1 - c0, 3), BACKGROUND, dtype=np.uint8)
        inside = (max(r0, 0), min(r1, height), max(c0, 0), min(c1, width))
        if inside[0] < inside[1] and inside[2] < inside[3]:
            pixels[inside[0] - r0:inside[1] - r0, inside[2] - c0:inside[3] - c0] = resolved_pixels(
                self.slide(index), self.choices[index], inside)
        return to_tensor(pixels)

    def read(self, index: int, box: Box | None = None) -> torch.Tensor:
        """``box`` of slide ``index``'s canvas, stain normalised when asked, its tissue mask as a last channel when
        ``tissue_channel``."""
        image = super().read(index, box)
        if not self.tissue_channel:
            return image
        return torch.cat([image, self.tissue(index, box).to(image.dtype)[None]])

    def tissue(self, index: int, box: Box | None = None) -> torch.Tensor:
        """``box`` of slide ``index``'s canvas as its tissue mask (H, W), 1.0 on tissue: each pixel's coarse mask
        pixel (nearest), 0 beyond the slide's edges."""
        r0, r1, c0, c1 = self.placements[index].source_box(check_box(box, self.image_size))
        width, height = self.placements[index].extent
        mask = self.masks[index]
        rows, cols = np.arange(r0, r1), np.arange(c0, c1)
        on_r = (rows >= 0) & (rows < height)
        on_c = (cols >= 0) & (cols < width)
        pick_r = np.clip(rows * mask.shape[0] // height, 0, mask.shape[0] - 1)
        pick_c = np.clip(cols * mask.shape[1] // width, 0, mask.shape[1] - 1)
        found = mask[np.ix_(pick_r, pick_c)] & on_r[:, None] & on_c[None, :]
        return torch.from_numpy(found.astype(np.float32))

    def report(self) -> list[str]:
        """A line per slide: its tissue and canvas (printed before training)."""
        return [p.summary(c.mpp) for p, c in zip(self.placements, self.choices, strict=True)]

    def close(self) -> None:
        """Close every open slide."""
        for slide in self._open.values():
            slide.close()
        self._open.clear()


def cohort_canvases(cohort: Cohort, image_size: int, *, level: int = 0, mpp: float | None = None,
                    source_mpp: float | None = None, tissue_channel: bool = False) -> SlideCanvases:
    """The canvases of a cohort's slides, labelled and grouped by its manifest."""
    return SlideCanvases([s.path for s in cohort], cohort.labels, cohort.classes, image_size,
                         patients=[s.patient for s in cohort], level=level, mpp=mpp, source_mpp=source_mpp,
                         tissue_channel=tissue_channel)


def folder_canvases(root: Path, slides: Sequence[Path], image_size: int, *, classes: Sequence[str] | None = None,
                    level: int = 0, mpp: float | None = None, source_mpp: float | None = None,
                    tissue_channel: bool = False) -> SlideCanvases:
    """The canvases of ``slides`` in class folders below ``root`` (labels by folder, ``classes`` ordering them)."""
    labels, names = class_of(slides, root, classes)
    return SlideCanvases(slides, labels, names, image_size, level=level, mpp=mpp, source_mpp=source_mpp,
                         tissue_channel=tissue_channel)

