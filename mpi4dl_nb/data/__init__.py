"""Datasets with region reads (synthetic, pathology tiles/slides, CIFAR-10, the IHC sample) and ``make_dataset``."""
from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

from .apps import AppKind
from .cifar import Cifar10Dataset
from .dataset import Batcher, Box, RegionDataset, full_box
from .pathology import SlideDataset, TileFolderDataset, open_pathology
from .sample import IHCSampleDataset, ihc_image
from .synthetic import SyntheticDataset
from .tissue_mask import TissueMethod

APPS = AppKind.values()


def make_dataset(app: AppKind | str, image_size: int, num_classes: int, *, datapath: str | Path | None = None,
                 seed: int = 0, num_samples: int = 1024, slide_level: int = 0,
                 min_tissue: float = 0.5, exclude: Collection[Path] = (),
                 classes: Sequence[str] | None = None, mpp: float | None = None,
                 source_mpp: float | None = None, tissue: TissueMethod = TissueMethod.SATURATION) -> RegionDataset:
    """The dataset of ``--app``: ``medical`` (``datapath`` tiles/slides, else the IHC sample),
    ``cifar`` (binary batches in ``datapath``) or ``synthetic``; ``exclude`` drops files; ``classes``
    names the class folders of ``medical`` data in label order (default: sorted)."""
    app = AppKind.parse(app)
    if app is AppKind.SYNTHETIC:
        return SyntheticDataset(image_size, num_classes, num_samples, seed=seed)
    if app is AppKind.MEDICAL:
        if datapath is None:
            return IHCSampleDataset(image_size, num_classes=num_classes)
        return open_pathology(datapath, image_size, level=slide_level, min_tissue=min_tissue,
                              num_classes=num_classes, exclude=exclude, classes=classes, mpp=mpp,
                              source_mpp=source_mpp, tissue=tissue)
    if datapath is None:
        raise FileNotFoundError("--app cifar needs --datapath: a folder with the CIFAR-10 "
                                "binary batches (data_batch_1.bin ...)")
    return Cifar10Dataset(datapath, image_size, num_classes=num_classes)


__all__ = ["APPS", "AppKind", "Batcher", "Box", "Cifar10Dataset", "IHCSampleDataset", "RegionDataset",
           "SlideDataset", "SyntheticDataset", "TileFolderDataset", "full_box", "ihc_image",
           "make_dataset", "open_pathology"]
