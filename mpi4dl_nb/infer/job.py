"""InferJob: everything ``infer`` is asked to do (its fields name the flags and ``dl.infer``'s keywords), its kind
(one slide, a cohort, slide-level, a volume) and its checks before any work: of the flags alone, then against the
checkpoint's record and the slides (CheckedInfer)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path

import torch

from ..checkpoint.files import CheckpointChoice
from ..checkpoint.record import RunRecord, read_checkpoint
from ..comm.device import DeviceChoice
from ..config import Choice, ConfigError, parse_slice_method
from ..data.resolution import ResolutionChoice
from ..data.task import Task
from ..models.spec import parse_model_name
from ..schema import build_job, flag, flag_fields
from ..spatial.geometry import TileGrid
from .outputs.kinds import HELP as OUTPUT_HELP
from .outputs.kinds import OutputSpec, check_folders, check_outputs, parse_outputs, summary_folder
from .outputs.slide_level import check_output_folder
from .outputs.volume import VolumeOutputs
from .slide_list import SlideSource, slide_sources
from .tile_map import MapMode
from .trained import refuse_volume_classifier
from .volume import volume_grid, window_sides

DTYPES = ("float32", "float64")
DEFAULT_BUDGET = 1 << 30          # bytes per rank for one window when --window is not given
OVERLAY_SIDE = 1600
VOLUME_WINDOW = 64                # a volume's input voxels per rank and axis when --window is not given
SUMMARY_NAME = "summary.csv"      # a cohort's summary table, beside its outputs unless --summary names it
SOURCE, WINDOWS, MAPS, NETWORK = "what to run on", "windows", "outputs", "network"
SOURCE_FLAGS = ("--slide", "--slides", "--cohort", "--volume")

# keywords of the flags of the window-by-window maps, which a whole-slide model (one prediction per canvas) does not
# take, and of the flags of slides, which a volume does not take
WINDOW_ONLY = ("window", "memory_budget", "output_stride", "map_mode", "heat_class", "threshold", "min_area",
               "exclude_class", "overlay_side", "tissue_only", "min_tissue", "batch_windows", "resume",
               "max_window_rows", "task", "model", "summary")
SLIDE_ONLY = ("memory_budget", "output_stride", "map_mode", "heat_class", "threshold", "min_area", "exclude_class",
              "overlay_side", "tissue_only", "min_tissue", "batch_windows", "resume", "max_window_rows", "slide_level",
              "mpp", "magnification", "source_mpp")


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
    cohort: str | None = flag(
        "--cohort", "a cohort manifest (columns slide,label[,patient,...]; paths relative to the file): its slides, "
                    "each one's label and patient in the summary table", None, metavar="FILE.csv", group=SOURCE)
    summary: str | None = flag("--summary", "with --slides: the summary table (CSV; default summary.csv beside the "
                                            "outputs)", None, group=SOURCE)
    resolution: ResolutionChoice = field(default_factory=ResolutionChoice)
    slide_level: int | None = flag("--slide-level", "pyramid level to read as it is (default 0, or the level of the "
                                                    "checkpoint's training MPP; not with --mpp)", None, parse=int,
                                   group="resolution")
    num_spatial_parts: int = flag("--num-spatial-parts", "ranks that share each window (= ranks to launch)", 1,
                                  parse=int, group=WINDOWS)
    slice_method: str = flag("--slice-method", "how a window is cut among the ranks: square, vertical, horizontal; a "
                                               "volume's DxRxC (default 1x1x1 for a volume)", "square",
                             parse=parse_slice_method, group=WINDOWS)
    window: int | tuple[int, int, int] | None = flag(
        "--window", f"input pixels per rank and axis per pass (default: from --memory-budget); a volume: N or D,H,W "
                    f"voxels per rank (default {VOLUME_WINDOW})", None, parse=window_value, group=WINDOWS)
    memory_budget: int = flag("--memory-budget", "bytes per rank one window may take when --window is not given",
                              DEFAULT_BUDGET, parse=int, group=WINDOWS)
    batch_windows: int = flag("--batch-windows", "windows of equal size per forward", 1, parse=int, group=WINDOWS)
    max_window_rows: int | None = flag("--max-window-rows", "stop after this many window rows (continue later with "
                                                            "--resume)", None, parse=int, group=WINDOWS)
    tissue_only: bool = flag("--tissue-only", "skip windows without tissue (judged on a low-resolution overview); "
                                              "their cells are NaN", False, switch=True, group=WINDOWS)
    min_tissue: float = flag("--min-tissue", "with --tissue-only: skip windows whose tissue share is at most this",
                             0.0, parse=float, group=WINDOWS)
    resume: bool = flag("--resume", "continue a partial output from its last finished row; with --slides also skip "
                                    "the slides whose outputs are all written", False, switch=True, group=WINDOWS)
    map_mode: MapMode = flag(
        "--map-mode", "classifiers: dense computes every cell fully convolutionally (fast; a cell's features see the "
                      "slide around its tile); tiles applies the classifier to exactly the tile each cell names, as "
                      "trained (slower by about (patch / --output-stride)^2; use --output-stride = the patch size "
                      "for non-overlapping tiles)", MapMode.DENSE, parse=MapMode, choices=MapMode.values(),
        group=MAPS)
    output_stride: int | None = flag("--output-stride", "pixels per output cell of a classifier (a multiple of the "
                                                        "trunk's stride; default: the trunk's)", None, parse=int,
                                     group=MAPS)
    heat_class: int | None = flag("--heat-class", "class drawn by the .png and .tif:preview of a classifier "
                                                  "(default: the first positive class after class 0, not "
                                                  "background/normal/negative/'no ...'; printed)", None, parse=int,
                                  group=MAPS)
    threshold: float | None = flag("--threshold", ".geojson: least probability of a region's class (default: 0.5 "
                                                  "for a classifier, the label map's most probable class for a "
                                                  "segmentation network)", None, parse=float, group=MAPS)
    min_area: float = flag("--min-area", ".geojson: drop regions and holes smaller than this (level-0 pixels "
                                         "squared)", 0.0, parse=float, group=MAPS)
    exclude_classes: tuple[str, ...] = flag("--exclude-class", ".geojson: a class not to trace (name or index; "
                                                               "repeat for several), e.g. background", (),
                                            repeat=True, group=MAPS)
    overlay_side: int = flag("--overlay-side", "largest side of the .png overlay (pixels)", OVERLAY_SIDE, parse=int,
                             group=MAPS)
    overwrite: bool = flag("--overwrite", "replace existing outputs", False, switch=True, group=MAPS)
    dtype: str = flag("--dtype", "compute dtype", "float32", choices=DTYPES, group=NETWORK)
    task: Task | None = flag("--task", "refuse a checkpoint of the other task (default: run what the checkpoint "
                                       "holds)", None, parse=Task.parse, choices=Task.values(), group=NETWORK)
    model: str | None = flag("--model", "refuse a checkpoint of another model (resnet, torchvision:resnet50, ...); "
                                        "the checkpoint names the network it holds", None, parse=parse_model_name,
                             metavar="MODEL", group=NETWORK)
    stain_normalize: bool = flag("--no-stain-normalize", "read the slide as stored, without the stain normalisation "
                                                         "the checkpoint records", True, switch=True, group=NETWORK)
    device: DeviceChoice = field(default_factory=DeviceChoice)
    progress: bool = flag("--no-progress", "no progress bar", True, switch=True)
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

    def given_flags(self, keywords: Iterable[str]) -> list[str]:
        """The flags among ``keywords`` set to another value than their default, in field order."""
        wanted = set(keywords)
        return [item.flag.option for item in flag_fields(InferJob) if item.flag.dest in wanted
                and functools.reduce(getattr, item.path, self) != item.default]

    def refuse_flags(self, keywords: Iterable[str], why: str) -> None:
        """ConfigError naming the flags among ``keywords`` that were given: ``why`` they do not apply."""
        given = self.given_flags(keywords)
        if given:
            flags = ", ".join(given)
            raise ConfigError(given[0], f"{why}; drop {flags}")

    # ------------------------------------------------------------------ checks of the flags alone
    def check_flags(self) -> None:
        """Errors of a slide's or a cohort's maps in the flags alone, naming the flag and what works."""
        self.check_dtype()
        for option, value, least in (("--batch-windows", self.batch_windows, 1),
                                     ("--slide-level", self.slide_level, 0),
                                     ("--num-spatial-parts", self.num_spatial_parts, 1),
                                     ("--window", self.slide_window(), 1), ("--output-stride", self.output_stride, 1),
                                     ("--max-window-rows", self.max_window_rows, 1),
                                     ("--heat-class", self.heat_class, 0), ("--memory-budget", self.memory_budget, 1),
                                     ("--overlay-side", self.overlay_side, 16), ("--min-area", self.min_area, 0)):
            if value is not None and value < least:
                raise ConfigError(option, f"must be >= {least}, got {value}")
        if not 0.0 <= self.min_tissue < 1.0:
            raise ConfigError("--min-tissue", f"must be in [0, 1), got {self.min_tissue}")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ConfigError("--threshold", f"must be a probability in [0, 1], got {self.threshold}")
        if self.task is not None:
            Task.parse(self.task)
        self.check_map_mode()
        TileGrid.from_slice_method(self.slice_method, self.num_spatial_parts)
        self.specs()

    def check_dtype(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError("--dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    def check_map_mode(self) -> None:
        """``--map-mode`` is one of its values; ``tiles`` runs whole slides only (no resume, stops, tissue skips)."""
        if self.map_mode not in MapMode.values():
            raise ConfigError("--map-mode", f"must be one of {', '.join(MapMode.values())}, got {self.map_mode!r}")
        if self.map_mode != MapMode.TILES:
            return
        for option, given in (("--resume", self.resume), ("--max-window-rows", self.max_window_rows is not None),
                              ("--tissue-only", self.tissue_only)):
            if given:
                raise ConfigError("--map-mode", f"tiles runs the whole slide in one go; drop {option}, or use "
                                                f"--map-mode dense")

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
    output's folder able to take it, the summary table's place and (without --resume or --overwrite) no output
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
    job.refuse_flags(WINDOW_ONLY, "not for a whole-slide model (one prediction per slide from its canvas, as "
                                  "trained)")
    if len(job.outputs) != 1:
        raise ConfigError("--output", f"a whole-slide model writes one folder (slides.csv and a map per slide): give "
                                      f"--output DIR once, not {len(job.outputs)} times")
    job.check_dtype()
    if job.slide_level is not None and job.slide_level < 0:
        raise ConfigError("--slide-level", f"must be >= 0, got {job.slide_level}")
    TileGrid.from_slice_method(job.slice_method, job.num_spatial_parts)
    check_output_folder(job.output_folder, job.overwrite)
    slides = slide_sources(job.slide_source, None if record is None else record.class_names)
    return CheckedInfer(job, InferKind.SLIDE_LEVEL, file, record, tuple(slides))


def check_volume(job: InferJob, file: Path, record: RunRecord | None) -> CheckedInfer:
    """A volume: none of the flags of slides, one output whose folder can take the volumes, the grid and window of
    three axes, a checkpoint of a dense network (not a classifier)."""
    job.refuse_flags(SLIDE_ONLY, "for slides, not a --volume")
    if len(job.outputs) != 1:
        raise ConfigError("--output", "a volume gives one label volume (and its probability volumes beside it): "
                                      f"give --output NAME.tif|.nii|.nii.gz once, not {len(job.outputs)} times")
    job.check_dtype()
    volume_grid(TileGrid.from_slice_method(job.volume_slice_method(), job.num_spatial_parts))
    window_sides(job.volume_window())
    if record is not None:
        refuse_volume_classifier(record, file)
    VolumeOutputs.beside(job.outputs[0], 0).check_free(job.overwrite)
    return CheckedInfer(job, InferKind.VOLUME, file, record)


KIND_CHECKS: dict[InferKind, Callable[[InferJob, Path, RunRecord | None], CheckedInfer]] = {
    InferKind.SLIDE: check_slide, InferKind.COHORT: check_cohort, InferKind.SLIDE_LEVEL: check_slide_level,
    InferKind.VOLUME: check_volume}
