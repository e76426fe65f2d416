"""What ``train``'s check reads of its data before any rank talks, once: class folders and the classes they name,
mask folders, a volume's channels, a whole-slide folder, the cohort manifest (every slide opened), the stain
reference; refusals name the flag and the fix, and what was read goes on as DataFound."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..data.classes import folder_classes, label_order, resolve_names
from ..data.files import folder_files
from ..data.manifest import Cohort, read_cohort, readable
from ..data.masks import is_mask_folder
from ..data.stain import StainRequest, read_reference
from ..data.validate import SourceKind, check_file
from ..data.volume.classes import class_volume_files, volume_classes
from ..data.volume.dataset import volume_images
from ..data.volume.files import is_volume_file, volume_info
from ..errors import ConfigError
from ..evaluation.metrics import MetricName
from .data_choice import SLIDE_LABELS, WHOLE_SLIDE, DataChoice
from .flag_checks import TrainFlags
from .resume import check_resume_source


@dataclass(frozen=True)
class DataFound:
    """What the check read: the classes in label order, the names ordering class folders' labels (None: other
    data), the checked cohort, the stain normalisation asked for, the images' channels."""

    class_names: tuple[str, ...]
    class_order: tuple[str, ...] | None = None
    cohort: Cohort | None = None
    stain_request: StainRequest | None = None
    in_channels: int = 3


def read_data(job: TrainFlags) -> DataFound:
    """The data ``job`` names, read and checked (ConfigError naming the flag): what the run needs of it."""
    data = job.data
    check_task_data(data)
    channels = volume_channels(job)
    check_resume_source(job.checkpoints.resume, job.checkpoints.directory)
    check_slide_folder(data)
    cohort = job_cohort(job)
    request = data.stain.request
    if request is not None:
        read_reference(request.reference)
    names, order = job_classes(job, cohort)
    return DataFound(names, order, cohort, request, channels)


def check_task_data(data: DataChoice) -> None:
    """The labels the task needs are in ``--datapath``: masks or annotated slides for segmentation (and the flags
    naming their classes), no mask folder for classification."""
    datapath = data.datapath
    if not data.task.dense:
        if datapath is not None and is_mask_folder(datapath):
            raise ConfigError("--datapath", f"{datapath} holds images/ with their masks/ (per-pixel labels), not "
                                            f"class folders: add --task segmentation --model unet")
        return
    if datapath is None:
        return
    check_dense_labels(datapath)
    annotated = not is_mask_folder(datapath)
    if annotated and data.classes is None:
        raise ConfigError("--classes", "annotated slides name their classes: give --classes in label order, the "
                                       "first for the pixels no annotation covers, e.g. background,tumor,stroma")
    if not annotated and data.num_classes is None and data.classes is None:
        raise ConfigError("--num-classes", "masks hold class indices, not names: give --num-classes N (or "
                                           "--classes a,b,... in label order)")


def check_dense_labels(datapath: str) -> None:
    """ConfigError when ``--datapath`` holds image tiles (class folders) rather than images with masks or slides
    with annotations: segmentation would find no per-pixel labels there."""
    root = Path(datapath).expanduser()
    if not root.is_dir() or is_mask_folder(root):
        return
    files, slides = folder_files(root)
    if files and not slides:
        raise ConfigError("--task", f"{datapath} holds image tiles (class folders: one label per image), not "
                                    f"per-pixel labels; to classify them drop --task segmentation, to segment give "
                                    f"a folder with images/ and masks/ or slides with their QuPath GeoJSON beside them")


def volume_channels(job: TrainFlags) -> int:
    """The channels of a volume run's input (the first readable volume's; the data check holds the rest to it;
    1 when none can be read: the check then names them), 3 for images; ConfigError for a folder of the other
    kind (unet3d segments images/ with masks/, resnet3d classifies class folders of volumes)."""
    data, dense = job.data, job.model.family.dense
    if not data.volume:
        return 3
    datapath = data.datapath
    if dense and (datapath is None or not is_mask_folder(datapath)):
        raise ConfigError("--datapath", "volumes are segmented from a folder with images/ and masks/ holding volume "
                                        "files of the same names (.tif stacks, .nii, .nii.gz)")
    if datapath is None or not Path(datapath).expanduser().is_dir():
        raise ConfigError("--datapath", "volumes are classified from a folder of class folders of volume files "
                                        "(<class>/<name>.tif stacks, .nii, .nii.gz)")
    root = Path(datapath).expanduser()
    for path in volume_images(root) if dense else class_volume_files(root):
        if is_volume_file(path):
            try:
                return volume_info(path).channels
            except ConfigError:
                continue
    return 1


