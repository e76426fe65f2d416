"""The data flags of ``train`` (DataChoice: ``--app``, ``--datapath``, sizes, classes, task, ``--cohort``,
``--whole-slide``, stain normalisation) and the checks among them, before anything is read; the type of
``--voxel-size`` (``--image-size``'s, with the data options train shares, is in data/options.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..data.apps import AppKind
from ..data.classes import parse_names
from ..data.options import (
    APP,
    DATAPATH,
    IMAGE_SIZE,
    MIN_TISSUE,
    NUM_SAMPLES,
    REPAIR_ANNOTATIONS,
    SLIDE_LEVEL,
    TASK,
    TISSUE,
)
from ..data.options import COHORT as COHORT_OPTION
from ..data.options import ImageSize as ImageSize
from ..data.options import VolumeSize as VolumeSize
from ..data.options import parse_image_size as parse_image_size
from ..data.resolution import ResolutionChoice
from ..data.stain import KNOB as REFERENCE
from ..data.stain import StainMethod, StainRequest
from ..data.task import Task
from ..data.tissue_mask import TissueMethod
from ..errors import ConfigError
from ..models.options import NUM_CLASSES
from ..schema import check_bounds, flag, whole_number
from . import flag_groups as groups

COHORT = COHORT_OPTION.flag.option
METHOD = "--stain-normalize"
WHOLE_SLIDE = "--whole-slide"
SLIDE_LABELS = ("--cohort FILE.csv (columns slide,label[,patient]) or --datapath with class folders of slides "
                "(<datapath>/<class>/<slide>)")


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

    app: AppKind = APP.field(AppKind.SYNTHETIC, group=groups.WORKLOAD)
    datapath: str | None = DATAPATH.field(None, group=groups.WORKLOAD)
    image_size: ImageSize = IMAGE_SIZE.field(32, group=groups.WORKLOAD)
    num_classes: int | None = NUM_CLASSES.field(None, default_text="the data's: its class folders, CIFAR-10's 10; "
                                                                   "else 10", group=groups.MODEL)
    num_samples: int = NUM_SAMPLES.field(256, group=groups.RUN)
    slide_level: int = SLIDE_LEVEL.field(0, group=groups.RUN)
    resolution: ResolutionChoice = field(default_factory=ResolutionChoice)
    voxel_size: tuple[float, float, float] | None = flag(
        "--voxel-size", "volumes (--image-size D,H,W): read each at this voxel size in µm (one number: isotropic), "
                        "shrunk from its own (TIFF/NIfTI tags) by the mean of each footprint (labels: the majority); "
                        "default as stored", None, parse=parse_voxel_size, metavar="Z,Y,X", group=groups.RUN)
    min_tissue: float = MIN_TISSUE.field(0.5, group=groups.RUN)
    tissue: TissueMethod = TISSUE.field(TissueMethod.SATURATION, group=groups.RUN)
    skip_bad_files: bool = flag("--skip-bad-files", "train on the usable files when the data check finds bad ones "
                                                    "(default: refuse)", False, switch=True, group=groups.RUN)
    classes: tuple[str, ...] | None = flag(
        "--classes", "class names in label order (default: the class folders' names, sorted); with class folders "
                     "every folder must be named, and their order sets the labels", None, parse=parse_names,
        metavar="A,B,...", group=groups.TRAINING)
    task: Task = TASK.field(Task.CLASSIFICATION, group=groups.TASK)
    ignore_index: int | None = flag("--ignore-index", "segmentation: mask value of pixels no loss or metric counts "
                                                      "(e.g. 255)", None, parse=whole_number, metavar="LABEL",
                                    group=groups.TASK)
    repair_annotations: bool = REPAIR_ANNOTATIONS.field(False, group=groups.TASK)
    cohort: str | None = COHORT_OPTION.field(None, group=groups.SLIDES)
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
        """``--whole-slide``, ``--cohort``, ``--tissue`` and ``--repair-annotations`` against the task and the other
        data flags."""
        if self.repair_annotations and not self.task.dense:
            raise ConfigError("--repair-annotations", "repairs the polygons of annotated slides, which only --task "
                                                      "segmentation reads; drop it")
        if self.whole_slide and self.tissue is not TissueMethod.SATURATION:
            raise ConfigError("--tissue", f"picks the tiles cut from slides; {WHOLE_SLIDE} places each slide's tissue "
                                          f"by the saturation mask, as infer's canvases repeat it: drop --tissue")
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
