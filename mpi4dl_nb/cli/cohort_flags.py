"""``--cohort FILE.csv``: slides with their labels and patients from a manifest, read and checked on every rank
before any work (every problem at once, each with its line); its classes are the run's."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..config import ConfigError
from ..data.apps import AppKind
from ..data.manifest import KNOB, Cohort, read_cohort, readable
from ..data.validate import SourceKind, check_file
from .segmentation_flags import task_of


def add_cohort_args(parser: argparse.ArgumentParser) -> None:
    """The ``--cohort`` flag (``train``)."""
    parser.add_argument("--cohort", default=None, metavar="FILE.csv",
                        help="slides from a manifest: columns slide (path, relative to the file), label, optional "
                             "patient, fold, split; tiles labelled by their slide, split by patient")


def check_cohort_args(args: argparse.Namespace) -> None:
    """The manifest ``--cohort`` names, read and checked (every slide's header opened): ``args.cohort_data``
    (None without ``--cohort``); ConfigError listing every problem with its line, or naming a flag it excludes."""
    args.cohort_data = None
    if args.cohort is None:
        return
    if args.datapath is not None:
        raise ConfigError(KNOB, "gives the slides; drop --datapath (or drop --cohort to read a folder)")
    if args.app not in (AppKind.SYNTHETIC, AppKind.MEDICAL):     # synthetic: the default, not a choice
        raise ConfigError(KNOB, f"lists slides, which --app {args.app} does not read; use --app medical")
    if task_of(args).dense:
        raise ConfigError(KNOB, "labels whole slides (classification); for --task segmentation give annotated "
                                "slides with --datapath")
    args.app = AppKind.MEDICAL
    args.cohort_data = cohort_of(args.cohort, args.classes, args.image_size, args.slide_level)


def cohort_of(path: str | Path, classes: str | None, image_size: int, level: int) -> Cohort:
    """The manifest at ``path`` with the labels ``classes`` (``--classes``; None: its own), each slide opened
    through the data check's header reader at ``image_size`` and ``level``."""
    names = None if classes is None else [c.strip() for c in classes.split(",") if c.strip()]

    def probe(slide: Path) -> str | None:
        return readable(slide) or check_file(slide, SourceKind.SLIDES, image_size, level)

    return read_cohort(path, names, probe=probe)
