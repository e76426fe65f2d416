"""The checkpoint format: atomic files with a checksummed manifest, rotation within a run, listing and loading.

A checkpoint is two files in the checkpoint directory::

    step-00000006-1a2b3c4d5e6f.pt     torch.save payload (model, optimizer, the run's record: record.py)
    step-00000006-1a2b3c4d5e6f.json   manifest: step, run id, identity, size and sha256 of the .pt

A run with ``--keep-best METRIC`` also keeps its best checkpoint apart, named as such and never
rotated away: ``best-step-00000060-1a2b3c4d5e6f.pt`` (+ manifest, whose ``best`` says the metric, its
value and the step); a better one replaces the run's previous best.

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
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch

from ..config import Choice, ConfigError
from ..evaluation.metrics import MetricName
from ..schema import flag

# 3: the run's record under "record" (record.py); 2: a flat "run" dict; 1: no run id or identity
FORMAT_VERSION = 3
CHECKPOINT_NAME = re.compile(r"^step-(\d{8})(?:-([0-9a-f]{6,32}))?\.pt$")
BEST_PREFIX = "best-"
BEST_NAME = re.compile(r"^best-step-(\d{8})-([0-9a-f]{6,32})\.pt$")
MANIFEST_SUFFIX = ".json"
HASH_CHUNK = 1 << 22


def new_run_id() -> str:
    """A fresh lineage id (12 hex digits)."""
    return uuid.uuid4().hex[:12]


def checkpoint_path(directory: str | Path, step: int, run_id: str | None = None, best: bool = False) -> Path:
    """Where the checkpoint of ``run_id`` after ``step`` optimizer steps lives (no id: the format-1 name;
    ``best``: the run's best checkpoint)."""
    suffix = f"-{run_id}" if run_id else ""
    return Path(directory) / f"{BEST_PREFIX if best else ''}step-{step:08d}{suffix}.pt"


def manifest_path(checkpoint: str | Path) -> Path:
    return Path(checkpoint).with_suffix(MANIFEST_SUFFIX)


def file_sha256(path: str | Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(HASH_CHUNK):
            sha.update(block)
    return sha.hexdigest()


class CheckpointSelect(Choice):
    """Which checkpoint of a directory ``evaluate`` and ``infer`` load (``--checkpoint-select``)."""

    LATEST = "latest"     # the newest regular checkpoint
    BEST = "best"         # the best one kept by --keep-best


@dataclass(frozen=True)
class BestMark:
    """What a best checkpoint is best at: the validation metric, its value, and the step it was reached."""

    metric: str
    value: float
    step: int

    def describe(self) -> str:
        """``val_loss 0.4123 at step 60``."""
        return f"{self.metric} {self.value:.6g} at step {self.step}"

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> BestMark:
        """The mark ``to_dict`` stored; ValueError naming what is wrong."""
        metric, value, step = data.get("metric"), data.get("value"), data.get("step")
        if not isinstance(metric, str) or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"a best mark holds metric (text), value (number) and step (whole number), got "
                             f"{dict(data)!r}")
        return cls(metric, float(value), step)


@dataclass(frozen=True)
class Manifest:
    """The commit record of one checkpoint file (``best``: a best checkpoint's ``BestMark.to_dict()``)."""

    step: int
    run_id: str
    file: str
    bytes: int
    sha256: str
    created: float
    identity: dict[str, object] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    best: dict[str, object] | None = None

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
    def best(self) -> BestMark | None:
        """What a best checkpoint is best at (None: a regular checkpoint, or an unreadable mark)."""
        if self.manifest is None or self.manifest.best is None:
            return None
        try:
            return BestMark.from_dict(self.manifest.best)
        except ValueError:
            return None

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


def _write_atomically(final: Path, write: Callable[[BinaryIO], object]) -> None:
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


def save_checkpoint(directory: str | Path, step: int, payload: Mapping[str, object], *, run_id: str,
                    identity: Mapping[str, object] | None = None, keep: int = 2,
                    best: BestMark | None = None) -> Path:
    """Write ``payload`` as checkpoint ``step`` of run ``run_id``; keep that run's newest ``keep``.

    Never overwrites a file (FileExistsError) and deletes only older checkpoints of the same
    run, after the new one is on disk and its checksum read back matches. With ``best``: the run's
    best checkpoint (``best-step-...``, outside the rotation), replacing the run's previous best; a
    best of this very step and run already on disk (a resumed run redoing its steps) is kept as it is.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(folder, step, run_id, best=best is not None)
    manifest_file = manifest_path(final)
    if best is not None and final.exists() and manifest_file.exists():
        return final
    for existing in (final, manifest_file):
        if existing.exists():
            raise FileExistsError(f"{existing} exists already; a checkpoint is never overwritten")
    data = dict(payload, step=step, run_id=run_id, identity=dict(identity or {}),
                format_version=FORMAT_VERSION)
    _write_atomically(final, lambda handle: torch.save(data, handle))
    manifest = Manifest(step=step, run_id=run_id, file=final.name, bytes=final.stat().st_size,
                        sha256=file_sha256(final), created=time.time(), identity=dict(identity or {}),
                        best=None if best is None else best.to_dict())
    text = json.dumps(asdict(manifest), indent=1).encode()
    _write_atomically(manifest_file, lambda handle: handle.write(text))
    _fsync_directory(folder)
    problem = verify(final, manifest)
    if problem is not None:
        raise OSError(f"checkpoint {final} reads back damaged ({problem}); older checkpoints kept")
    own = [e for e in list_checkpoints(folder, best=best is not None) if e.run_id == run_id and e.problem is None]
    for old in own[:-keep] if best is None else [e for e in own if e.path != final]:
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


def list_checkpoints(directory: str | Path, best: bool = False) -> list[Entry]:
    """Every checkpoint file in ``directory`` (any run; not yet checksummed), oldest first by step; ``best``:
    the best checkpoints instead of the regular ones."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    pattern = BEST_NAME if best else CHECKPOINT_NAME
    found = [(int(m.group(1)), m.group(2), p) for p in folder.iterdir() if (m := pattern.match(p.name))]
    return [_entry(p, step, run_id) for step, run_id, p in sorted(found, key=lambda f: (f[0], f[2].name))]


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", *, lazy: bool = False,
                    check: bool = True) -> dict[str, object]:
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


