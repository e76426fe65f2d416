"""InferJob: everything ``infer`` is asked to do (its fields name the flags and ``dl.infer``'s keywords), its kind
(one slide, a cohort, slide-level, a volume) and its checks before any work: of the flags alone, then against the
checkpoint's record and the slides (CheckedInfer)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field
from enum import Enum
from pathlib import Path

import torch

from ..checkpoint.files import CheckpointChoice
from ..checkpoint.record import RunRecord, read_checkpoint
from ..comm.device import DeviceChoice
from ..config import DTYPE, NUM_SPATIAL_PARTS, PROGRESS, SLICE_METHOD, Choice, ConfigError
from ..config import DTYPES as DTYPES
from ..data.options import COHORT, MIN_TISSUE, SLIDE_LEVEL, STAIN_NORMALIZE, TASK, TISSUE
from ..data.resolution import ResolutionChoice
from ..data.task import Task
from ..data.tissue_mask import TissueMethod
from ..models.options import MODEL
from ..schema import Bounds, FlagField, build_job, check_bounds, flag, flag_fields, nested, tagged
from ..spatial.geometry import TileGrid
from .outputs.kinds import HELP as OUTPUT_HELP
from .outputs.kinds import OutputSpec, check_folders, check_outputs, parse_outputs, summary_folder
from .outputs.slide_level import check_output_folder
from .outputs.volume import VolumeOutputs
from .slide_list import SlideSource, slide_sources
from .tile_map import MapMode
from .trained import refuse_volume_classifier
from .volume import volume_grid, window_sides

DEFAULT_BUDGET = 1 << 30          # bytes per rank for one window when --window is not given
OVERLAY_SIDE = 1600
VOLUME_WINDOW = 64                # a volume's input voxels per rank and axis when --window is not given
SUMMARY_NAME = "summary.csv"      # a cohort's summary table, beside its outputs unless --summary names it
SOURCE, WINDOWS, MAPS, NETWORK = "what to run on", "windows", "outputs", "network"
SOURCE_FLAGS = ("--slide", "--slides", "--cohort", "--volume")



class Applies(Enum):
    """What an infer flag applies to (its field's tags): a kind of run that lacks it refuses the flag when given."""

    WINDOW_MAPS = "window-by-window maps"      # not a whole-slide model's one prediction per canvas
    SLIDES = "slides"                          # not a volume


MAPS_OF_SLIDES = (Applies.WINDOW_MAPS, Applies.SLIDES)


def as_text(value: object) -> object:
    """A keyword's value with paths as text (a Path, or a list of them), as the flags give them."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)) and any(isinstance(item, os.PathLike) for item in value):
        return [as_text(item) for item in value]
    return value


class InferKind(Choice):
    """What an ``infer`` run does, from its flags and (slide-level) its checkpoint."""

    SLIDE = "slide"                  # --slide: one slide's maps, window by window
    COHORT = "cohort"                # --slides / --cohort: every slide's maps and a summary table
    SLIDE_LEVEL = "slide-level"      # a `train --whole-slide` checkpoint: one prediction per slide from its canvas
    VOLUME = "volume"                # --volume: a 3-D segmentation network's label and probability volumes


def window_value(text: str) -> int | tuple[int, int, int]:
    """``--window N`` or a volume's ``D,H,W``."""
    try:
        sides = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError("give N or D,H,W (whole numbers)") from None
    if len(sides) == 1:
        return sides[0]
    if len(sides) != 3:
        raise ValueError("give N or D,H,W")
    return sides[0], sides[1], sides[2]


@dataclass(frozen=True)
class InferJob:
    """Everything ``infer`` is asked to do: the command's flags, ``dl.infer``'s keywords (named like the flags)."""

    checkpoint: CheckpointChoice
    outputs: tuple[str, ...] = flag("--output", f"repeat for several; {OUTPUT_HELP}", repeat=True, group=MAPS)
    slide: str | None = flag("--slide", "anything OpenSlide opens, or a plain image", None, group=SOURCE)
    slides: str | None = flag(
        "--slides", "many slides: a folder of slide files, a text file with one path per line, slide files separated "
                    "by commas, or a cohort manifest FILE.csv (as --cohort); every --output then names one file per "
                    "slide with {slide} (a whole-slide model: --output DIR)", None, group=SOURCE)
    volume: str | None = flag(
        "--volume", "a volume (multi-page TIFF stack or NIfTI .nii/.nii.gz) for a 3-D segmentation network (--model "
                    "unet3d): --output NAME.tif|.nii|.nii.gz is its label volume, NAME_prob<k> each class' "
                    "probabilities (float32), with the input's voxel size; --slice-method DxRxC, --window N or D,H,W",
        None, group=SOURCE)
    cohort: str | None = COHORT.field(None, group=SOURCE)
    summary: str | None = flag("--summary", "with --slides: the summary table (CSV; default summary.csv beside the "
                                            "outputs)", None, group=SOURCE, tags=(Applies.WINDOW_MAPS,))
    resolution: ResolutionChoice = nested(ResolutionChoice, tags=(Applies.SLIDES,))
    slide_level: int | None = SLIDE_LEVEL.field(None, default_text="0, or the level of the checkpoint's training MPP",
                                                group="resolution", tags=(Applies.SLIDES,))
    num_spatial_parts: int = NUM_SPATIAL_PARTS.field(1, group=WINDOWS)
    slice_method: str = SLICE_METHOD.field("square", group=WINDOWS)
    window: int | tuple[int, int, int] | None = flag(
        "--window", f"input pixels per rank and axis per pass (default: from --memory-budget); a volume: N or D,H,W "
                    f"voxels per rank (default {VOLUME_WINDOW})", None, parse=window_value, bounds=Bounds(1),
        group=WINDOWS, tags=(Applies.WINDOW_MAPS,))
    memory_budget: int = flag("--memory-budget", "bytes per rank one window may take when --window is not given",
                              DEFAULT_BUDGET, parse=int, bounds=Bounds(1), group=WINDOWS, tags=MAPS_OF_SLIDES)
    batch_windows: int = flag("--batch-windows", "windows of equal size per forward", 1, parse=int, bounds=Bounds(1),
                              group=WINDOWS, tags=MAPS_OF_SLIDES)
    max_window_rows: int | None = flag("--max-window-rows", "stop after this many window rows (continue later with "
                                                            "--resume-outputs)", None, parse=int, bounds=Bounds(1),
                                       group=WINDOWS, tags=MAPS_OF_SLIDES)
    tissue_only: bool = flag("--tissue-only", "skip windows without tissue (judged on a low-resolution overview); "
                                              "their cells are NaN", False, switch=True, group=WINDOWS,
                             tags=MAPS_OF_SLIDES)
    min_tissue: float = MIN_TISSUE.field(0.0, group=WINDOWS, tags=MAPS_OF_SLIDES)
    tissue: TissueMethod = TISSUE.field(TissueMethod.SATURATION, group=WINDOWS, tags=MAPS_OF_SLIDES)
    resume: bool = flag("--resume-outputs", "continue partial outputs from their last finished row; with --slides "
                                            "also skip the slides whose outputs are all written", False, switch=True,
                        old=("--resume",), group=WINDOWS, tags=MAPS_OF_SLIDES)
    map_mode: MapMode = flag(
        "--map-mode", "classifiers: dense computes every cell fully convolutionally (fast; a cell's features see the "
                      "slide around its tile); tiles applies the classifier to exactly the tile each cell names, as "
                      "trained (slower by about (patch / --output-stride)^2; use --output-stride = the patch size "
                      "for non-overlapping tiles); auto: dense for a network with a fully convolutional form, tiles "
                      "otherwise (a transformer: ViT, Swin, ...), said in one line", MapMode.AUTO, parse=MapMode,
        choices=MapMode.values(), group=MAPS, tags=MAPS_OF_SLIDES)
    output_stride: int | None = flag("--output-stride", "pixels per output cell of a classifier (a multiple of the "
                                                        "trunk's stride; default: the trunk's; a transformer, which "
                                                        "maps in tiles mode only: any, default its image size)",
                                     None, parse=int, bounds=Bounds(1), group=MAPS, tags=MAPS_OF_SLIDES)
    heat_class: int | None = flag("--heat-class", "class drawn by the .png and .tif:preview of a classifier "
                                                  "(default: the first positive class after class 0, not "
                                                  "background/normal/negative/'no ...'; printed)", None, parse=int,
                                  bounds=Bounds(0), group=MAPS, tags=MAPS_OF_SLIDES)
    threshold: float | None = flag("--threshold", ".geojson: least probability of a region's class (default: 0.5 "
                                                  "for a classifier, the label map's most probable class for a "
                                                  "segmentation network)", None, parse=float, bounds=Bounds(0, 1),
                                   group=MAPS, tags=MAPS_OF_SLIDES)
    min_area: float = flag("--min-area", ".geojson: drop regions and holes smaller than this (level-0 pixels "
                                         "squared)", 0.0, parse=float, bounds=Bounds(0), group=MAPS,
                           tags=MAPS_OF_SLIDES)
    exclude_classes: tuple[str, ...] = flag("--exclude-class", ".geojson: a class not to trace (name or index; "
                                                               "repeat for several), e.g. background", (),
                                            repeat=True, group=MAPS, tags=MAPS_OF_SLIDES)
    overlay_side: int = flag("--overlay-side", "largest side of the .png overlay (pixels)", OVERLAY_SIDE, parse=int,
                             bounds=Bounds(16), group=MAPS, tags=MAPS_OF_SLIDES)
    overwrite: bool = flag("--overwrite", "replace existing outputs", False, switch=True, group=MAPS)
    dtype: str = DTYPE.field("float32", group=NETWORK)
    task: Task | None = TASK.field(None, default_text="run what the checkpoint holds", group=NETWORK,
                                   tags=(Applies.WINDOW_MAPS,))
    model: str | None = MODEL.field(None, default_text="the checkpoint's", group=NETWORK, tags=(Applies.WINDOW_MAPS,))
    stain_normalize: bool = STAIN_NORMALIZE.field(True, group=NETWORK)
    device: DeviceChoice = field(default_factory=DeviceChoice)
    progress: bool = PROGRESS.field(True, group="options")
    keep_trace: bool = False           # not a flag: dl.infer_slide(keep_trace=True) keeps the per-rank timeline

    @classmethod
    def from_keywords(cls, keywords: Mapping[str, object]) -> InferJob:
        """The job of keywords named like the flags (``checkpoint="ckpt", slide="s.svs", output=["m.tif"],
        slide_level=1``; text parsed as the flag parses it, paths as Path objects too); ConfigError for a missing
        ``checkpoint`` or ``output`` and for an unknown keyword (with the closest names)."""
        missing = [item.flag.dest for item in flag_fields(cls) if item.default is MISSING
                   and item.flag.dest not in keywords]
        if missing:
            raise ConfigError(missing[0], f"is required: give {', '.join(name + '=...' for name in missing)}")
        return build_job(cls, {name: as_text(value) for name, value in keywords.items()}, "infer")

    # ------------------------------------------------------------------ the kind the flags ask for
    @property
    def asked(self) -> InferKind:
        """The kind the flags ask for (a whole-slide checkpoint makes SLIDE and COHORT slide-level: ``check``);
        ConfigError unless exactly one of --slide, --slides, --cohort, --volume is given."""
        given = [option for option, value in zip(SOURCE_FLAGS, (self.slide, self.slides, self.cohort, self.volume))
                 if value is not None]
        choose = f"give one of {', '.join(SOURCE_FLAGS[:-1])} or {SOURCE_FLAGS[-1]}"
        if not given:
            raise ConfigError("--slide", f"what to run on: {choose}")
        if len(given) > 1:
            raise ConfigError(given[1], f"{' and '.join(given)} both given; {choose}")
        if self.volume is not None:
            return InferKind.VOLUME
        return InferKind.SLIDE if self.slide is not None else InferKind.COHORT

    @property
    def slide_source(self) -> str:
        """What ``--slides``, ``--cohort`` or ``--slide`` names (the slides of a cohort or of slide-level
        inference)."""
        source = self.slides or self.cohort or self.slide
        if source is None:
            raise ConfigError("--slides", "give --slides, --cohort or --slide")
        return str(source)

    def given_flags(self, items: list[FlagField]) -> list[str]:
        """The flags among ``items`` set to another value than their default, in field order."""
        return [item.flag.option for item in items if functools.reduce(getattr, item.path, self) != item.default]

    def refuse_flags(self, applies: Applies, why: str) -> None:
        """ConfigError naming the flags that apply to ``applies`` only (tagged with it) that were given: ``why`` they
        do not apply to this run."""
        given = self.given_flags(tagged(InferJob, applies))
        if given:
            flags = ", ".join(given)
            raise ConfigError(given[0], f"{why}; drop {flags}")

    # ------------------------------------------------------------------ checks of the flags alone
    def check_flags(self) -> None:
        """Errors of a slide's or a cohort's maps in the flags alone, naming the flag and what works."""
        self.check_dtype()
        self.slide_window()
        check_bounds(self)
        if self.task is not None:
            Task.parse(self.task)
        self.check_map_mode()
        TileGrid.from_slice_method(self.slice_method, self.num_spatial_parts)
        self.specs()

    def check_dtype(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError("--dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    def check_map_mode(self, chosen: MapMode | None = None) -> None:
        """``--map-mode`` is one of its values; tiles (asked, or ``chosen`` by auto once the network is known) runs
        whole slides only (no resume, stops, tissue skips)."""
        if self.map_mode not in MapMode.values():
            raise ConfigError("--map-mode", f"must be one of {', '.join(MapMode.values())}, got {self.map_mode!r}")
        if (self.map_mode if chosen is None else chosen) != MapMode.TILES:
            return
        stops = self.max_window_rows is not None
        asked = self.map_mode == MapMode.TILES
        mode = "tiles" if asked else "tiles (auto's choice: the network has no fully convolutional form)"
        for option, given in (("--resume-outputs", self.resume), ("--max-window-rows", stops),
                              ("--tissue-only", self.tissue_only)):
            if given:
                raise ConfigError("--map-mode", f"{mode} runs the whole slide in one go; drop {option}"
                                                f"{', or use --map-mode dense' if asked else ''}")

    # ------------------------------------------------------------------ checked against the checkpoint and slides
    def check(self) -> CheckedInfer:
        """The job checked before any work: one source, the device, the checkpoint file (its record read once: a
        whole-slide model makes the run slide-level), then what the kind needs (the flags that apply to it, the
        slides, the output folders). ConfigError naming the flag and the fix."""
        asked = self.asked
        self.device.check()
        if asked is not InferKind.VOLUME:
            self.slide_window()
        file = self.checkpoint.path()
        record = readable_record(file)
        whole_slide = record is not None and record.data.whole_slide and asked is not InferKind.VOLUME
        return KIND_CHECKS[InferKind.SLIDE_LEVEL if whole_slide else asked](self, file, record)

    # ------------------------------------------------------------------ what the flags give
    def specs(self) -> tuple[OutputSpec, ...]:
        """The ``--output`` values of a slide's or a cohort's maps parsed (kinds of bare .tif outputs not yet
        resolved); a cohort's name each slide's files with ``{slide}``."""
        return parse_outputs(self.outputs, self.asked is InferKind.COHORT)

    def summary_table(self) -> Path:
        """A cohort's summary table: ``--summary``, else summary.csv in the outputs' folder above ``{slide}``."""
        if self.summary is None:
            return summary_folder(self.specs()[0]) / SUMMARY_NAME
        table = Path(self.summary)
        if "{" in str(table.parent) or not table.parent.is_dir():
            raise ConfigError("--summary", f"{table}: give --summary FILE.csv in an existing folder")
        return table

    def slide_window(self) -> int | None:
        """A slide's ``--window`` (None: from ``--memory-budget``); ConfigError for a volume's D,H,W."""
        if isinstance(self.window, tuple):
            raise ConfigError("--window", "D,H,W is a volume's window (--volume); a slide's is one number")
        return self.window

    def volume_window(self) -> int | tuple[int, int, int]:
        """A volume's input voxels per rank and axis (``--window``, else VOLUME_WINDOW)."""
        return VOLUME_WINDOW if self.window is None else self.window

    def volume_slice_method(self) -> str:
        """A volume's grid: ``--slice-method``, one process's 1x1x1 when it is left at its default."""
        if self.slice_method == "square" and self.num_spatial_parts == 1:
            return "1x1x1"
        return self.slice_method

    @property
    def output_folder(self) -> Path:
        """Slide-level inference's one ``--output DIR``."""
        return Path(self.outputs[0]).expanduser()

    @property
    def target_mpp(self) -> float | None:
        return self.resolution.target

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class CheckedInfer:
    """An InferJob checked before any work: its kind, the checkpoint file it loads and that file's record (None: not
    readable, and loading it says why), the slides of a cohort or of slide-level inference."""

    job: InferJob
    kind: InferKind
    checkpoint: Path
    record: RunRecord | None = None
    slides: tuple[SlideSource, ...] = ()


def readable_record(file: Path) -> RunRecord | None:
    """The record of the checkpoint ``file`` (its weights not read), None when it cannot be read."""
    try:
        return read_checkpoint(file, lazy=True, check=False).record
    except (OSError, ValueError, RuntimeError):
        return None


def check_slide(job: InferJob, file: Path, record: RunRecord | None) -> CheckedInfer:
    """One slide's maps: the flags (the slide itself is read, and the outputs settled, by the runner's set-up)."""
    if job.summary is not None:
        raise ConfigError("--summary", "is for --slides (a cohort); drop it with --slide")
    job.check_flags()
    return CheckedInfer(job, InferKind.SLIDE, file, record)


def check_cohort(job: InferJob, file: Path, record: RunRecord | None) -> CheckedInfer:
    """Many slides' maps: the flags, every slide listed (a manifest's labels among the checkpoint's classes), every
    output's folder able to take it, the summary table's place and (without --resume-outputs or --overwrite) no output
    written yet."""
    job.check_flags()
    slides = slide_sources(job.slide_source, None if record is None else record.class_names)
    specs = job.specs()
    per_slide = [[spec.for_slide(slide.path.stem) for spec in specs] for slide in slides]
    check_folders([spec.path for outputs in per_slide for spec in outputs])
    job.summary_table()
    if not (job.resume or job.overwrite):
        for outputs in per_slide:
            check_outputs(outputs, False)
    return CheckedInfer(job, InferKind.COHORT, file, record, tuple(slides))


def check_slide_level(job: InferJob, file: Path, record: RunRecord | None) -> CheckedInfer:
    """A whole-slide model: none of the flags of window-by-window maps, one output folder that can take slides.csv
    and the maps, the slides listed (a manifest's labels among the model's classes)."""
    job.refuse_flags(Applies.WINDOW_MAPS, "not for a whole-slide model (one prediction per slide from its canvas, "
                                          "as trained)")
    if len(job.outputs) != 1:
        raise ConfigError("--output", f"a whole-slide model writes one folder (slides.csv and a map per slide): give "
                                      f"--output DIR once, not {len(job.outputs)} times")
    job.check_dtype()
    check_bounds(job)
    TileGrid.from_slice_method(job.slice_method, job.num_spatial_parts)
    check_output_folder(job.output_folder, job.overwrite)
    slides = slide_sources(job.slide_source, None if record is None else record.class_names)
    return CheckedInfer(job, InferKind.SLIDE_LEVEL, file, record, tuple(slides))


def check_volume(job: InferJob, file: Path, record: RunRecord | None) -> CheckedInfer:
    """A volume: none of the flags of slides, one output whose folder can take the volumes, the grid and window of
    three axes, a checkpoint of a dense network (not a classifier)."""
    job.refuse_flags(Applies.SLIDES, "for slides, not a --volume")
    if len(job.outputs) != 1:
        raise ConfigError("--output", "a volume gives one label volume (and its probability volumes beside it): "
                                      f"give --output NAME.tif|.nii|.nii.gz once, not {len(job.outputs)} times")
    job.check_dtype()
    check_bounds(job)
    volume_grid(TileGrid.from_slice_method(job.volume_slice_method(), job.num_spatial_parts))
    window_sides(job.volume_window())
    if record is not None:
        refuse_volume_classifier(record, file)
    VolumeOutputs.beside(job.outputs[0], 0).check_free(job.overwrite)
    return CheckedInfer(job, InferKind.VOLUME, file, record)


KIND_CHECKS: dict[InferKind, Callable[[InferJob, Path, RunRecord | None], CheckedInfer]] = {
    InferKind.SLIDE: check_slide, InferKind.COHORT: check_cohort, InferKind.SLIDE_LEVEL: check_slide_level,
    InferKind.VOLUME: check_volume}
