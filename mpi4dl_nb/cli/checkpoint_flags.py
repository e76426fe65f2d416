"""--checkpoint and --checkpoint-select, shared by evaluate and infer, and the file they name, found before any rank
talks (a missing checkpoint is reported before a wrong rank count)."""
from __future__ import annotations

import argparse

from ..checkpoint.files import CheckpointSelect, select_checkpoint
from ..config import ConfigError

KNOB = "--checkpoint"


def add_checkpoint_flags(parser: argparse.ArgumentParser) -> None:
    """``--checkpoint PATH`` (required) and ``--checkpoint-select latest|best``."""
    parser.add_argument(KNOB, dest="checkpoint", required=True,
                        help="a checkpoint file, or a checkpoint directory (see --checkpoint-select)")
    parser.add_argument("--checkpoint-select", dest="checkpoint_select", choices=CheckpointSelect.values(),
                        default=CheckpointSelect.LATEST.value,
                        help="which checkpoint of a directory: latest (the newest) or best (the one "
                             "'train --keep-best' kept)")


def chosen_checkpoint(args: argparse.Namespace) -> str:
    """The checkpoint file ``--checkpoint``/``--checkpoint-select`` name; ConfigError saying what is missing."""
    try:
        return str(select_checkpoint(args.checkpoint, args.checkpoint_select))
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(KNOB, str(err).removeprefix(f"{KNOB} ")) from None
