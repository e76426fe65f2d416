"""Atomic checkpoints: write ``step-NNNNNNNN.pt`` to a temporary file, fsync, rename; find and load the latest."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_NAME = re.compile(r"^step-(\d{8})\.pt$")
FORMAT_VERSION = 1


def checkpoint_path(directory: str | Path, step: int) -> Path:
    """Where the checkpoint after ``step`` optimizer steps lives."""
    return Path(directory) / f"step-{step:08d}.pt"


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(directory: str | Path, step: int, payload: dict[str, Any], *,
                    keep: int = 2) -> Path:
    """Write ``payload`` (plus ``step``) atomically as the checkpoint of ``step``; keep the newest ``keep``.

    The data go to ``.step-N.pt.tmp-<pid>`` first and are fsynced, then ``os.replace`` gives
    them their name: a reader (or a crash) sees either the old set of checkpoints or the new
    complete file, never a partial one.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(folder, step)
    tmp = folder / f".{final.name}.tmp-{os.getpid()}"
    data = dict(payload, step=step, format_version=FORMAT_VERSION)
    try:
        with open(tmp, "wb") as handle:
            torch.save(data, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_directory(folder)
    for old in list_checkpoints(folder)[:-keep]:
        old.unlink(missing_ok=True)
    return final


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first (temporary files are ignored)."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir()
             if (m := CHECKPOINT_NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint in ``directory``, or None."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def resolve_resume(resume: str | Path, checkpoint_dir: str | Path | None) -> Path:
    """``--resume``: a checkpoint file, a directory, or ``latest`` (in ``--checkpoint-dir``)."""
    text = str(resume)
    if text == "latest":
        if checkpoint_dir is None:
            raise ValueError("--resume latest needs --checkpoint-dir")
        target = Path(checkpoint_dir)
    else:
        target = Path(text).expanduser()
    if target.is_dir() or text == "latest":
        found = latest_checkpoint(target)
        if found is None:
            raise FileNotFoundError(f"--resume: no checkpoint step-*.pt in {str(target)!r}")
        return found
    if not target.is_file():
        raise FileNotFoundError(f"--resume {text!r}: no such checkpoint file or directory")
    return target


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint`; ValueError if it is not one."""
    try:
        data = torch.load(Path(path), map_location=map_location, weights_only=True)
    except Exception as err:   # corrupted/foreign file: say which and why
        raise ValueError(f"cannot load checkpoint {path}: {err}") from err
    if not isinstance(data, dict) or "step" not in data or "format_version" not in data:
        raise ValueError(f"{path} is not an mpi4dl_nb checkpoint (no step/format_version)")
    return data
