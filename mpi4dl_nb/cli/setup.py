"""Set-up the ``train`` and ``evaluate`` commands share: flags to a checked layout (and the model fit it needs)."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

from ..config import ConfigError, ParallelConfig
from ..run.trainer import check_layout
from .args import config_from_args

if TYPE_CHECKING:
    from ..comm.agreement import SetupFailed
    from ..comm.protocol import Comm

__all__ = ["EXIT_SETUP", "check_layout", "exit_refused", "parse_launch"]
EXIT_SETUP = 2      # a set-up refused: the exit code of every rank


def parse_launch(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                 check: Callable[[argparse.Namespace], None]) -> tuple[argparse.Namespace, ParallelConfig]:
    """The flags and their layout, refused (exit 2, rank 0 says why) on a ConfigError of ``check`` or a rank
    count that does not match; every rank decides alone, before any communication."""
    from .layout_cmd import check_world_size, launched_world, refuse

    args = parser.parse_args(argv)
    rank, size, _ = launched_world()
    try:
        cfg = config_from_args(args)
        check(args)
    except ConfigError as err:
        refuse(str(err), rank, size)
    check_world_size(cfg, size, rank)
    return args, cfg


def exit_refused(ctx: Comm, command: str, failure: SetupFailed) -> NoReturn:
    """A set-up every rank refused (comm/agreement.SetupFailed): rank 0 says why once, every rank exits 2."""
    if ctx.rank == 0:
        print(f"mpi4dl_nb {command}: error: {failure}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_SETUP) from None
