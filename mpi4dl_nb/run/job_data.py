"""The data of a job: the dataset its DataSpec names (images with class labels, or with masks), the files the data
check reads, the held-out split, the pixel counts of balanced weights."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ..config import ConfigError
from ..data.apps import AppKind
from ..data.dataset import RegionDataset
from ..data.groups import GroupKind, Groups, dataset_groups, group_pattern
from ..data.masks import MaskDataset, is_mask_folder, pixel_counts
from ..data.pathology import folder_files, require_path
from ..data.validate import DataSources, SourceKind, find_sources
from ..evaluation.split import Subset, grouped_split, split_listing, stratified_split
from .identity import digest
from .job import ClassWeights, DataSpec, HeldOutSpec

Checker = Callable[[Path], str | None]


def dataset_from(data: DataSpec, seed: int, datapath: str | Path | None, exclude: Sequence[Path] = ()) -> RegionDataset:
    """The dataset ``data`` names, read from ``datapath`` (without the files ``exclude``; class folders labelled
    in the order of ``data.class_order`` when set; generated images seeded by ``seed``)."""
    from ..data import make_dataset

    if data.task.dense:
        return segmentation_dataset(data, datapath, exclude)
    return make_dataset(data.app, data.image_size, data.num_classes, datapath=datapath, seed=seed,
                        num_samples=data.num_samples, slide_level=data.slide_level, min_tissue=data.min_tissue,
                        exclude=exclude, classes=data.class_order, mpp=data.mpp, source_mpp=data.source_mpp)


def segmentation_dataset(data: DataSpec, datapath: str | Path | None, exclude: Sequence[Path] = ()) -> MaskDataset:
    """The images with masks ``datapath`` names (without the files ``exclude``)."""
    from ..data.annotated_slides import AnnotatedSlideDataset
    from ..data.masks import MaskFolderDataset, image_files
    from ..data.sample import IHCMaskDataset
    from ..data.validate import excluded

    if datapath is None:
        return IHCMaskDataset(data.image_size)
    root = require_path(datapath)
    if is_mask_folder(root):
        return MaskFolderDataset(root, data.image_size, data.num_classes, files=excluded(image_files(root), exclude),
                                 mpp=data.mpp, source_mpp=data.source_mpp)
    slides = [root] if root.is_file() else slide_files(root, exclude)
    return AnnotatedSlideDataset(slides, data.image_size, data.class_names, level=data.slide_level,
                                 min_tissue=data.min_tissue, mpp=data.mpp, source_mpp=data.source_mpp)


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
    if not data.task.dense:
        return find_sources(data.app, datapath, knob), None
    if datapath is None:
        return DataSources(None), None
    from ..data.annotated_slides import annotation_problems
    from ..data.masks import check_pair, image_files
    from ..data.validate import check_file

    root = require_path(datapath, knob)
    size, classes, ignore = data.image_size, data.num_classes, data.ignore_index
    if is_mask_folder(root):
        return (DataSources(SourceKind.TILES, tuple(image_files(root))),
                lambda image: check_pair(image, size, classes, ignore))
    sources = find_sources(AppKind.MEDICAL, datapath, knob)
    if sources.kind is not SourceKind.SLIDES:
        raise ConfigError(knob, f"{datapath} holds neither images/ with masks/ nor slides with QuPath annotations "
                                f"(<slide>.geojson beside each) for --task segmentation")
    names, level = data.class_names, data.slide_level
    return sources, lambda slide: (check_file(slide, SourceKind.SLIDES, size, level)
                                   or annotation_problems(slide, names))


def label_counts(data: DataSpec, weights: ClassWeights, dataset: RegionDataset) -> list[int] | None:
    """A segmentation run's pixels per class when ``balanced`` weights need them (reads every mask), zeros when
    they do not; None for classification (the caller counts images)."""
    if not data.task.dense:
        return None
    if not isinstance(weights, str) or not isinstance(dataset, MaskDataset):
        return [0] * data.num_classes
    return pixel_counts(dataset, data.num_classes, data.ignore_index)


def held_out_split(dataset: RegionDataset, fraction: float, seed: int, classes: int,
                   group_by: str | None = None) -> tuple[Subset, Subset]:
    """(training images, held-out images): a seeded share ``fraction`` of each of ``classes`` classes held out,
    whole slides or patients at a time when the data says them (``split_held_out``)."""
    split = split_held_out(dataset, fraction, seed, classes, group_by)
    return split.train, split.val


@dataclass(frozen=True)
class HeldOutSplit:
    """A held-out split: both sides, the groups it kept whole (or why it could not) and each side's groups."""

    train: Subset
    val: Subset
    groups: Groups

    def side_groups(self, subset: Subset) -> list[str]:
        """The groups with images on ``subset``'s side, sorted (none when ungrouped)."""
        keys = self.groups.keys
        return [] if keys is None else sorted({keys[i] for i in subset.indices})

    def describe(self) -> str:
        """``grouped by slide (6 slides): 2 held out, 4 trained on`` (or why the images are split one by one)."""
        if not self.groups.grouped:
            return self.groups.describe()
        return (f"{self.groups.describe()}: {len(self.side_groups(self.val))} held out, "
                f"{len(self.side_groups(self.train))} trained on")


