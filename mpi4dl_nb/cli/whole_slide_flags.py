"""``train --whole-slide``: a sample per slide (its tissue centred on one canvas of ``--image-size`` pixels at
``--mpp``), and the checks that it has slide labels to learn from."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..config import ConfigError
from ..data.pathology import folder_files
from .segmentation_flags import task_of

KNOB = "--whole-slide"
LABELS = ("--cohort FILE.csv (columns slide,label[,patient]) or --datapath with class folders of slides "
          "(<datapath>/<class>/<slide>)")


def add_whole_slide_args(parser: argparse.ArgumentParser) -> None:
    """The ``--whole-slide`` flag."""
    parser.add_argument(KNOB, dest="whole_slide", action="store_true",
                        help="a sample per slide: its tissue centred on one --image-size canvas at --mpp (each "
                             "spatial rank reads only its tile), labelled by the slide; needs " + LABELS)


def check_whole_slide_args(args: argparse.Namespace) -> None:
    """ConfigError when ``--whole-slide`` has no slide labels to learn from or another task."""
    if not args.whole_slide:
        return
    if task_of(args).dense:
        raise ConfigError(KNOB, "learns slide labels (classification); drop --task segmentation")
    if args.cohort is not None:
        return                                    # the manifest gives the labels (checked with --cohort)
    if args.datapath is None:
        raise ConfigError(KNOB, f"needs slide labels: {LABELS}")
    root = Path(args.datapath).expanduser()
    if root.is_file():
        raise ConfigError(KNOB, f"{args.datapath} is one slide, without a label to learn; give {LABELS}")
    if not root.is_dir():
        return                                    # the data check names the missing path
    files, slides = folder_files(root)
    if not slides:
        raise ConfigError(KNOB, f"{args.datapath} holds image tiles, not slides; give {LABELS}")
    if any(len(path.relative_to(root).parts) == 1 for path in files):
        raise ConfigError(KNOB, f"{args.datapath} has slides directly in the folder, without a class folder to "
                                f"label them; give {LABELS}")
