"""The checkpoint directory checked before the first step: it can be created, takes a file, has room for one,
and every host of the job sees it (a folder the checks made is removed again: a refused run leaves none); the run's
``config.toml`` written there once set-up passed (its every flag: ``--config`` runs it again)."""
from __future__ import annotations

import os
import secrets
import shutil
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..config_file import job_toml
from ..console import to_stderr
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..comm.protocol import Comm
    from .job import TrainPlan

CONFIG_NAME = "config.toml"

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


def missing_folders(folder: Path) -> list[Path]:
    """``folder`` and its parents that do not exist yet, outermost first (what creating it makes)."""
    return [p for p in reversed((folder, *folder.parents)) if not p.exists()]


def remove_made(made: list[Path]) -> None:
    """Remove the folders a check made (``missing_folders``), innermost first, each only while empty."""
    for path in reversed(made):
        try:
            path.rmdir()
        except OSError:
            return


def prepare_directory(directory: str | Path, needed_bytes: int) -> Path:
    """Check ``directory`` can be created, takes a file and has room for one checkpoint (ConfigError otherwise),
    leaving it as it was: a folder made for the check is removed again (``write_run_config`` makes it once set-up
    passed), so a run refused later leaves no empty folder."""
    folder = Path(directory).expanduser()
    knob = "--checkpoint-dir"
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(knob, f"{str(folder)!r} cannot be created: {str(existing)!r} is a file; "
                                f"choose a directory path")
    made = missing_folders(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        remove_made(made)
        raise ConfigError(knob, f"cannot create {str(folder)!r}: {err.strerror or err}; choose a "
                                f"writable location") from err
    try:
        check_folder_takes(folder, needed_bytes)
    finally:
        remove_made(made)
    return folder


def check_folder_takes(folder: Path, needed_bytes: int) -> None:
    """ConfigError unless the existing ``folder`` takes a file and has room for ``needed_bytes`` (and a margin)."""
    knob = "--checkpoint-dir"
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


def sees_marker(marker: Path, token: str, tries: int = 5, pause: float = 0.2) -> bool:
    """Whether ``marker`` holds ``token`` here, looked for a few times (a network file system may show a new
    file to other hosts a moment late)."""
    for attempt in range(tries):
        try:
            if marker.read_text() == token:
                return True
        except OSError:
            pass
        if attempt + 1 < tries:
            time.sleep(pause)
    return False


def require_shared(ctx: Comm, directory: str | Path, knob: str = "--checkpoint-dir") -> None:
    """ConfigError on every rank unless every host of the job sees ``directory`` as one directory (collective).

    Rank 0 (which writes checkpoints) leaves a marker file there and every rank looks for it: a host
    that does not see it has the path on a disk of its own (node-local), and a resume whose rank 0
    runs there would not find the checkpoints. A job on one host passes without a marker.
    """
    folder = Path(directory).expanduser()
    hosts = ctx.all_gather_object(socket.gethostname())
    if len(set(hosts)) == 1:
        return
    written: str | None = None
    made = missing_folders(folder) if ctx.rank == 0 else []
    if ctx.rank == 0:
        written = secrets.token_hex(8)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f".mpi4dl-shared-{written}").write_text(written)
        except OSError:
            written = None
    try:
        compare_hosts(ctx, folder, hosts, written, knob)
    finally:
        remove_made(made)


