"""Pre-emption: SIGTERM or SIGUSR1 (a time limit, ``scancel``, ``sbatch --signal``) ends training after the step in
flight on every rank, with a checkpoint and the exit code a requeued job recognises (EXIT_PREEMPTED)."""
from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..comm.protocol import Comm

EXIT_PREEMPTED = 7
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None   # what signal.signal returns


@dataclass(frozen=True)
class Preempted:
    """A run stopped by a signal: which one, after which step, and the checkpoint written then (None: none could be,
    the run has no checkpoint directory)."""

    signal: signal.Signals
    step: int
    checkpoint: Path | None

    def message(self) -> str:
        """``pre-empted (SIGTERM) after step 17: checkpoint <path>; resume with --resume latest``."""
        saved = (f"checkpoint {self.checkpoint}; resume with --resume latest" if self.checkpoint is not None else
                 "no checkpoint could be written (no --checkpoint-dir); rerun with --checkpoint-dir to resume next "
                 "time")
        return f"pre-empted ({self.signal.name}) after step {self.step}: {saved}"


class StopSignals:
    """While training, ``STOP_SIGNALS`` only mark that the job is asked to stop (a handler that sets a flag); the
    previous handlers come back at ``restore`` (or ``__exit__``). Installed only from the main thread (the only one
    Python delivers signals to); elsewhere nothing is installed and no signal is ever seen."""

    def __init__(self, signals: Sequence[signal.Signals] = STOP_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.received: signal.Signals | None = None     # the first stop signal this rank got
        self._previous: dict[signal.Signals, Handler] = {}

    def install(self) -> StopSignals:
        """Mark instead of the previous handlers (from the main thread; elsewhere nothing changes); a signal an
        earlier ``StopSignals`` marked (the command's, during set-up) counts as received here."""
        if threading.current_thread() is threading.main_thread():
            for number in self.signals:
                self._previous[number] = signal.signal(number, self._mark)
                earlier = getattr(self._previous[number], "__self__", None)
                if isinstance(earlier, StopSignals) and self.received is None:
                    self.received = earlier.received
        return self

    def restore(self, stopping: bool = False) -> None:
        """The previous handlers back (a signal that came meanwhile stays in ``received``); ``stopping`` (the job
        ends pre-empted): the stop signals ignored instead, so a repeat in the teardown (``scancel`` again, a node
        shutting down) ends no rank."""
        for number, handler in self._previous.items():
            kept = signal.SIG_DFL if handler is None else handler      # None: not set from Python
            signal.signal(number, signal.SIG_IGN if stopping else kept)
        self._previous.clear()

    def __enter__(self) -> StopSignals:
        return self.install()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.restore()

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def _mark(self, number: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(number)

    def agreed_signal(self, ctx: Comm) -> signal.Signals | None:
        """The stop signal any rank got (collective: the signal each rank got, gathered on the host (no device
        sync), so a rank the signal missed stops with the others); the same on every rank, None when no rank got
        one. Of several, the first of ``signals``."""
        heard = set(ctx.all_gather_object(None if self.received is None else int(self.received)))
        return next((number for number in self.signals if int(number) in heard), None)
