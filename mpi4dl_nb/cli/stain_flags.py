"""``--stain-normalize macenko|reinhard --stain-reference IMAGE`` (``train``): the stain every image is brought to,
checked before any rank talks; the request a run fits once (rank 0) and records in its checkpoints. ``evaluate``'s
``--no-stain-normalize``: read the images as stored, not through the checkpoint's normaliser."""
from __future__ import annotations

import argparse

from ..config import ConfigError
from ..data.apps import AppKind
from ..data.stain import KNOB, StainMethod, StainRequest, read_reference

METHOD = "--stain-normalize"
OFF = "--no-stain-normalize"


def add_stain_args(parser: argparse.ArgumentParser) -> None:
    """The stain normalisation flags of ``train``."""
    group = parser.add_argument_group("stain normalisation")
    group.add_argument("--stain-normalize", dest="stain_normalize", choices=[m.value for m in StainMethod],
                       default=None, help="bring every image's stain to --stain-reference's (train, evaluate and "
                                          "infer alike; recorded in the checkpoint)")
    group.add_argument("--stain-reference", dest="stain_reference", default=None, metavar="IMAGE",
                       help="the image (PNG, JPEG, TIFF tile with tissue) whose stain --stain-normalize matches")


def add_no_stain_arg(parser: argparse.ArgumentParser) -> None:
    """``evaluate``'s switch off the stain normaliser its checkpoint records (``args.stain_normalize``)."""
    parser.add_argument(OFF, dest="stain_normalize", action="store_false",
                        help="read the images as stored, not through the stain normaliser the checkpoint records "
                             "(by default they are read as the training run read them)")


def check_stain_args(args: argparse.Namespace) -> None:
    """Both flags or neither, pathology data, a readable reference: ``args.stain_request`` (None: no
    normalisation); ConfigError naming the flag."""
    args.stain_request = None
    if args.stain_normalize is None and args.stain_reference is None:
        return
    if args.stain_normalize is None:
        raise ConfigError(KNOB, f"needs {METHOD} macenko|reinhard (the method); add it, or drop {KNOB}")
    if args.stain_reference is None:
        raise ConfigError(METHOD, f"needs {KNOB} IMAGE: a tile stained as every image should look")
    if AppKind.parse(args.app) is not AppKind.MEDICAL:
        raise ConfigError(METHOD, f"normalises pathology stains; --app {args.app} has none: use --app medical (or "
                                  f"--cohort), or drop {METHOD}")
    read_reference(args.stain_reference)
    args.stain_request = StainRequest(StainMethod.parse(args.stain_normalize), args.stain_reference)
