"""The data of a job: the dataset its DataSpec names (images with class labels, or with masks), the files the data
check reads, the held-out split, the pixel counts of balanced weights."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ..checkpoint.record import SplitRecord
from ..config import ConfigError
from ..data.apps import AppKind
from ..data.balanced import BalancedOrder
from ..data.canvas import SlideCanvases
from ..data.dataset import RegionDataset
from ..data.files import folder_files, require_path
from ..data.groups import GroupKind, Groups, groups_of
from ..data.masks import MaskDataset, is_mask_folder, pixel_counts
from ..data.stain_reads import with_stain
from ..data.validate import DataSources, SourceKind, find_sources
from ..data.volume.classes import VolumeClassDataset
from ..data.volume.dataset import VolumeFolderDataset
from ..data.volume.groups import PATIENTS_FILE
from ..evaluation.grouped import GroupedSplit, split_by_side, split_fold, split_grouped
from ..evaluation.split import Subset, split_listing
from .held_out_spec import HeldOutSpec
from .identity import digest
from .job import DataSpec
from .training_spec import ClassWeights

Checker = Callable[[Path], str | None]
VOLUME_FOLDERS = (VolumeFolderDataset, VolumeClassDataset)   # volumes: split whole, each side a dataset of its own


def dataset_from(data: DataSpec, seed: int, datapath: str | Path | None, exclude: Sequence[Path] = ()) -> RegionDataset:
    """The dataset ``data`` names, read from ``datapath`` (without the files ``exclude``; class folders labelled
    in the order of ``DataSpec.class_order`` when set; generated images seeded by ``seed``), its images read through
    ``DataSpec.stain`` when set."""
    return with_stain(unstained_dataset(data, seed, datapath, exclude), data.stain)


def unstained_dataset(data: DataSpec, seed: int, datapath: str | Path | None,
                      exclude: Sequence[Path] = ()) -> RegionDataset:
    """The dataset ``data`` names, its images as stored."""
    from ..data import make_dataset

    if data.task.dense:
        return segmentation_dataset(data, datapath, exclude)
    if data.volume_size is not None:
        return volume_class_dataset(data, data.volume_size, datapath, exclude)
    if data.whole_slide:
        return canvas_dataset(data, datapath, exclude)
    if data.cohort is not None and datapath == data.datapath:    # the cohort's slides (not --val-datapath)
        from ..data.cohort_slides import CohortSlides

        return CohortSlides(data.cohort, data.image_size, level=data.slide_level, min_tissue=data.min_tissue,
                            mpp=data.mpp, source_mpp=data.source_mpp, tissue=data.tissue)
    return make_dataset(data.app, data.image_size, data.num_classes, datapath=datapath, seed=seed,
                        num_samples=data.num_samples, slide_level=data.slide_level, min_tissue=data.min_tissue,
                        exclude=exclude, classes=data.class_order, mpp=data.mpp, source_mpp=data.source_mpp,
                        tissue=data.tissue)


def canvas_dataset(data: DataSpec, datapath: str | Path | None, exclude: Sequence[Path] = ()) -> SlideCanvases:
    """``--whole-slide``: a canvas per slide of the cohort (when ``datapath`` is its own) or of the class folders of
    slides ``datapath`` names (without the files ``exclude``)."""
    from ..data.canvas import cohort_canvases, folder_canvases

    if data.cohort is not None and datapath == data.datapath:
        return cohort_canvases(data.cohort, data.image_size, level=data.slide_level, mpp=data.mpp,
                               source_mpp=data.source_mpp, tissue_channel=data.tissue_channel)
    if datapath is None:
        raise ConfigError("--whole-slide", "needs slides with labels: --cohort FILE.csv or class folders of slides")
    root = require_path(datapath)
    files, _ = folder_files(root, exclude)
    return folder_canvases(root, files, data.image_size, classes=data.class_order, level=data.slide_level,
                           mpp=data.mpp, source_mpp=data.source_mpp, tissue_channel=data.tissue_channel)


def volume_class_dataset(data: DataSpec, size: tuple[int, int, int], datapath: str | Path | None,
                         exclude: Sequence[Path] = ()) -> VolumeClassDataset:
    """The class folders of volumes ``datapath`` names (without the files ``exclude``): ``size`` patches, labelled in
    the order of ``DataSpec.class_order`` when set."""
    if datapath is None:
        raise ConfigError("--datapath", "volumes to classify are read from a folder of class folders of volume files")
    return VolumeClassDataset.open(datapath, size, classes=data.class_order,
                                   exclude=exclude, voxel_size=data.voxel_size)


def segmentation_dataset(data: DataSpec, datapath: str | Path | None, exclude: Sequence[Path] = ()) -> MaskDataset:
    """The images with masks ``datapath`` names (without the files ``exclude``): volumes with label volumes when
    ``DataSpec.volume_size`` is set."""
    from ..data.annotated_slides import AnnotatedSlideDataset
    from ..data.masks import MaskFolderDataset, image_files
    from ..data.sample import IHCMaskDataset
    from ..data.validate import excluded

    if datapath is None:
        refuse_repair(data, "the bundled IHC sample (a mask image, no polygons)")
        return IHCMaskDataset(data.image_size)
    root = require_path(datapath)
    if data.volume_size is not None:
        refuse_repair(data, f"{root} (volumes with label volumes)")
        from ..data.volume.dataset import VolumeFolderDataset, volume_images

        return VolumeFolderDataset(root, data.volume_size, data.num_classes,
                                   files=excluded(volume_images(root), exclude), voxel_size=data.voxel_size)
    if is_mask_folder(root):
        refuse_repair(data, f"{root} (images/ with masks/: pixels, no polygons)")
        return MaskFolderDataset(root, data.image_size, data.num_classes, files=excluded(image_files(root), exclude),
                                 mpp=data.mpp, source_mpp=data.source_mpp)
    slides = [root] if root.is_file() else slide_files(root, exclude)
    return AnnotatedSlideDataset(slides, data.image_size, data.class_names, level=data.slide_level,
                                 min_tissue=data.min_tissue, mpp=data.mpp, source_mpp=data.source_mpp,
                                 tissue=data.tissue, repair_annotations=data.repair_annotations)


def refuse_repair(data: DataSpec, source: str) -> None:
    """ConfigError when ``--repair-annotations`` is given for a source of masks, which has no polygons to repair."""
    if data.repair_annotations:
        raise ConfigError("--repair-annotations", f"repairs the QuPath polygons of annotated slides; the labels of "
                                                  f"{source} are read as they are: drop it")


def slide_files(root: Path, exclude: Sequence[Path]) -> list[Path]:
    """The slides of a folder of annotated slides; ConfigError when it holds neither slides nor images/ + masks/."""
    files, slides = folder_files(root, exclude)
    if not slides:
        raise ConfigError("--datapath", f"{root} holds neither images/ with masks/ nor slides with QuPath "
                                        f"annotations (<slide>.geojson beside each) for --task segmentation")
    return files


def data_sources(data: DataSpec, datapath: str | None, knob: str) -> tuple[DataSources, Checker | None]:
    """The files the data check reads and how it checks each: images with their masks, slides with their
    annotations (segmentation), or the tiles/slides of ``find_sources`` (classification, checker None)."""
    if data.cohort is not None and datapath == data.datapath:    # read_cohort opened every slide's header
        return DataSources(None), None
    if data.volume_size is not None and not data.task.dense and datapath is not None:
        from ..data.volume.classes import class_volume_files
        from ..data.volume.dataset import volume_problem

        volume, voxel = data.volume_size, data.voxel_size
        return (DataSources(SourceKind.TILES, tuple(class_volume_files(require_path(datapath, knob)))),
                lambda path: volume_problem(path, volume, voxel))
    if not data.task.dense:
        return find_sources(data.app, datapath, knob, None if data.whole_slide else data.image_size), None
    if datapath is None:
        return DataSources(None), None
    from ..data.annotated_slides import annotation_problems
    from ..data.masks import check_pair, image_files
    from ..data.validate import check_file

    root = require_path(datapath, knob)
    size, classes, ignore = data.image_size, data.num_classes, data.ignore_index
    if data.volume_size is not None:
        from ..data.volume.dataset import check_volume_pair, volume_images

        volume, voxel = data.volume_size, data.voxel_size
        return (DataSources(SourceKind.TILES, tuple(volume_images(root))),
                lambda image: check_volume_pair(image, volume, classes, ignore, voxel))
    if is_mask_folder(root):
        return (DataSources(SourceKind.TILES, tuple(image_files(root))),
                lambda image: check_pair(image, size, classes, ignore))
    sources = find_sources(AppKind.MEDICAL, datapath, knob)
    if sources.kind is not SourceKind.SLIDES:
        raise ConfigError(knob, f"{datapath} holds neither images/ with masks/ nor slides with QuPath annotations "
                                f"(<slide>.geojson beside each) for --task segmentation")
    names, level, repair = data.class_names, data.slide_level, data.repair_annotations
    return sources, lambda slide: (check_file(slide, SourceKind.SLIDES, size, level)
                                   or annotation_problems(slide, names, repair=repair))


def label_counts(data: DataSpec, weights: ClassWeights, dataset: RegionDataset) -> list[int] | None:
    """A segmentation run's pixels per class when ``balanced`` weights need them (reads every mask), zeros when
    they do not; None for classification (the caller counts images)."""
    if not data.task.dense:
        return None
    if not isinstance(weights, str) or not isinstance(dataset, MaskDataset):
        return [0] * data.num_classes
    return pixel_counts(dataset, data.num_classes, data.ignore_index)


def held_out_split(dataset: RegionDataset, fraction: float, seed: int, classes: int,
                   groups: Groups | None = None) -> tuple[Subset, Subset]:
    """(training images, held-out images): a seeded share ``fraction`` of the groups of each of ``classes`` classes
    held out (``groups``: default the dataset's own, ``groups_of``)."""
    return grouped_held_out(dataset, fraction, seed, classes, groups).subsets(dataset)


def grouped_held_out(dataset: RegionDataset, fraction: float, seed: int, classes: int,
                     groups: Groups | None = None, names: Sequence[str] = ()) -> GroupedSplit:
    """The leak-free split of ``dataset``: whole groups (patients, slides) on one side (``names``: the classes',
    for a refusal)."""
    labels = [dataset.label(i) for i in range(len(dataset))]
    return split_grouped(labels, groups or groups_of(dataset), fraction, seed, classes, names)


def dataset_split(data: DataSpec, held_out: HeldOutSpec, seed: int, dataset: RegionDataset) -> GroupedSplit:
    """The held-out split ``held_out`` names: a share of the groups of each class, or one fold of K (a cohort's
    ``fold`` column when it has one)."""
    classes = 1 if data.task.dense else data.num_classes    # masks: images are not split by class
    groups = dataset.groups() if isinstance(dataset, VOLUME_FOLDERS) else groups_of(dataset, held_out.group_by)
    if held_out.folds is None and held_out.val_fraction is None:
        assert data.cohort is not None and data.cohort.has_splits, "a share, folds or the manifest's sides"
        return split_by_side(groups, {s.patient: s.split for s in data.cohort})
    if held_out.folds is None:
        assert held_out.val_fraction is not None, "a share or folds"
        return grouped_held_out(dataset, held_out.val_fraction, seed, classes, groups, data.class_names)
    labels = [dataset.label(i) for i in range(len(dataset))]
    cohort = data.cohort
    given = {s.patient: s.fold for s in cohort if s.fold is not None} if cohort is not None else None
    return split_fold(labels, groups, held_out.folds, held_out.fold or 0, seed, given or None)


def split_sides(split: GroupedSplit, dataset: RegionDataset) -> tuple[RegionDataset, RegionDataset]:
    """(training images, held-out images) of ``dataset``: volumes as volume datasets of their own (read by 3-D
    tiles), other images as subsets."""
    if isinstance(dataset, VOLUME_FOLDERS):
        return dataset.subset(split.train), dataset.subset(split.val)
    return split.subsets(dataset)


def balanced_order(train: RegionDataset, split: GroupedSplit | None, group_by: str | None) -> BalancedOrder:
    """``--balanced-sampler``'s draw of the training images: their labels, and their groups (the split's, else the
    data's own: slides, patients; ungrouped: each image alone)."""
    labels = tuple(train.label(i) for i in range(len(train)))
    if split is not None:
        groups = tuple(split.groups.names[i] for i in split.train)
    elif isinstance(train, VOLUME_FOLDERS):
        groups = tuple(train.groups().names)
    else:
        groups = groups_of(train, group_by).names
    return BalancedOrder(labels, groups)


def volume_split_summary(split: GroupedSplit) -> str:
    """The lines a volume run prints of its split: how volumes were grouped, and each side's volumes (patients)."""
    patients = split.groups.kind is GroupKind.PATIENT
    head = ("grouped by patient (patients.csv)" if patients else
            f"by volume (no {PATIENTS_FILE} in --datapath: each volume its own patient)")
    lines = [f"held-out split of whole volumes, {head}"]
    for side, indices in (("train", split.train), ("val", split.val)):
        owners = f" of {len(split.side_groups(indices))} patient(s)" if patients else ""
        names = ", ".join(split.groups.slides[i] for i in indices)
        lines.append(f"  {side}: {len(indices)} volume(s){owners}: {names}")
    return "\n".join(lines)


def manifest_sides(data: DataSpec, datapath: str | Path | None) -> bool:
    """Whether the held-out side comes from the cohort's ``split`` column (its own slides, no share or folds)."""
    return data.cohort is not None and data.cohort.has_splits and datapath == data.datapath


def split_record(split: GroupedSplit, held_out: HeldOutSpec, seed: int) -> SplitRecord:
    """What a checkpoint records of ``split``: its grouping, seed, share and the groups of each side."""
    return SplitRecord(split.groups.kind.value, seed, split.side_groups(split.train), split.side_groups(split.val),
                       held_out.val_fraction, held_out.folds, held_out.fold, held_out.group_by)


def held_out_data(data: DataSpec, held_out: HeldOutSpec, seed: int, dataset: RegionDataset,
                  exclude: Sequence[Path] = ()) -> tuple[RegionDataset, RegionDataset | None, str, GroupedSplit | None]:
    """(training set, validation set or None, the split's identity text, the split of ``dataset`` or None) for
    ``held_out`` (a share of the groups of ``dataset`` seeded by ``seed``, or ``val_datapath`` without the files
    ``exclude``)."""
    if held_out.val_fraction is not None or held_out.folds is not None or manifest_sides(data, data.datapath):
        split = dataset_split(data, held_out, seed, dataset)
        if not data.task.dense:                   # masks: images are not split by class
            knob = ("--cohort" if held_out.val_fraction is None and held_out.folds is None
                    else "--folds" if held_out.folds is not None else "--val-fraction")
            split.check_classes([dataset.label(i) for i in range(len(dataset))], data.class_names, knob)
        train, val = split_sides(split, dataset)
        grouped = "" if split.groups.kind is GroupKind.UNGROUPED else f", by {split.groups.kind.value}"
        share = (f"fold {held_out.fold} of {held_out.folds}" if held_out.folds is not None
                 else f"fraction {held_out.val_fraction:g}" if held_out.val_fraction is not None
                 else "the manifest's split column")
        text = f"{share}, seed {seed}{grouped}, {len(val)} images [{digest(split_listing(dataset, split.val))}]"
        return train, val, text, split
    if held_out.val_datapath is not None:
        require_path(held_out.val_datapath, "--val-datapath")
        held = dataset_from(data, seed, held_out.val_datapath, exclude)
        if len(held) < data.num_classes and not data.task.dense:
            raise ConfigError("--val-datapath", f"{held_out.val_datapath} holds {len(held)} images, fewer than "
                              f"the {data.num_classes} classes")
        text = (f"--val-datapath {Path(held_out.val_datapath).name}, {len(held)} images "
                f"[{digest(split_listing(held, range(len(held))))}]")
        return dataset, held, text, None
    return dataset, None, "none", None
