"""The held-out data flags of train and evaluate (``--val-fraction``, ``--val-datapath``; for train also
``--eval-every`` and ``--log-dir``), their checks, and the numeric-range check of every command's numbers."""
from __future__ import annotations

import argparse
import math

from ..config import ConfigError
from ..data.apps import AppKind

DTYPES = ("float32", "float64")

# flag, attribute, least value, largest value (None: unbounded), whether the least is allowed
NUMERIC_FLAGS: tuple[tuple[str, str, float, float | None, bool], ...] = (
    ("--batch-size", "batch_size", 1, None, True),
    ("--image-size", "image_size", 1, None, True),
    ("--num-epochs", "num_epochs", 1, None, True),
    ("--num-classes", "num_classes", 1, None, True),
    ("--num-layers", "num_layers", 1, None, True),
    ("--num-filters", "num_filters", 1, None, True),
    ("--num-samples", "num_samples", 1, None, True),
    ("--steps", "steps", 1, None, True),
    ("--seed", "seed", 0, None, True),
    ("--slide-level", "slide_level", 0, None, True),
    ("--min-tissue", "min_tissue", 0, 1, True),
    ("--lr", "lr", 0, None, False),
    ("--momentum", "momentum", 0, 1, True),
    ("--weight-decay", "weight_decay", 0, None, True),
    ("--lr-gamma", "lr_gamma", 0, 1, False),
    ("--lr-step-size", "lr_step_size", 1, None, True),
    ("--keep-checkpoints", "keep_checkpoints", 1, None, True),
    ("--checkpoint-every", "checkpoint_every", 0, None, True),
    ("--step-timeout", "step_timeout", 0, None, True),
    ("--eval-every", "eval_every", 0, None, True),
)


def add_evaluation_args(parser: argparse.ArgumentParser, training: bool = True) -> None:
    """Held-out data flags (and, for ``train``, when to evaluate and where to log metrics)."""
    g = parser.add_argument_group("evaluation")
    g.add_argument("--val-fraction", dest="val_fraction", type=float, default=None, metavar="F",
                   help="hold out this share of the patients (slides, tiles) of each class for validation: whole "
                        "groups on one side, seeded by --seed, stratified by label")
    g.add_argument("--val-datapath", dest="val_datapath", default=None, metavar="DIR",
                   help="validation images from another folder/slide(s) (same layout as --datapath)")
    g.add_argument("--group-by", dest="group_by", default=None, metavar="REGEX",
                   help="tile folders: the slide of each tile file, the first group of REGEX on its name (default: "
                        "TCGA slide ids and <slide>_<x>_<y> names); a slide's tiles stay on one side")
    g.add_argument("--folds", type=int, default=None, metavar="K",
                   help="K-fold cross-validation by patient (slide, image), stratified by label, seeded; a cohort's "
                        "fold column when it has one")
    g.add_argument("--fold", type=int, default=None, metavar="I",
                   help="the fold held out (0..K-1); train without it runs every fold in turn, each in "
                        "<checkpoint-dir>/fold-I")
    if not training:
        return
    g.add_argument("--eval-every", dest="eval_every", type=int, default=0, metavar="N",
                   help="evaluate every N steps (always at each epoch end and at the end of the run)")
    g.add_argument("--log-dir", dest="log_dir", default=None, metavar="DIR",
                   help="write metrics.jsonl (one line per step and per evaluation) and, with "
                        "tensorboard installed, TensorBoard events here")


def check_numbers(args: argparse.Namespace) -> None:
    """Every numeric flag the command has in its range (finite), else ConfigError naming the flag and the range."""
    given = vars(args)
    for flag, name, least, most, closed in NUMERIC_FLAGS:
        value = given.get(name)
        if value is None or isinstance(value, tuple):     # a volume's D,H,W: each side checked as it is parsed
            continue
        low_ok = value >= least if closed else value > least
        if not math.isfinite(value) or not low_ok or (most is not None and value > most):
            bound = f"{'>=' if closed else '>'} {least:g}" + (f" and <= {most:g}" if most is not None else "")
            raise ConfigError(flag, f"must be a number {bound}, got {value:g}")


def check_held_out_flags(args: argparse.Namespace) -> None:
    """--val-fraction in (0, 1), not together with --val-datapath; --val-datapath only for data read from files."""
    fraction = args.val_fraction
    if fraction is not None and not (0.0 < fraction < 1.0):
        raise ConfigError("--val-fraction", f"must lie strictly between 0 and 1, got {fraction:g}")
    check_fold_args(args)
    if fraction is not None and args.val_datapath is not None:
        raise ConfigError("--val-fraction", "give --val-fraction (held out of --datapath) or --val-datapath "
                          "(another folder), not both")
    if args.val_datapath is not None and args.app is not None and not AppKind.parse(args.app).reads_datapath:
        raise ConfigError("--val-datapath", f"--app {args.app} reads no files; use --val-fraction")


def check_evaluation_args(args: argparse.Namespace) -> None:
    """``train``: the held-out flags, and --eval-every only with held-out data."""
    check_held_out_flags(args)
    if args.eval_every and args.val_fraction is None and args.val_datapath is None and args.folds is None:
        raise ConfigError("--eval-every", "needs validation data: add --val-fraction F or --val-datapath DIR")


def check_fold_args(args: argparse.Namespace) -> None:
    """``--folds K`` (>= 2, instead of --val-fraction/--val-datapath) and ``--fold I`` (0..K-1, with --folds)."""
    folds, fold = args.folds, args.fold
    if fold is not None and folds is None:
        raise ConfigError("--fold", "picks one of --folds K; add --folds")
    if folds is None:
        return
    if folds < 2:
        raise ConfigError("--folds", f"must be >= 2, got {folds}")
    if fold is not None and not 0 <= fold < folds:
        raise ConfigError("--fold", f"must be one of 0..{folds - 1} for --folds {folds}, got {fold}")
    if args.val_fraction is not None or args.val_datapath is not None:
        raise ConfigError("--folds", "holds out each fold in turn; drop --val-fraction/--val-datapath")
