"""``--cohort FILE.csv``: slides with their labels and patients from a manifest, read and checked on every rank
before any work (every problem at once, each with its line); its classes are the run's."""
from __future__ import annotations

import argparse
import os
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
    parser.set_defaults(cohort_data=None)        # the checked manifest, once check_cohort_args has read it


def add_level_args(parser: argparse.ArgumentParser) -> None:
    """``evaluate``'s slide- and patient-level flags: the manifest, how tiles aggregate, the per-slide CSV."""
    add_cohort_args(parser)
    parser.add_argument("--aggregate", default="mean", metavar="mean|max|top-k",
                        help="a slide's probability per class from its tiles': their mean, max, or the mean of the "
                             "k highest (top-k: 5, or top-N); a patient's from its slides' the same way")
    parser.add_argument("--slide-csv", dest="slide_csv", default=None, metavar="FILE.csv",
                        help="write each slide's patient, label, prediction, tiles and class probabilities here")


def check_evaluate_cohort(args: argparse.Namespace) -> None:
    """``evaluate --cohort``: the manifest read and its slides opened (labels are checked against the checkpoint's
    classes once it is loaded): ``args.cohort_data``; ``--aggregate`` parsed."""
    from ..evaluation.aggregate import Aggregation

    Aggregation.parse(args.aggregate)
    if args.slide_csv is not None:
        folder = Path(args.slide_csv).expanduser().absolute().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise ConfigError("--slide-csv", f"{folder} is not a writable folder; choose another path")
    args.cohort_data = None
    if args.cohort is None:
        return
    if args.datapath is not None or args.app is not None and args.app is not AppKind.MEDICAL:
        raise ConfigError(KNOB, "gives the slides; drop --datapath/--app")
    args.cohort_data = cohort_of(args.cohort, None, 1, 0)


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
    size = 1 if args.whole_slide else args.image_size         # a canvas may be larger than its slide
    args.cohort_data = cohort_of(args.cohort, args.classes, size, args.slide_level)
    if args.cohort_data.has_splits:
        for flag, value in (("--val-fraction", args.val_fraction), ("--folds", args.folds),
                            ("--val-datapath", args.val_datapath)):
            if value is not None:
                raise ConfigError(flag, "the cohort's split column already places each patient (train, val, "
                                        f"test); drop {flag}, or drop the column to split by {flag}")


def cohort_of(path: str | Path, classes: str | None, image_size: int, level: int) -> Cohort:
    """The manifest at ``path`` with the labels ``classes`` (``--classes``; None: its own), each slide opened
    through the data check's header reader at ``image_size`` and ``level``."""
    names = None if classes is None else [c.strip() for c in classes.split(",") if c.strip()]

    def probe(slide: Path) -> str | None:
        return readable(slide) or check_file(slide, SourceKind.SLIDES, image_size, level)

    return read_cohort(path, names, probe=probe, every_class=True)    # --classes: each labels a slide
