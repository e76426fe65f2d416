"""The driver's end of ``reaper.py``: start the watcher, tell it what to end and remove if the driver dies."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


class Reaper:
    """The driver's end of ``reaper.py``: a watcher process that ends the cluster's processes if the driver dies."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("reaper.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)

    def _send(self, line: str) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(f"{line}\n".encode())
                self.proc.stdin.flush()
            except OSError:
                pass

    def watch(self, pids: Sequence[int]) -> None:
        for pid in pids:
            self._send(f"watch {int(pid)}")

    def remove(self, folder: str) -> None:
        """Have ``folder`` (a temporary profile: connection files, keys) removed if the driver dies."""
        self._send(f"remove {folder}")

    def close(self) -> None:
        """After a stop: close the pipe, so the watcher ends whatever is left of the cluster and exits."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
