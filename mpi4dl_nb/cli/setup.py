"""Set-up the ``train`` and ``evaluate`` commands share: flags to a checked layout (and the model fit it needs)."""
from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from ..config import ConfigError, ParallelConfig
from ..run.trainer import check_layout
from .args import config_from_args

__all__ = ["check_layout", "parse_launch"]


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
