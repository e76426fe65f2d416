"""What a failed call on a notebook cluster raises: an engine died, a call hung past its timeout, or the function
raised; each with the output of the ranks concerned."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class EngineError(RuntimeError):
    """A remote call failed: an engine died, hung past its timeout or raised.

    ``ranks`` are the MPI ranks concerned, ``outputs`` maps rank -> that engine's output
    (launcher log lines of that rank plus what the call printed).
    """

    def __init__(self, message: str, ranks: Sequence[int] = (),
                 outputs: Mapping[int, str] | None = None) -> None:
        self.ranks = list(ranks)
        self.outputs = dict(outputs or {})
        text = message
        for rank in self.ranks:
            out = self.outputs.get(rank, "").strip()
            if out:
                tail = "\n".join(out.splitlines()[-25:])
                text += f"\n--- output of rank {rank} (last lines) ---\n{tail}"
        super().__init__(text)


class EngineDied(EngineError):
    """An engine process exited during a call (the MPI job is gone: restart the cluster)."""


class EngineTimeout(EngineError):
    """A call did not finish within its timeout (likely a hung collective)."""


class RemoteTaskError(EngineError):
    """The function raised on one or more engines; the message holds their tracebacks."""
