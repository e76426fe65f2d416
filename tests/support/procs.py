"""Process-tree helpers for tests that kill ranks, drivers and clusters (Linux /proc)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path


def descendants(root: int) -> list[int]:
    """PIDs of every process below ``root``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: Iterable[int], timeout: float) -> tuple[list[int], float]:
    """Wait until none of ``pids`` runs; (those still running after ``timeout``, seconds waited)."""
    start = time.monotonic()
    left = [pid for pid in pids if alive(pid)]
    while left and time.monotonic() - start < timeout:
        time.sleep(0.2)
        left = [pid for pid in left if alive(pid)]
    return left, time.monotonic() - start


def mpi_rank(pid: int) -> int | None:
    """The MPI rank of a launched process, from its environment (MPICH's PMI_RANK, Open MPI's variable)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        name, _, value = item.partition(b"=")
        if name in (b"PMI_RANK", b"OMPI_COMM_WORLD_RANK") and value.isdigit():
            return int(value)
    return None
