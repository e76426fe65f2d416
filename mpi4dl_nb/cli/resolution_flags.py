"""--mpp, --magnification and --source-mpp, shared by train, evaluate and infer: the resolution to work at and a
slide's (or an image's) own, checked."""

from __future__ import annotations

import argparse

from ..errors import ConfigError


def add_resolution_flags(group: argparse._ActionsContainer, default_help: str) -> None:
    """The resolution flags; ``default_help`` says what happens without ``--mpp``."""
    group.add_argument("--mpp", type=float, default=None,
                       help=f"µm per pixel to work at: the slide level at or finer than it, resampled to it "
                            f"({default_help})")
    group.add_argument("--magnification", type=float, default=None,
                       help="instead of --mpp: objective magnification, as 10 / M µm per pixel (40x = 0.25)")
    group.add_argument("--source-mpp", dest="source_mpp", type=float, default=None,
                       help="level 0's µm per pixel, for slides that carry none (or to correct them)")


def resolution_of(args: argparse.Namespace) -> tuple[float | None, float | None]:
    """(µm per pixel to read at, level 0's µm per pixel given) of the flags: ``--mpp`` or ``--magnification``,
    ``--source-mpp``; ConfigError naming a bad one."""
    from ..data.resolution import target_mpp

    source = args.source_mpp
    if source is not None and not source > 0:
        raise ConfigError("--source-mpp", f"must be > 0 (µm per pixel), got {source}")
    return target_mpp(args.mpp, args.magnification), source


def check_resolution_flags(args: argparse.Namespace) -> None:
    """``train``, before any rank talks: the resolution flags valid, and given only with images to apply to."""
    target, source = resolution_of(args)
    if (target is not None or source is not None) and args.datapath is None and args.cohort is None:
        flag = next(f for f, value in (("--mpp", args.mpp), ("--magnification", args.magnification),
                                       ("--source-mpp", args.source_mpp)) if value is not None)
        raise ConfigError(flag, "applies to images read from --datapath or --cohort (tiles, images with masks, "
                                "slides); the bundled IHC sample and generated images carry no resolution")
