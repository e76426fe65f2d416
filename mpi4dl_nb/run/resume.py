"""Resume policy: the checkpoint a resumed run continues from (a file, or the newest intact one that fits)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.files import list_checkpoints, verify
from ..checkpoint.record import LoadedCheckpoint, read_checkpoint
from ..errors import ConfigError


@dataclass
class Selection:
    """The checkpoint to resume from (loaded), and the newer ones passed over (with why)."""

    checkpoint: LoadedCheckpoint
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    @property
    def path(self) -> Path:
        return self.checkpoint.path

    def report(self) -> str:
        """What was chosen and skipped, for the log."""
        lines = [f"resuming from {self.path} (step {self.checkpoint.record.step})"]
        lines += [f"  skipped newer {p.name}: {why}" for p, why in self.skipped]
        return "\n".join(lines)


Accept = Callable[[Mapping[str, object]], str | None]   # saved identity -> why it does not fit (None: fits)


def check_resume_source(resume: str | None, checkpoint_dir: str | None) -> None:
    """``--resume`` checked before any work (and before the checkpoint folder is made): ConfigError for a path that
    does not exist, and for ``latest`` or a folder holding no checkpoint to continue."""
    if resume is None:
        return
    latest = resume == "latest"
    target = Path(checkpoint_dir if latest and checkpoint_dir is not None else resume).expanduser()
    shown = f"latest: --checkpoint-dir {str(target)!r}" if latest else repr(resume)
    if not target.exists():
        what = "does not exist" if latest else "no such checkpoint file or directory"
        raise ConfigError("--resume", f"{shown}: {what}, so there is no run to continue; drop --resume to start a "
                                      f"new run{' there' if latest else ''}, or give the folder (or checkpoint "
                                      f"file) of the run to continue")
    if target.is_dir() and not list_checkpoints(target):
        raise ConfigError("--resume", f"{shown} holds no checkpoint (step-*.pt) to continue; drop --resume to "
                                      f"start a new run{' there' if latest else ''}, or give the folder of the run "
                                      f"to continue")


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
        checkpoint = read_checkpoint(target)
        why = accept(checkpoint.record.identity)
        if why is not None:
            raise ValueError(f"--resume {target}: {why}")
        return Selection(checkpoint)
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
        if why is None:
            try:
                return Selection(read_checkpoint(entry.path), skipped)
            except ValueError as err:
                why = str(err)
        skipped.append((entry.path, why or "unusable"))
    listing = "; ".join(f"{p.name}: {why}" for p, why in skipped)
    raise ValueError(f"--resume: no checkpoint in {str(folder)!r} fits this run ({listing})")
