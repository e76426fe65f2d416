"""Data checked before the first step: every rank checks a share of the files, rank 0 reports the bad ones once."""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from ..data.validate import DataSources, check_files

if TYPE_CHECKING:
    from ..comm.protocol import Comm

SHOWN = 10                   # bad files named in the message
PROGRESS_MIN_FILES = 200     # smaller datasets are checked without a progress line
PROGRESS_SECONDS = 2.0


class DataRole(Enum):
    """Which data a check is about: the flag naming its path and what the run does with it."""

    TRAINING = ("--datapath", "train", "trained", "training")
    VALIDATION = ("--val-datapath", "validate", "validated", "validating")

    def __init__(self, flag: str, verb: str, done: str, doing: str) -> None:
        self.flag, self.verb, self.done, self.doing = flag, verb, done, doing


@dataclass(frozen=True)
class DataReport:
    """The outcome of the check: how many files, and the unusable ones with why (sorted by path)."""

    total: int
    bad: tuple[tuple[str, str], ...]

    @property
    def bad_paths(self) -> list[Path]:
        return [Path(p) for p, _ in self.bad]

    def listing(self) -> str:
        lines = [f"  {path}: {why}" for path, why in self.bad[:SHOWN]]
        if len(self.bad) > SHOWN:
            lines.append(f"  ... and {len(self.bad) - SHOWN} more")
        return "\n".join(lines)

    def refusal(self, datapath: str | Path, role: DataRole = DataRole.TRAINING) -> str:
        usable = self.total - len(self.bad)
        way_out = (f"fix or remove them, or pass --skip-bad-files to {role.verb} on the other {usable}"
                   if usable else f"none is usable; check {role.flag}, --image-size and --slide-level")
        return (f"{len(self.bad)} of {self.total} files in {role.flag} {str(datapath)!r} cannot be "
                f"{role.done} on:\n{self.listing()}\n{way_out}")

    def warning(self, role: DataRole = DataRole.TRAINING) -> str:
        where = "" if role is DataRole.TRAINING else f" in {role.flag}"
        return (f"skipping {len(self.bad)} of {self.total} files{where} (--skip-bad-files); {role.doing} on "
                f"the other {self.total - len(self.bad)}:\n{self.listing()}")


class Progress:
    """Rank 0's progress line for a large check (its own share stands for every rank's)."""

    def __init__(self, total: int, world: int, enabled: bool, stream: TextIO) -> None:
        self.total, self.world, self.stream = total, world, stream
        self.enabled = enabled and total >= PROGRESS_MIN_FILES
        self.last = time.monotonic()

    def __call__(self, done: int, share: int) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < PROGRESS_SECONDS and done < share):
            return
        self.last = now
        estimate = min(self.total, round(self.total * done / max(share, 1)))
        self.stream.write(f"mpi4dl_nb train: checking data: ~{estimate}/{self.total} files "
                          f"({self.world} ranks in parallel)\n")
        self.stream.flush()


def check_data(ctx: Comm, sources: DataSources, image_size: int, level: int = 0,
               progress: bool = True, stream: TextIO | None = None,
               checker: Callable[[Path], str | None] | None = None) -> DataReport:
    """Collective: each rank checks every ``world``-th file (``checker``: how, default ``check_file``); every rank
    gets the same report."""
    if sources.kind is None or not sources.files:
        return DataReport(len(sources.files), ())
    mine = list(sources.files[ctx.rank::ctx.world_size])
    bar = Progress(len(sources.files), ctx.world_size, progress and ctx.rank == 0,
                   stream if stream is not None else sys.stderr)
    found = check_files(mine, sources.kind, image_size, level, progress=bar, checker=checker)
    gathered = ctx.all_gather_object([(str(p), why) for p, why in found])
    bad = tuple(sorted(item for part in gathered for item in part))
    return DataReport(len(sources.files), bad)
