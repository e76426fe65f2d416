"""The data flags of ``train`` (DataChoice: ``--app``, ``--datapath``, sizes, classes, task, ``--cohort``,
``--whole-slide``, stain normalisation) and the checks among them, before anything is read; the types of
``--image-size`` (an image side or a volume's D,H,W) and ``--voxel-size``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from ..data.apps import AppKind
from ..data.classes import parse_names
from ..data.resolution import ResolutionChoice
from ..data.stain import KNOB as REFERENCE
from ..data.stain import StainMethod, StainRequest
from ..data.task import Task
from ..errors import ConfigError
from ..schema import Bounds, check_bounds, flag, number, whole_number
from . import flag_groups as groups
from .model_choice import classes_flag

T = TypeVar("T")
VolumeSize = tuple[int, int, int]
ImageSize = int | VolumeSize
METHOD = "--stain-normalize"
WHOLE_SLIDE = "--whole-slide"
COHORT = "--cohort"
SLIDE_LABELS = ("--cohort FILE.csv (columns slide,label[,patient]) or --datapath with class folders of slides "
                "(<datapath>/<class>/<slide>)")


def parse_image_size(text: str) -> ImageSize:
    """``--image-size``: ``N`` (an image side) or ``D,H,W`` (a volume's patch); ValueError otherwise."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        sides = [int(p) for p in parts]
    except ValueError:
        raise ValueError("give an image side N or a volume's D,H,W (integers)") from None
    if len(sides) == 1:
        return sides[0]                   # checked with the other numbers (its bounds)
    if len(sides) != 3 or min(sides) < 1:
        raise ValueError("give an image side N or a volume's D,H,W (each >= 1)")
    return sides[0], sides[1], sides[2]


def parse_voxel_size(text: str) -> tuple[float, float, float]:
    """``--voxel-size``: ``Z,Y,X`` or one number for all three (µm, > 0); ValueError otherwise."""
    try:
        sizes = [float(p) for p in str(text).split(",")]
    except ValueError:
        raise ValueError("give Z,Y,X or one number (µm)") from None
    if len(sizes) not in (1, 3) or not all(s > 0 for s in sizes):
        raise ValueError("give Z,Y,X or one number, each > 0 (µm)")
    z, y, x = sizes * 3 if len(sizes) == 1 else sizes
    return z, y, x


def app_flag(default: T) -> T:
    """The ``--app`` field (``default`` None: the checkpoint's)."""
    return flag("--app", "data: medical (1), cifar (2) or synthetic (3)", default, parse=AppKind.parse,
                metavar="APP", group=groups.WORKLOAD)


def datapath_flag() -> str | None:
    return flag("--datapath", "dataset path: tile folder / slide file(s) for medical, CIFAR-10 binary batches for "
                              "cifar (medical default: bundled IHC sample)", None, group=groups.WORKLOAD)


def image_size_flag(default: T) -> T:
    """The ``--image-size`` field (``default`` None: the checkpoint's)."""
    return flag("--image-size", "image side in pixels (square images), or a volume patch's depth,height,width in "
                                "voxels (--model unet3d)", default, parse=parse_image_size, metavar="N|D,H,W",
                bounds=Bounds(1), group=groups.WORKLOAD)


def samples_flag() -> int:
    return flag("--num-samples", "images in the synthetic dataset", 256, parse=whole_number, bounds=Bounds(1),
                group=groups.RUN)


def min_tissue_flag() -> float:
    return flag("--min-tissue", "--app medical with slides: least tissue fraction of a kept tile", 0.5, parse=number,
                bounds=Bounds(0, 1), group=groups.RUN)


def cohort_flag() -> str | None:
    return flag(COHORT, "slides from a manifest: columns slide (path, relative to the file), label, optional "
                        "patient, fold, split; tiles labelled by their slide, split by patient", None,
                metavar="FILE.csv", group=groups.SLIDES)


def task_flag(default: T, help: str = "") -> T:
    """The ``--task`` field (``default`` None: the checkpoint's)."""
    return flag("--task", "classification (a class per image) or segmentation (a class per pixel: masks or QuPath "
                          "annotations, a dense model such as --model unet)" + help, default, parse=Task.parse,
                choices=Task.values(), group=groups.TASK)


@dataclass(frozen=True)
class StainFlags:
    """``--stain-normalize METHOD --stain-reference IMAGE``: both or neither (the image is read by the job's check)."""

    method: StainMethod | None = flag(METHOD, "bring every image's stain to --stain-reference's (train, evaluate and "
                                              "infer alike; recorded in the checkpoint)", None,
                                      parse=StainMethod.parse, choices=tuple(m.value for m in StainMethod),
                                      group=groups.STAIN)
    reference: str | None = flag(REFERENCE, "the image (PNG, JPEG, TIFF tile with tissue) whose stain "
                                            "--stain-normalize matches", None, metavar="IMAGE", group=groups.STAIN)

    def __post_init__(self) -> None:
        if self.method is None and self.reference is not None:
            raise ConfigError(REFERENCE, f"needs {METHOD} macenko|reinhard (the method); add it, or drop {REFERENCE}")
        if self.method is not None and self.reference is None:
            raise ConfigError(METHOD, f"needs {REFERENCE} IMAGE: a tile stained as every image should look")

    @property
    def request(self) -> StainRequest | None:
        """What the run is asked to normalise to (None: nothing)."""
        return None if self.method is None or self.reference is None else StainRequest(self.method, self.reference)


@dataclass(frozen=True)
class DataChoice:
    """The images ``train`` reads, at which size and resolution, with which classes and task: the flags as given
    (the classes the data names, a cohort's slides and a stain reference are read by the job's check)."""

    app: AppKind = app_flag(AppKind.SYNTHETIC)
    datapath: str | None = datapath_flag()
    image_size: ImageSize = image_size_flag(32)
    num_classes: int | None = classes_flag(None, "number of classes (default: the data's: its class folders, "
                                                 "CIFAR-10's 10; else 10); refused when it disagrees with the data")
    num_samples: int = samples_flag()
    slide_level: int = flag("--slide-level", "--app medical with slides: pyramid level the tiles are cut from", 0,
                            parse=whole_number, bounds=Bounds(0), group=groups.RUN)
    resolution: ResolutionChoice = field(default_factory=ResolutionChoice)
    voxel_size: tuple[float, float, float] | None = flag(
        "--voxel-size", "volumes (--image-size D,H,W): read each at this voxel size in µm (one number: isotropic), "
                        "shrunk from its own (TIFF/NIfTI tags) by the mean of each footprint (labels: the majority); "
                        "default as stored", None, parse=parse_voxel_size, metavar="Z,Y,X", group=groups.RUN)
    min_tissue: float = min_tissue_flag()
    skip_bad_files: bool = flag("--skip-bad-files", "train on the usable files when the data check finds bad ones "
                                                    "(default: refuse)", False, switch=True, group=groups.RUN)
    classes: tuple[str, ...] | None = flag(
        "--classes", "class names in label order (default: the class folders' names, sorted); with class folders "
                     "every folder must be named, and their order sets the labels", None, parse=parse_names,
        metavar="A,B,...", group=groups.TRAINING)
    task: Task = task_flag(Task.CLASSIFICATION)
    ignore_index: int | None = flag("--ignore-index", "segmentation: mask value of pixels no loss or metric counts "
                                                      "(e.g. 255)", None, parse=whole_number, metavar="LABEL",
                                    group=groups.TASK)
    cohort: str | None = cohort_flag()
    whole_slide: bool = flag(WHOLE_SLIDE, "a sample per slide: its tissue centred on one --image-size canvas at --mpp "
                                          "(each spatial rank reads only its tile), labelled by the slide; needs "
                                          + SLIDE_LABELS, False, switch=True, group=groups.SLIDES)
    stain: StainFlags = field(default_factory=StainFlags)

    def __post_init__(self) -> None:
        check_bounds(self)
        self._check_slides()
        if self.datapath is not None and not self.reads.reads_datapath:
            raise ConfigError("--datapath", f"--app {self.app} does not read --datapath (it would train on generated "
                                            f"images); use --app medical for tiles/slides or --app cifar for "
                                            f"CIFAR-10 batches, or drop --datapath")
        given = self.resolution.given
        if given is not None and self.datapath is None and self.cohort is None:
            raise ConfigError(given, "applies to images read from --datapath or --cohort (tiles, images with masks, "
                                     "slides); the bundled IHC sample and generated images carry no resolution")
        if self.stain.method is not None and self.reads is not AppKind.MEDICAL:
            raise ConfigError(METHOD, f"normalises pathology stains; --app {self.reads} has none: use --app medical "
                                      f"(or --cohort), or drop {METHOD}")

    def _check_slides(self) -> None:
        """``--whole-slide`` and ``--cohort`` against the task and the other data flags."""
        if self.whole_slide and self.task.dense:
            raise ConfigError(WHOLE_SLIDE, "with --task segmentation is not supported: a whole-slide run learns slide "
                                           "labels (one class per slide); drop --task segmentation, or segment tiles "
                                           "(masks or annotated slides as --datapath) without --whole-slide")
        if self.cohort is not None:
            if self.datapath is not None:
                raise ConfigError(COHORT, "gives the slides; drop --datapath (or drop --cohort to read a folder)")
            if self.app not in (AppKind.SYNTHETIC, AppKind.MEDICAL):     # synthetic: the default, not a choice
                raise ConfigError(COHORT, f"lists slides, which --app {self.app} does not read; use --app medical")
            if self.task.dense:
                raise ConfigError(COHORT, "labels whole slides (classification); for --task segmentation give "
                                          "annotated slides with --datapath")
        if self.whole_slide and self.cohort is None and self.datapath is None:
            raise ConfigError(WHOLE_SLIDE, f"needs slide labels: {SLIDE_LABELS}")

    @property
    def volume(self) -> bool:
        """Whether ``--image-size`` names a volume's patch (D,H,W)."""
        return isinstance(self.image_size, tuple)

    @property
    def reads(self) -> AppKind:
        """The data read: ``--app``, or medical where ``--cohort``, volumes or segmentation's ``--datapath`` imply
        it (slide, volume or mask files)."""
        implied = self.cohort is not None or self.volume or (self.task.dense and self.datapath is not None)
        return AppKind.MEDICAL if implied else self.app

    @property
    def side(self) -> int:
        """The image side (a volume patch's largest)."""
        return max(self.image_size) if isinstance(self.image_size, tuple) else self.image_size