def latest_checkpoint(directory: str | Path, run_id: str | None = None) -> Path | None:
    """The newest committed checkpoint in ``directory`` (of run ``run_id`` if given; not checksummed), or None."""
    found = [e for e in list_checkpoints(directory)
             if e.problem is None and (run_id is None or e.run_id == run_id)]
    return max(found, key=lambda e: (e.created, e.step)).path if found else None


def best_checkpoint(directory: str | Path) -> Entry | None:
    """The best checkpoint in ``directory`` (intact manifest; not checksummed), or None: of several runs' best
    checkpoints measured by one metric, the best value (ties: the newest); by different metrics, the newest."""
    marked = [(e, e.best) for e in list_checkpoints(directory, best=True) if e.problem is None]
    found = [(entry, mark) for entry, mark in marked if mark is not None]
    if not found:
        return None
    metrics = {mark.metric for _, mark in found}
    if len(metrics) > 1 or metrics - set(MetricName.values()):
        return max(found, key=lambda pair: (pair[0].created, pair[0].step))[0]
    sign = 1.0 if MetricName(found[0][1].metric).lower_is_better else -1.0
    return min(found, key=lambda pair: (sign * pair[1].value, -pair[0].created))[0]


def select_checkpoint(path: str | Path, select: CheckpointSelect | str = CheckpointSelect.LATEST) -> Path:
    """``--checkpoint PATH --checkpoint-select latest|best``: a checkpoint file as given, or a directory's
    newest regular checkpoint (``latest``) or its best one (``best``, see ``best_checkpoint``).
    FileNotFoundError / ValueError saying what is missing and what to do."""
    select = CheckpointSelect(select)
    target = Path(path).expanduser()
    if target.is_dir():
        if select is CheckpointSelect.BEST:
            best = best_checkpoint(target)
            if best is None:
                raise FileNotFoundError(f"--checkpoint {str(path)!r}: no best checkpoint (best-step-*.pt) in this "
                                        f"directory; train with --keep-best METRIC, or drop --checkpoint-select "
                                        f"best for the newest checkpoint")
            return best.path
        found = latest_checkpoint(target)
        if found is None:
            raise FileNotFoundError(f"--checkpoint {str(path)!r}: no checkpoint step-*.pt in this directory; "
                                    f"train with --checkpoint-dir {str(path)!r} first")
        return found
    if not target.is_file():
        raise FileNotFoundError(f"--checkpoint {str(path)!r}: no such checkpoint file or directory")
    if select is CheckpointSelect.BEST and not BEST_NAME.match(target.name):
        raise ValueError(f"--checkpoint-select best picks the best checkpoint of a directory, and {str(path)!r} is "
                         f"a file: give its directory, or drop --checkpoint-select to load this file")
    return target


@dataclass(frozen=True)
class CheckpointChoice:
    """The checkpoint ``evaluate`` and ``infer`` load (``--checkpoint``, ``--checkpoint-select``)."""

    checkpoint: str = flag("--checkpoint", "a checkpoint file, or a checkpoint directory (see --checkpoint-select)",
                           group="checkpoint")
    checkpoint_select: CheckpointSelect = flag(
        "--checkpoint-select", "which checkpoint of a directory: latest (the newest) or best (the one 'train "
                               "--keep-best' kept)", CheckpointSelect.LATEST, parse=CheckpointSelect,
        choices=CheckpointSelect.values(), group="checkpoint")

    def path(self) -> Path:
        """The checkpoint file these name, found now; ConfigError naming ``--checkpoint`` and what is missing."""
        try:
            return select_checkpoint(self.checkpoint, self.checkpoint_select)
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError("--checkpoint", str(err).removeprefix("--checkpoint ")) from None
