"""The checkpoint directory checked before the first step: it can be created, takes a file, has room for one."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import ConfigError

SPACE_MARGIN = 1.1            # free space wanted per checkpoint, over its estimated size
SPACE_BASE = 8 << 10          # the archive's fixed part and the manifest
SPACE_PER_TENSOR = 400        # archive entry and name of one tensor


def estimate_checkpoint_bytes(state_bytes: int, tensors: int, optimizer_slots: int) -> int:
    """Size of one checkpoint: the model state (``tensors`` of ``state_bytes`` in all) plus
    ``optimizer_slots`` same-size optimizer buffers, and the archive's overhead."""
    copies = 1 + optimizer_slots
    return state_bytes * copies + SPACE_PER_TENSOR * tensors * copies + SPACE_BASE


def human_bytes(count: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if count < 1024 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TB"


def prepare_directory(directory: str | Path, needed_bytes: int) -> Path:
    """Create ``directory`` and check it takes a file and has room for one checkpoint; ConfigError otherwise."""
    folder = Path(directory).expanduser()
    knob = "--checkpoint-dir"
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(knob, f"{str(folder)!r} cannot be created: {str(existing)!r} is a file; "
                                f"choose a directory path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(knob, f"cannot create {str(folder)!r}: {err.strerror or err}; choose a "
                                f"writable location") from err
    probe = folder / f".mpi4dl-write-test-{os.getpid()}"
    try:
        with open(probe, "wb") as handle:
            handle.write(b"0")
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as err:
        raise ConfigError(knob, f"{str(folder)!r} is not writable: {err.strerror or err}; choose a "
                                f"writable location") from err
    finally:
        probe.unlink(missing_ok=True)
    free = shutil.disk_usage(folder).free
    wanted = int(needed_bytes * SPACE_MARGIN)
    if free < wanted:
        raise ConfigError(knob, f"{str(folder)!r} has {human_bytes(free)} free but one checkpoint "
                                f"needs about {human_bytes(wanted)}; free space or choose another "
                                f"location")
    return folder


