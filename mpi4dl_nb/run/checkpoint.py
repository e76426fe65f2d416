"""Checkpoints of one run: atomic files with a checksummed manifest, rotation within the run, resume with fallback.

A checkpoint is two files in the checkpoint directory::

    step-00000006-1a2b3c4d5e6f.pt     torch.save payload (model, optimizer, position, identity)
    step-00000006-1a2b3c4d5e6f.json   manifest: step, run id, identity, size and sha256 of the .pt

The ``.pt`` is written to a temporary file, fsynced and renamed; then the manifest, the
same way. The manifest is the commit record: a ``.pt`` without one is an interrupted write,
one whose size or checksum differs is damaged. The run id (a *lineage*: a fresh run draws
one, a resumed run continues its checkpoint's) is part of every name, so runs sharing a
directory never overwrite or rotate away each other's checkpoints.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError

FORMAT_VERSION = 2
CHECKPOINT_NAME = re.compile(r"^step-(\d{8})(?:-([0-9a-f]{6,32}))?\.pt$")
MANIFEST_SUFFIX = ".json"
HASH_CHUNK = 1 << 22
SPACE_MARGIN = 1.1            # free space wanted per checkpoint, over its estimated size
SPACE_BASE = 8 << 10          # the archive's fixed part and the manifest
SPACE_PER_TENSOR = 400        # archive entry and name of one tensor


def new_run_id() -> str:
    """A fresh lineage id (12 hex digits)."""
    return uuid.uuid4().hex[:12]


def checkpoint_path(directory: str | Path, step: int, run_id: str | None = None) -> Path:
    """Where the checkpoint of ``run_id`` after ``step`` optimizer steps lives (no id: the format-1 name)."""
    suffix = f"-{run_id}" if run_id else ""
    return Path(directory) / f"step-{step:08d}{suffix}.pt"


def manifest_path(checkpoint: str | Path) -> Path:
    return Path(checkpoint).with_suffix(MANIFEST_SUFFIX)


def file_sha256(path: str | Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(HASH_CHUNK):
            sha.update(block)
    return sha.hexdigest()


@dataclass(frozen=True)
class Manifest:
    """The commit record of one checkpoint file."""

    step: int
    run_id: str
    file: str
    bytes: int
    sha256: str
    created: float
    identity: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @classmethod
    def read(cls, path: Path) -> Manifest:
        data = json.loads(path.read_text())
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


@dataclass(frozen=True)
class Entry:
    """A checkpoint file found in a directory: its manifest, or why it cannot be trusted."""

    path: Path
    step: int
    run_id: str | None
    manifest: Manifest | None = None
    problem: str | None = None

    @property
    def created(self) -> float:
        """When it was written: the manifest's time, else the file's modification time."""
        if self.manifest is not None:
            return self.manifest.created
        try:
            return self.path.stat().st_mtime
        except OSError:
            return 0.0


# ------------------------------------------------------------------------------ writing
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


def _write_atomically(final: Path, write: Callable[[Any], None]) -> None:
    """``write(handle)`` into a temporary file beside ``final``, fsync, rename; no temporary file is left."""
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_checkpoint(directory: str | Path, step: int, payload: dict[str, Any], *, run_id: str,
                    identity: Mapping[str, Any] | None = None, keep: int = 2) -> Path:
    """Write ``payload`` as checkpoint ``step`` of run ``run_id``; keep that run's newest ``keep``.

    Never overwrites a file (FileExistsError) and deletes only older checkpoints of the same
    run, after the new one is on disk and its checksum read back matches.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(folder, step, run_id)
    manifest_file = manifest_path(final)
    for existing in (final, manifest_file):
        if existing.exists():
            raise FileExistsError(f"{existing} exists already; a checkpoint is never overwritten")
    data = dict(payload, step=step, run_id=run_id, identity=dict(identity or {}),
                format_version=FORMAT_VERSION)
    _write_atomically(final, lambda handle: torch.save(data, handle))
    manifest = Manifest(step=step, run_id=run_id, file=final.name, bytes=final.stat().st_size,
                        sha256=file_sha256(final), created=time.time(), identity=dict(identity or {}))
    text = json.dumps(asdict(manifest), indent=1).encode()
    _write_atomically(manifest_file, lambda handle: handle.write(text))
    _fsync_directory(folder)
    problem = verify(final, manifest)
    if problem is not None:
        raise OSError(f"checkpoint {final} reads back damaged ({problem}); older checkpoints kept")
    own = [e for e in list_checkpoints(folder) if e.run_id == run_id and e.problem is None]
    for old in own[:-keep]:
        manifest_path(old.path).unlink(missing_ok=True)   # uncommit first, then drop the data
        old.path.unlink(missing_ok=True)
    return final


# ------------------------------------------------------------------------------ reading
def verify(path: Path, manifest: Manifest) -> str | None:
    """Why the checkpoint file does not match its manifest (None: intact)."""
    try:
        size = path.stat().st_size
    except OSError as err:
        return f"cannot read it: {err.strerror or err}"
    if size != manifest.bytes:
        return f"{size} bytes, the manifest says {manifest.bytes} (truncated or replaced)"
    if file_sha256(path) != manifest.sha256:
        return "checksum mismatch (the file was modified or damaged)"
    return None


def _entry(path: Path, step: int, run_id: str | None) -> Entry:
    if run_id is None:
        return Entry(path, step, None, problem="written without a run identity (an older mpi4dl_nb "
                                                "version); resume it by its path")
    mpath = manifest_path(path)
    if not mpath.exists():
        return Entry(path, step, run_id, problem="no manifest: its write did not finish")
    try:
        manifest = Manifest.read(mpath)
    except (OSError, ValueError, TypeError) as err:
        return Entry(path, step, run_id, problem=f"unreadable manifest {mpath.name}: {err}")
    return Entry(path, step, run_id, manifest)


