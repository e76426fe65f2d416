"""Set-up the ``train`` and ``evaluate`` commands share: flags to a checked plan and its layout, refused before any
rank talks (every rank alike, exit 2, one message from rank 0); a set-up refused later, once."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn, Protocol, TypeVar

from ..config import ConfigError, ParallelConfig
from .flag_names import as_flags
from .parser import CommandParser

if TYPE_CHECKING:
    from ..comm.agreement import SetupFailed
    from ..comm.protocol import Comm

__all__ = ["EXIT_SETUP", "exit_refused", "launch"]
EXIT_SETUP = 2      # a set-up refused: the exit code of every rank


class LaidOut(Protocol):
    """A checked job: its layout of the ranks."""

    @property
    def config(self) -> ParallelConfig: ...


P = TypeVar("P", bound=LaidOut)


def launch(parser: CommandParser, argv: Sequence[str] | None, checked: Callable[[argparse.Namespace], P]) -> P:
    """The plan of the flags (``checked``: the job built from them and checked), refused (exit 2, rank 0 says why)
    on a ConfigError or a rank count that does not match its layout; every rank decides alone, before any
    communication."""
    from .layout_cmd import check_world_size, launched_world, refuse

    args = parser.parse_args(argv)
    rank, size, _ = launched_world()
    try:
        plan = checked(args)
    except ConfigError as err:
        refuse(str(err), rank, size)
    check_world_size(plan.config, size, rank)
    return plan


def exit_refused(ctx: Comm, command: str, failure: SetupFailed) -> NoReturn:
    """A set-up every rank refused (comm/agreement.SetupFailed): rank 0 says why once, every rank exits 2."""
    if ctx.rank == 0:
        print(f"mpi4dl_nb {command}: error: {as_flags(str(failure))}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_SETUP) from None
