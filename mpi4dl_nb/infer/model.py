"""The trained network of a checkpoint: find the file, read its record, rebuild its layers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.record import LoadedCheckpoint, RunRecord, read_checkpoint
from ..config import ConfigError
from ..models.spec import ModelFamily, ModelSpec


@dataclass(frozen=True)
class ModelDescription:
    """What a checkpoint says about the network it holds: its spec, the image size it trained on, its step."""

    spec: ModelSpec
    image_size: int
    step: int
    path: str

    @classmethod
    def of(cls, checkpoint: LoadedCheckpoint) -> ModelDescription:
        record = checkpoint.record
        return cls(record.model, record.data.image_size, record.step, str(checkpoint.path))

    @property
    def family(self) -> ModelFamily:
        return self.spec.family

    def describe(self) -> str:
        """``resnet v1 8 layers x 4 filters, 2 classes, trained on 32 px (step 4)``."""
        return f"{self.spec.describe()}, trained on {self.image_size} px (step {self.step})"


def find_checkpoint(path: str | Path) -> Path:
    """``--checkpoint``: a checkpoint file, or a directory (its newest ``step-*.pt``)."""
    from ..checkpoint.files import latest_checkpoint

    target = Path(path).expanduser()
    if target.is_dir():
        found = latest_checkpoint(target)
        if found is None:
            raise FileNotFoundError(f"--checkpoint {str(path)!r}: no checkpoint step-*.pt in this directory; "
                                    f"train with --checkpoint-dir {str(path)!r} first")
        return found
    if not target.is_file():
        raise FileNotFoundError(f"--checkpoint {str(path)!r}: no such checkpoint file or directory")
    return target


def load_network(path: str | Path, expected_family: ModelFamily | str | None = None,
                 dtype: torch.dtype = torch.float32) -> tuple[list[nn.Module], ModelDescription]:
    """The checkpoint's layers (eval mode, ``dtype``) and description; clear errors for anything else."""
    layers, description, _ = load_trained(path, expected_family, dtype)
    return layers, description


def load_trained(path: str | Path, expected_family: ModelFamily | str | None = None,
                 dtype: torch.dtype = torch.float32,
                 check: bool = True) -> tuple[list[nn.Module], ModelDescription, RunRecord]:
    """As ``load_network``, plus the run's record (data, seed, identity, position).

    The file is memory-mapped: only the model's weights are read (never the optimizer state), straight into
    the layers. ``check=False`` skips the checksum against the manifest, for a caller whose other process
    checks the same file and stops this one too when it fails (every rank but rank 0 in an agreed stage).
    """
    file = find_checkpoint(path)
    checkpoint = read_checkpoint(file, lazy=True, check=check)
    description = ModelDescription.of(checkpoint)
    if expected_family is not None and ModelFamily.parse(expected_family) is not description.family:
        raise ConfigError("--model", f"{file} holds a {description.family} network, not {expected_family}; "
                          f"drop --model or pass a {expected_family} checkpoint")
    model = nn.Sequential(*description.spec.build())
    unfit = f"--checkpoint {file}: weights do not fit its own description ({description.describe()})"
    try:
        result = model.load_state_dict(checkpoint.model_state, strict=False)
    except RuntimeError as err:      # a tensor of another shape: say which, not a traceback
        mismatch = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), str(err))
        raise ValueError(f"{unfit}: {mismatch}") from err
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"{unfit}: missing {result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]}")
    model.to(dtype).eval()
    return list(model), description, checkpoint.record
