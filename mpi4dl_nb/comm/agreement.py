"""Set-up every rank agrees on: all ranks go on, or all stop with the same one message."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Sequence
from typing import TypeVar

from .protocol import Comm

T = TypeVar("T")

# the errors that are the user's input (a bad flag, a missing file): their text is the whole message;
# anything else is reported with its type, and its traceback goes to the failing rank's stderr
INPUT_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, KeyError)


class SetupFailed(ValueError):
    """Some rank refused the run during set-up; every rank raises it with the same message."""


def failure_text(error: BaseException) -> str:
    """One line for a set-up failure: the message of an input error, else the type and the message."""
    if isinstance(error, KeyError) and error.args:
        return str(error.args[0])
    if isinstance(error, INPUT_ERRORS):
        return str(error)
    return f"{type(error).__name__}: {error}"


def joined_failures(messages: Sequence[str | None]) -> str | None:
    """Every rank's failure text (None: it succeeded) as one message, naming the ranks unless all (or rank 0
    alone, or the only rank) failed alike; None when no rank failed."""
    failed: dict[str, list[int]] = {}
    for rank, message in enumerate(messages):
        if message is not None:
            failed.setdefault(message, []).append(rank)
    if not failed:
        return None
    if len(failed) == 1 and next(iter(failed.values())) in (list(range(len(messages))), [0]):
        return next(iter(failed))
    parts = []
    for message, ranks in failed.items():
        where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        parts.append(f"on {where}: {message}")
    return "; ".join(parts)


def agreed(ctx: Comm, build: Callable[[], T]) -> T:
    """``build()`` on every rank (collective); if it failed on any rank, every rank raises SetupFailed with
    the same message, so no rank waits for another that gave up."""
    error: str | None = None
    built: list[T] = []
    try:
        built.append(build())
    except Exception as err:   # any failure: the other ranks must not wait for this one
        if not isinstance(err, INPUT_ERRORS):
            traceback.print_exc(file=sys.stderr)
        error = failure_text(err)
    message = joined_failures(ctx.all_gather_object(error))
    if message is not None:
        raise SetupFailed(message)
    return built[0]
