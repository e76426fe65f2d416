"""Volumes on the command line: ``--image-size D,H,W`` (one side: images), ``--voxel-size``, and their checks.

Three numbers in ``--image-size`` make a run on volumes: ``--task segmentation`` with ``--model unet3d`` on a
``--datapath`` of ``images/`` and ``masks/`` volume files (``data/volume_dataset.py``), or ``--task classification``
with ``--model resnet3d`` on class folders of volume files (``data/volume_classes.py``), tiles ``--slice-method
DxRxC``. ``--voxel-size Z,Y,X`` (or one number for all three, µm) reads every volume shrunk to that voxel size,
as ``--mpp`` does slides. ``--val-fraction`` and ``--folds`` hold out whole volumes (whole patients with a
``patients.csv``, ``data/volume_groups.py``).
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ..config import ConfigError
from ..data.apps import AppKind
from ..data.masks import is_mask_folder
from ..data.volume_classes import class_volume_files
from ..data.volume_dataset import volume_images
from ..data.volume_files import is_volume_file, volume_info
from ..data.volume_groups import PATIENTS_FILE
from ..models.spec import ModelFamily


def voxel_size_arg(text: str) -> tuple[float, float, float]:
    """``--voxel-size``: ``Z,Y,X`` or one number for all three (µm, > 0); ArgumentTypeError otherwise."""
    try:
        sizes = [float(p) for p in str(text).split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give Z,Y,X or one number (µm)") from None
    if len(sizes) not in (1, 3) or not all(s > 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: give Z,Y,X or one number, each > 0 (µm)")
    z, y, x = sizes * 3 if len(sizes) == 1 else sizes
    return z, y, x


def add_volume_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--voxel-size`` (``--image-size`` takes ``D,H,W`` itself)."""
    parser.add_argument("--voxel-size", dest="voxel_size", type=voxel_size_arg, default=None, metavar="Z,Y,X",
                        help="volumes (--image-size D,H,W): read each at this voxel size in µm (one number: "
                             "isotropic), shrunk from its own (TIFF/NIfTI tags) by the mean of each footprint "
                             "(labels: the majority); default as stored")


def is_volume_run(args: argparse.Namespace) -> bool:
    """Whether ``--image-size`` names a volume's patch (D,H,W)."""
    return isinstance(args.image_size, tuple)


def check_volume_args(args: argparse.Namespace) -> None:
    """ConfigError naming the flag when the volume flags do not fit the model, task and data."""
    family = ModelFamily.parse(args.model)
    if not is_volume_run(args):
        if family.volumetric:
            raise ConfigError("--image-size", f"--model {family} trains on volumes: give --image-size D,H,W (the "
                                              f"patch's depth, height and width in voxels)")
        if args.voxel_size is not None:
            raise ConfigError("--voxel-size", "applies to volumes (--image-size D,H,W); images use --mpp")
        return
    if not family.volumetric:
        raise ConfigError("--image-size", f"{','.join(map(str, args.image_size))} is a volume's patch but --model "
                                          f"{args.model} takes images: use --model unet3d (segmentation) or "
                                          f"resnet3d (classification), or one image side")
    check_volume_task(args, family)
    for flag, given in (("--augment", args.augment), ("--mpp", args.mpp), ("--whole-slide", args.whole_slide),
                        ("--val-datapath", args.val_datapath)):
        if given:
            raise ConfigError(flag, "does not apply to volumes yet; drop it" if flag != "--mpp" else
                              "sets images' µm per pixel; volumes take --voxel-size Z,Y,X")
    if args.group_by is not None:
        raise ConfigError("--group-by", f"groups tile files by name; a split of volumes holds out whole volumes, "
                                        f"grouped by patient when --datapath has a {PATIENTS_FILE} (columns "
                                        f"volume,patient): drop --group-by")
    root = Path(args.datapath).expanduser()
    args.in_channels = volume_channels(volume_images(root) if family.dense else class_volume_files(root))


def check_volume_task(args: argparse.Namespace, family: ModelFamily) -> None:
    """ConfigError naming the flag when ``--task`` or ``--datapath`` do not fit ``--model`` on volumes: unet3d
    segments ``images/`` with ``masks/``, resnet3d classifies class folders of volumes (``--app medical`` implied)."""
    if family.dense and args.task != "segmentation":
        raise ConfigError("--task", f"--model {family} segments volumes (a class per voxel): add --task "
                                    f"segmentation, or classify whole volumes with --model resnet3d")
    if not family.dense and args.task != "classification":
        raise ConfigError("--task", f"--model {family} classifies whole volumes: use --task classification, or "
                                    f"segment them with --model unet3d")
    if family.dense and (args.datapath is None or not is_mask_folder(args.datapath)):
        raise ConfigError("--datapath", "volumes are segmented from a folder with images/ and masks/ holding volume "
                                        "files of the same names (.tif stacks, .nii, .nii.gz)")
    if not family.dense and (args.datapath is None or not Path(args.datapath).expanduser().is_dir()):
        raise ConfigError("--datapath", "volumes are classified from a folder of class folders of volume files "
                                        "(<class>/<name>.tif stacks, .nii, .nii.gz)")
    if not family.dense and args.spatial_size > 0 and args.spatial_size >= args.split_size:
        raise ConfigError("--spatial-size", f"--model {family} gives one class per volume, a loss that cannot be "
                                            f"taken on tiles: keep a layer stage after the spatial ones (e.g. "
                                            f"--split-size {args.spatial_size + 1} --spatial-size {args.spatial_size})")
    if AppKind.parse(args.app) is AppKind.CIFAR:
        raise ConfigError("--app", "CIFAR-10 holds images, not volumes: drop --app (volumes are read from --datapath)")
    args.app = AppKind.MEDICAL                   # volume files of --datapath, as a segmentation run reads them


def volume_channels(files: Sequence[Path]) -> int:
    """The channels of the first of ``files`` that is a readable volume (the model's input; the data check holds the
    rest to it): 1 when none can be read (the check then names them)."""
    for path in files:
        if is_volume_file(path):
            try:
                return volume_info(path).channels
            except ConfigError:
                continue
    return 1
