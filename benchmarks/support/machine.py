"""The footer every benchmark prints: machine, load at start and end, torch, commit (and a dirty tree), date."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cpu_model() -> str:
    """The CPU's model name and its widest vector unit (AVX-512 or AVX2: matmul speed depends on it)."""
    name, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    return f"{name}, {vector}" if vector else name


def git(*args: str) -> str:
    """A read-only git query on the repository (empty where git or the checkout is missing)."""
    try:
        done = subprocess.run(["git", "--no-optional-locks", "-C", str(REPO), *args], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.rstrip("\n") if done.returncode == 0 else ""


def commit_label() -> str:
    """``abc1234``, or ``abc1234 + uncommitted changes in benchmarks/ (3 files), tests/ (1 file)``."""
    commit = git("rev-parse", "--short", "HEAD").strip() or "unknown commit"
    changed = [line[3:] for line in git("status", "--porcelain").splitlines() if line]
    if not changed:
        return commit
    folders: dict[str, int] = {}
    for path in changed:
        top = path.split("/", 1)[0] + ("/" if "/" in path else "")
        folders[top] = folders.get(top, 0) + 1
    listed = ", ".join(f"{name} ({count} file{'s' * (count > 1)})" for name, count in sorted(folders.items()))
    return f"{commit} + uncommitted changes in {listed}"


def load_text(load: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.2f}" for x in load)


@dataclass
class Footer:
    """Started when a script starts; ``text()`` at its end says where, under what load and at which commit."""

    load_at_start: tuple[float, float, float] = field(default_factory=os.getloadavg)
    started: float = field(default_factory=time.monotonic)

    def text(self) -> str:
        import torch

        now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        return (f"machine: {cpu_model()}; {os.cpu_count()} cores; Python {platform.python_version()}, "
                f"torch {torch.__version__}\n"
                f"load average (1, 5, 15 min): {load_text(self.load_at_start)} at start, "
                f"{load_text(os.getloadavg())} at end; {time.monotonic() - self.started:.0f} s\n"
                f"commit {commit_label()}; {now}")

    def print(self) -> None:
        print(f"\n{self.text()}", flush=True)
