"""``--mpp``, ``--magnification`` and ``--source-mpp`` on ``infer``'s own parser (train and evaluate take
``data/resolution.ResolutionChoice``); goes once ``infer`` generates its flags from its job."""

from __future__ import annotations

from .job_flags import FlagAdder


def add_resolution_flags(group: FlagAdder, default_help: str) -> None:
    """The resolution flags; ``default_help`` says what happens without ``--mpp``."""
    group.add_argument("--mpp", type=float, default=None,
                       help=f"µm per pixel to work at: the slide level at or finer than it, resampled to it "
                            f"({default_help})")
    group.add_argument("--magnification", type=float, default=None,
                       help="instead of --mpp: objective magnification, as 10 / M µm per pixel (40x = 0.25)")
    group.add_argument("--source-mpp", dest="source_mpp", type=float, default=None,
                       help="level 0's µm per pixel, for slides that carry none (or to correct them)")
