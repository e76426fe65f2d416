"""Volumes on the command line: ``--image-size D,H,W`` (one side: images), ``--voxel-size``, and their checks.

Three numbers in ``--image-size`` make a run on volumes: ``--task segmentation`` with ``--model unet3d`` on a
``--datapath`` of ``images/`` and ``masks/`` volume files (``data/volume_dataset.py``), tiles ``--slice-method
DxRxC``. ``--voxel-size Z,Y,X`` (or one number for all three, µm) reads every volume shrunk to that voxel size,
as ``--mpp`` does slides. ``--val-fraction`` and ``--folds`` hold out whole volumes (whole patients with a
``patients.csv``, ``data/volume_groups.py``).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..config import ConfigError
from ..data.masks import IMAGES, is_mask_folder
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
    if family is not ModelFamily.UNET3D:
        takes = ("classifies volumes: training it from volume files is not built yet" if family.volumetric
                 else "takes images")
        raise ConfigError("--image-size", f"{','.join(map(str, args.image_size))} is a volume's patch but --model "
                                          f"{args.model} {takes}: use --model unet3d, or one image side")
    if args.task != "segmentation":
        raise ConfigError("--task", "volumes are segmented (a class per voxel): add --task segmentation")
    if args.datapath is None or not is_mask_folder(args.datapath):
        raise ConfigError("--datapath", "volumes are read from a folder with images/ and masks/ holding volume "
                                        "files of the same names (.tif stacks, .nii, .nii.gz)")
    for flag, given in (("--augment", args.augment), ("--mpp", args.mpp), ("--whole-slide", args.whole_slide),
                        ("--val-datapath", args.val_datapath)):
        if given:
            raise ConfigError(flag, "does not apply to volumes yet; drop it" if flag != "--mpp" else
                              "sets images' µm per pixel; volumes take --voxel-size Z,Y,X")
    if args.group_by is not None:
        raise ConfigError("--group-by", f"groups tile files by name; a split of volumes holds out whole volumes, "
                                        f"grouped by patient when --datapath has a {PATIENTS_FILE} (columns "
                                        f"volume,patient): drop --group-by")
    args.in_channels = volume_channels(Path(args.datapath))


def volume_channels(root: Path) -> int:
    """The channels of the first volume of ``root/images`` (the model's input; the data check holds the rest to it):
    1 when it cannot be read (the check then names it)."""
    for path in sorted((root.expanduser() / IMAGES).iterdir()):
        if path.is_file() and is_volume_file(path):
            try:
                return volume_info(path).channels
            except ConfigError:
                continue
    return 1