def split_held_out(dataset: RegionDataset, fraction: float, seed: int, classes: int,
                   group_by: str | None = None) -> HeldOutSplit:
    """The held-out split of ``dataset``: whole groups (``data/groups.py``) when every class has two or more, else
    a share of each class's images (stratified_split), the reason said in ``groups``."""
    labels = [dataset.label(i) for i in range(len(dataset))]
    groups = dataset_groups(dataset, group_pattern(group_by))
    if groups.keys is not None:
        found = grouped_split(labels, groups.keys, fraction, seed, classes)
        if found is not None:
            return HeldOutSplit(Subset(dataset, found[0]), Subset(dataset, found[1]), groups)
        groups = Groups(GroupKind.NONE, why_not=f"{groups.describe()}, too few to hold out whole ones of every "
                                                f"class at --val-fraction {fraction:g}")
    train, held = stratified_split(labels, fraction, seed, classes)
    return HeldOutSplit(Subset(dataset, train), Subset(dataset, held), groups)


class HeldOutData(NamedTuple):
    """The training set, the validation set (None: no evaluation), the split's identity text (what a resume
    compares) and what to tell the user of it (how it was grouped, images per class on each side)."""

    train: RegionDataset
    val: RegionDataset | None
    identity: str
    report: str


def held_out_data(data: DataSpec, held_out: HeldOutSpec, seed: int, dataset: RegionDataset,
                  exclude: Sequence[Path] = ()) -> HeldOutData:
    """The held-out data ``held_out`` names: a share of ``dataset`` seeded by ``seed`` (whole slides or patients at
    a time where the data says them), or ``val_datapath`` without the files ``exclude``."""
    classes = 1 if data.task.dense else data.num_classes    # masks: images are not split by class
    if held_out.val_fraction is not None:
        split = split_held_out(dataset, held_out.val_fraction, seed, classes, held_out.group_by)
        text = (f"fraction {held_out.val_fraction:g}, seed {seed}, {len(split.val)} images "
                f"[{digest(split_listing(dataset, split.val.indices))}]")
        if split.groups.grouped:      # a split of whole groups is another split: its identity says so
            text += f", {split.describe()}; held out: {', '.join(short_names(split.side_groups(split.val)))}"
        report = f"{split.describe()}; {side_counts(split.train, split.val, data)}"
        return HeldOutData(split.train, split.val, text, report)
    if held_out.val_datapath is not None:
        require_path(held_out.val_datapath, "--val-datapath")
        held = dataset_from(data, seed, held_out.val_datapath, exclude)
        if len(held) < data.num_classes and not data.task.dense:
            raise ConfigError("--val-datapath", f"{held_out.val_datapath} holds {len(held)} images, fewer than "
                              f"the {data.num_classes} classes")
        text = (f"--val-datapath {Path(held_out.val_datapath).name}, {len(held)} images "
                f"[{digest(split_listing(held, range(len(held))))}]")
        return HeldOutData(dataset, held, text, f"{held_out.val_datapath}; {side_counts(dataset, held, data)}")
    return HeldOutData(dataset, None, "none", "")


def side_counts(train: RegionDataset, val: RegionDataset, data: DataSpec) -> str:
    """``train 30 images (12, 18), held out 10 (4, 6)``: images per class on each side (images only, for masks)."""
    def counted(side: RegionDataset) -> str:
        if data.task.dense:
            return f"{len(side)}"
        per_class = [0] * data.num_classes
        for index in range(len(side)):
            per_class[side.label(index)] += 1
        return f"{len(side)} ({', '.join(map(str, per_class))} per class)"
    return f"train {counted(train)} images, held out {counted(val)}"


def short_names(groups: Sequence[str]) -> list[str]:
    """Group keys as a person reads them: a slide's file name without its folder."""
    return [Path(key).name if "/" in key else key for key in groups]
