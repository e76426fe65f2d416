"""Frame walking for the guard: which module of a spatialized model is running, and a note on a model's own error."""

from __future__ import annotations

import traceback
from collections.abc import Iterable
from pathlib import Path
from types import CodeType, FrameType

from torch import nn

from ..errors import ConfigError

PACKAGE = Path(__file__).resolve().parents[1]
TILE_FAILURE = "mpi4dl_nb: raised in"   # the start of the note a model's own error on a tile gets


def innermost_module(frames: Iterable[FrameType], names: dict[int, str]) -> str | None:
    """``layer '3.conv' (Block)``: the module of the first frame of ``frames`` (innermost first) that is the
    forward of a module in ``names``."""
    for frame in frames:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            return f"layer {names[id(owner)] or '<root>'!r} ({type(owner).__name__})"
    return None


def tile_failure_note(error: Exception, names: dict[int, str], passing_on: CodeType) -> str | None:
    """The note for a model's own error on a tile (an assertion on its input's size, a position embedding of the
    image's size, ...; raised where the guard saw no op to refuse), naming the module and the way out; None for
    errors of this package's own code (communication, spatial layers; but ``passing_on``, the guard passing a model's
    op on to torch) and errors already noted."""
    if isinstance(error, ConfigError) or any(note.startswith(TILE_FAILURE)
                                             for note in getattr(error, "__notes__", [])):
        return None
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    if any(Path(frame.f_code.co_filename).resolve().is_relative_to(PACKAGE) and frame.f_code is not passing_on
           for frame in frames):   # raised by (or through) this package's code
        return None
    where = innermost_module(reversed(frames), names)
    if where is None:
        return None
    return (f"{TILE_FAILURE} {where} on this rank's tile of the image (spatial "
            f"parallelism). If the model runs on the whole image, this module needs it whole "
            f"(a position embedding or attention bias of the image's size, a check of the "
            f"input's height and width) and cannot run on tiles. Ways out: cut the model "
            f"before it (it then runs after the spatial stage: --balance) or train this "
            f"model without spatial parallelism")