def list_checkpoints(directory: str | Path) -> list[Entry]:
    """Every checkpoint file in ``directory`` (any run; not yet checksummed), oldest first by step."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), m.group(2), p) for p in folder.iterdir()
             if (m := CHECKPOINT_NAME.match(p.name))]
    return [_entry(p, step, run_id) for step, run_id, p in sorted(found, key=lambda f: (f[0], f[2].name))]


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", *, lazy: bool = False,
                    check: bool = True) -> dict[str, Any]:
    """Load a checkpoint (checked against its manifest when it has one and ``check``); ValueError saying what
    is wrong. ``lazy``: tensors stay memory-mapped from the file, so only those the caller reads are paged in
    (and processes on one node share those pages)."""
    path = Path(path)
    mpath = manifest_path(path)
    if check and mpath.exists():
        try:
            manifest = Manifest.read(mpath)
        except (OSError, ValueError, TypeError) as err:
            raise ValueError(f"checkpoint {path}: unreadable manifest {mpath.name}: {err}") from err
        problem = verify(path, manifest)
        if problem is not None:
            raise ValueError(f"checkpoint {path} is damaged: {problem}")
    try:
        data = torch.load(path, map_location=map_location, weights_only=True, mmap=lazy)
    except Exception as err:   # corrupted/foreign file: say which and why
        raise ValueError(f"cannot load checkpoint {path}: {err}") from err
    if not isinstance(data, dict) or "step" not in data or "format_version" not in data:
        raise ValueError(f"{path} is not an mpi4dl_nb checkpoint (no step/format_version)")
    return data


def saved_identity(data: Mapping[str, Any]) -> dict[str, Any]:
    """The identity stored in a loaded checkpoint; format 1 files give what they recorded."""
    if data.get("format_version", 1) >= 2:
        return dict(data.get("identity") or {})
    run = dict(data.get("run") or {})
    legacy = {k: run[k] for k in ("image_size", "batch_size", "app", "dtype") if k in run}
    if "data_seed" in data:
        legacy["seed"] = data["data_seed"]
    return legacy


# ------------------------------------------------------------------------------ resume
@dataclass
class Selection:
    """The checkpoint to resume from, its loaded payload, and the newer ones passed over (with why)."""

    path: Path
    data: dict[str, Any]
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    def report(self) -> str:
        """What was chosen and skipped, for the log."""
        lines = [f"resuming from {self.path} (step {self.data['step']})"]
        lines += [f"  skipped newer {p.name}: {why}" for p, why in self.skipped]
        return "\n".join(lines)


Accept = Callable[[Mapping[str, Any]], str | None]   # saved identity -> why it does not fit (None: fits)


def select_resume(resume: str | Path, checkpoint_dir: str | Path | None, accept: Accept) -> Selection:
    """``--resume``: a checkpoint file (must be intact and fit), or a directory / ``latest``
    (in ``checkpoint_dir``): the newest intact checkpoint that fits, saying which newer ones
    were skipped and why. ``accept`` judges a saved identity. FileNotFoundError/ValueError
    explain a failure."""
    text = str(resume)
    if text == "latest":
        if checkpoint_dir is None:
            raise ConfigError("--resume", "'latest' looks in --checkpoint-dir; give --checkpoint-dir "
                              "or a checkpoint path")
        target = Path(checkpoint_dir)
    else:
        target = Path(text).expanduser()
    if target.is_file():
        data = load_checkpoint(target)
        why = accept(saved_identity(data))
        if why is not None:
            raise ValueError(f"--resume {target}: {why}")
        return Selection(target, data)
    if not target.is_dir():
        if text == "latest":
            raise FileNotFoundError(f"--resume latest: --checkpoint-dir {str(target)!r} does not exist "
                                    f"(no checkpoint to resume)")
        raise FileNotFoundError(f"--resume {text!r}: no such checkpoint file or directory")
    return newest_fitting(target, accept)


def newest_fitting(folder: Path, accept: Accept) -> Selection:
    """The newest (by write time, then step) intact checkpoint in ``folder`` that ``accept`` takes."""
    entries = sorted(list_checkpoints(folder), key=lambda e: (e.created, e.step), reverse=True)
    if not entries:
        raise FileNotFoundError(f"--resume: no checkpoint step-*.pt in {str(folder)!r}")
    skipped: list[tuple[Path, str]] = []
    for entry in entries:
        why = entry.problem
        if why is None and entry.manifest is not None:
            why = accept(entry.manifest.identity)
            if why is None:
                why = verify(entry.path, entry.manifest)
        data = None
        if why is None:
            try:
                data = load_checkpoint(entry.path)
            except ValueError as err:
                why = str(err)
        if data is not None:
            return Selection(entry.path, data, skipped)
        skipped.append((entry.path, why or "unusable"))
    listing = "; ".join(f"{p.name}: {why}" for p, why in skipped)
    raise ValueError(f"--resume: no checkpoint in {str(folder)!r} fits this run ({listing})")


# ------------------------------------------------------------------------- pre-flight
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


def latest_checkpoint(directory: str | Path, run_id: str | None = None) -> Path | None:
    """The newest committed checkpoint in ``directory`` (of run ``run_id`` if given; not checksummed), or None."""
    found = [e for e in list_checkpoints(directory)
             if e.problem is None and (run_id is None or e.run_id == run_id)]
    return max(found, key=lambda e: (e.created, e.step)).path if found else None