def compare_hosts(ctx: Comm, folder: Path, hosts: list[str], written: str | None, knob: str) -> None:
    """``require_shared`` once rank 0 wrote its marker (``written``: its token, None: it could not)."""
    token = ctx.bcast_object(written, root=0)
    if token is None:
        raise ConfigError(knob, f"{str(folder)!r}: rank 0 cannot write there; choose a writable directory")
    marker = folder / f".mpi4dl-shared-{token}"
    try:
        seen = ctx.all_gather_object(sees_marker(marker, token))
    finally:
        if ctx.rank == 0:
            marker.unlink(missing_ok=True)
    blind = sorted({host for host, ok in zip(hosts, seen) if not ok})
    if blind:
        ranks = [str(rank) for rank, ok in enumerate(seen) if not ok]
        who = (f"host {blind[0]}" if len(blind) == 1 else f"hosts {', '.join(blind)}") + \
            (f" (rank {ranks[0]}) does not" if len(ranks) == 1 else f" (ranks {', '.join(ranks)}) do not")
        raise ConfigError(knob, f"{str(folder)!r} is not shared between the job's hosts: {who} see the file rank 0 "
                                f"wrote there on {hosts[0]} (a node-local disk?); a resume whose rank 0 runs on "
                                f"another host would not find the checkpoints. Choose a directory every host mounts "
                                f"(a shared file system)")


def run_config(plan: TrainPlan) -> str | None:
    """The TOML of every flag of the run ``plan`` is (``train --config`` runs it again: its model and data as asked,
    ``--normalize`` as it resolved, its other groups as the plan holds them, a fold's included); None for a plan
    built without a TrainJob."""
    from importlib.metadata import PackageNotFoundError, version

    from .job import COMMAND

    asked = plan.asked
    if asked is None:
        return None
    model = replace(asked.model, normalize=asked.model.resolved_normalize())    # what auto resolved to
    job = replace(asked, model=model, config=plan.config, training=plan.training, held_out=plan.held_out,
                  checkpoints=plan.checkpoints, options=plan.options)
    try:
        release = f"mpi4dl-nb {version('mpi4dl-nb')}"
    except PackageNotFoundError:
        release = "mpi4dl-nb"
    return job_toml(job, COMMAND, (f"the flags of a training run ({release}), every one, defaults included:",
                                   f"python -m mpi4dl_nb {COMMAND} --config THIS_FILE runs it again; a flag on the "
                                   f"command line replaces its line here"))


def config_file_for(folder: Path, text: str, run_id: str) -> Path:
    """Where a run's configuration goes: ``config.toml`` when absent or the same text, else (an earlier run's with
    other flags) ``config-<run_id>.toml`` (``-2``, ``-3`` ... after it when that too holds another text)."""
    names = [CONFIG_NAME, f"config-{run_id}.toml"]
    names += (f"config-{run_id}-{n}.toml" for n in range(2, 1000))
    for name in names:
        path = folder / name
        try:
            if not path.exists() or path.read_text(encoding="utf-8") == text:
                return path
        except (OSError, UnicodeDecodeError):
            continue
    raise ConfigError("--checkpoint-dir", f"{folder} holds {len(names)} other configuration files of run {run_id}; "
                                          f"clear them away")


def write_run_config(plan: TrainPlan, rank: int, run_id: str | None) -> Path | None:
    """Rank 0 of a run with a checkpoint directory: the run's configuration written there (never over another run's
    other ``config.toml``: then beside it, said on stderr); the file, or None where none is written."""
    directory = plan.checkpoints.directory
    if rank != 0 or directory is None or run_id is None:
        return None
    folder = Path(directory).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)      # set-up passed: the run's folder is made now
    except OSError as err:
        raise ConfigError("--checkpoint-dir", f"cannot create {str(folder)!r}: {err.strerror or err}; choose a "
                                              f"writable location") from err
    text = run_config(plan)
    if text is None:
        return None
    path = config_file_for(folder, text, run_id)
    partial = folder / f".{path.name}.partial-{os.getpid()}"
    try:
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
    except OSError as err:
        raise ConfigError("--checkpoint-dir", f"cannot write {path}: {err.strerror or err}; choose a writable "
                                              f"location") from err
    finally:
        partial.unlink(missing_ok=True)
    if path.name != CONFIG_NAME:
        to_stderr(f"mpi4dl_nb train: {folder / CONFIG_NAME} holds an earlier run's other flags; this run's are in "
                  f"{path}")
    return path