def check_slide_folder(data: DataChoice) -> None:
    """``--whole-slide --datapath``: class folders of slides (not one slide, tiles, or slides without a class)."""
    if not data.whole_slide or data.cohort is not None or data.datapath is None:
        return                                    # the manifest gives the labels (checked with --cohort)
    root = Path(data.datapath).expanduser()
    if root.is_file():
        raise ConfigError(WHOLE_SLIDE, f"{data.datapath} is one slide, without a label to learn; give {SLIDE_LABELS}")
    if not root.is_dir():
        return                                    # the data check names the missing path
    files, slides = folder_files(root)
    if not slides:
        raise ConfigError(WHOLE_SLIDE, f"{data.datapath} holds image tiles, not slides; give {SLIDE_LABELS}")
    if any(len(path.relative_to(root).parts) == 1 for path in files):
        raise ConfigError(WHOLE_SLIDE, f"{data.datapath} has slides directly in the folder, without a class folder "
                                       f"to label them; give {SLIDE_LABELS}")


def cohort_of(path: str | Path, classes: tuple[str, ...] | None, image_size: int, level: int, *,
              every_class: bool = False) -> Cohort:
    """The manifest at ``path`` with the labels ``classes`` (``--classes``; None: its own), each slide opened
    through the data check's header reader at ``image_size`` and ``level``; ``every_class`` (training): each of
    ``classes`` must label a slide."""
    def probe(slide: Path) -> str | None:
        return readable(slide) or check_file(slide, SourceKind.SLIDES, image_size, level)

    return read_cohort(path, classes, probe=probe, every_class=every_class)


def job_cohort(job: TrainFlags) -> Cohort | None:
    """The manifest ``--cohort`` names, read and checked (every slide's header opened; None without one); a split
    column excludes the other ways of holding data out."""
    data, held_out = job.data, job.held_out
    if data.cohort is None:
        return None
    size = 1 if data.whole_slide else data.side         # a canvas may be larger than its slide
    cohort = cohort_of(data.cohort, data.classes, size, data.slide_level, every_class=True)
    if cohort.has_splits:
        for flag, value in (("--val-fraction", held_out.val_fraction), ("--folds", held_out.folds),
                            ("--val-datapath", held_out.val_datapath)):
            if value is not None:
                raise ConfigError(flag, "the cohort's split column already places each patient (train, val, "
                                        f"test); drop {flag}, or drop the column to split by {flag}")
    return cohort


def job_classes(job: TrainFlags, cohort: Cohort | None) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
    """(the class names in label order, the names ordering class folders' labels or None) from the data and
    ``--classes``/``--num-classes``; ConfigError when they disagree, or for flags the classes do not fit."""
    data = job.data
    found = cohort.classes if cohort is not None else data_classes(data)
    names = resolve_names(data.reads, found, data.classes, data.num_classes, "--cohort" if cohort else "--datapath")
    weights = job.training.class_weights
    if isinstance(weights, tuple) and len(weights) != len(names):
        raise ConfigError("--class-weights", f"gives {len(weights)} weights for {len(names)} classes "
                                             f"({', '.join(names)}); give one per class, in that order")
    if job.checkpoints.keep_best is MetricName.VAL_ROC_AUC and len(names) < 2:
        raise ConfigError("--keep-best", f"val_roc_auc ranks one class against the others: it needs 2 or more "
                                         f"classes, this run has {len(names)}; use val_loss or val_accuracy")
    ignore = data.ignore_index
    if data.task.dense and ignore is not None and 0 <= ignore < len(names):
        raise ConfigError("--ignore-index", f"{ignore} is class {names[ignore]!r} of the {len(names)} classes; use a "
                                            f"value outside 0..{len(names) - 1} (e.g. 255)")
    return names, None if data.task.dense else label_order(found, names)     # masks: labels are values


def data_classes(data: DataChoice) -> tuple[str, ...] | None:
    """The classes the data names: class folders (of images, slides or volumes), CIFAR-10's, the IHC stand-in
    mask's; None where they come from ``--classes``/``--num-classes`` (masks and annotations, generated data)."""
    from ..data.sample import DAB_CLASSES

    if data.task.dense:
        return DAB_CLASSES if data.datapath is None else None
    if data.volume and data.datapath is not None:
        return volume_classes(data.datapath)
    return folder_classes(data.reads, data.datapath)
