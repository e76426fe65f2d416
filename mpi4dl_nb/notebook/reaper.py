"""Ends a notebook cluster's processes when its driver dies: a small watcher reading commands on its stdin.

The driver (a notebook kernel or script) starts this file as its own process, in its own
session, with a pipe on stdin, and writes ``watch <pid>`` for the controller, ``mpiexec``
and engines it starts, and ``remove <dir>`` for its temporary profile (connection files and
keys). When the pipe reaches end-of-file, because the driver exited or was killed (kernel
crash, ``kill -9``, ``scancel`` of the driver alone), every watched process and every process
that descended from one is terminated (SIGTERM, then SIGKILL after a grace period), the
directories are removed, and the watcher exits. ``forget`` drops the watch list (after a clean stop);
``quit`` exits without touching anything. Process identity is checked by start time, so a
recycled process id is never signalled. Runs without importing mpi4dl_nb (only psutil).
"""
from __future__ import annotations

import os
import select
import shutil
import signal
import sys

import psutil

POLL_SECONDS = 1.0
GRACE_SECONDS = 3.0


def same_process(pid: int, created: float) -> psutil.Process | None:
    """The process ``pid`` if it still is the one started at ``created``."""
    try:
        proc = psutil.Process(pid)
        return proc if abs(proc.create_time() - created) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE \
            else None
    except psutil.Error:
        return None


def with_descendants(watched: dict[int, float]) -> dict[int, float]:
    """``watched`` plus every living descendant of its processes (pid -> start time)."""
    found = dict(watched)
    for pid, created in watched.items():
        proc = same_process(pid, created)
        if proc is None:
            continue
        try:
            for child in proc.children(recursive=True):
                found.setdefault(child.pid, child.create_time())
        except psutil.Error:
            continue
    return found


def reap(processes: dict[int, float], grace: float = GRACE_SECONDS) -> None:
    """SIGTERM every process still alive, then SIGKILL those left after ``grace`` seconds."""
    alive = [p for pid, created in processes.items() if (p := same_process(pid, created)) is not None]
    for proc in alive:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(alive, timeout=grace)
    for proc in left:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=grace)


def handle(line: str, watched: dict[int, float], known: dict[int, float], folders: list[str] | None = None) -> bool:
    """Apply one command; False means quit."""
    words = line.split(maxsplit=1)
    if not words:
        return True
    if words[0] == "remove" and len(words) == 2 and folders is not None:
        folders.append(words[1].strip())
    elif words[0] == "watch" and len(words) == 2 and words[1].strip().isdigit():
        pid = int(words[1].strip())
        try:
            watched[pid] = psutil.Process(pid).create_time()
        except psutil.Error:
            pass
    elif words[0] == "forget":
        watched.clear()
        known.clear()
        if folders is not None:
            folders.clear()
    elif words[0] == "quit":
        return False
    return True


def main() -> int:
    fd = sys.stdin.fileno()
    watched: dict[int, float] = {}
    known: dict[int, float] = {}
    folders: list[str] = []
    pending = b""
    while True:
        ready, _, _ = select.select([fd], [], [], POLL_SECONDS)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break                      # the driver is gone (or closed the pipe)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not handle(line.decode(errors="replace"), watched, known, folders):
                    return 0
        known = with_descendants({**known, **watched})   # learn engines before mpiexec dies
        known = {pid: t for pid, t in known.items() if same_process(pid, t) is not None}
    reap(with_descendants({**known, **watched}))
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C meant for the notebook is not for us
    sys.exit(main())
