"""The trained network of a checkpoint: find the file, read its model description, rebuild its layers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ConfigError
from ..models import MODEL_NAMES, build_model


@dataclass(frozen=True)
class ModelDescription:
    """What a checkpoint says about the network it holds."""

    family: str
    num_layers: int
    num_filters: int
    num_classes: int
    resnet_version: int | None
    image_size: int
    step: int
    path: str

    def describe(self) -> str:
        version = f" v{self.resnet_version}" if self.family == "resnet" and self.resnet_version else ""
        return (f"{self.family}{version} {self.num_layers} layers x {self.num_filters} filters, "
                f"{self.num_classes} classes, trained on {self.image_size} px (step {self.step})")


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


def describe_checkpoint(data: dict[str, Any], path: Path) -> tuple[ModelDescription, dict[str, torch.Tensor]]:
    """The model description and state dict of a loaded checkpoint: the one place that knows its format."""
    run = data.get("run") or {}
    state = data.get("model")
    if not isinstance(run, dict) or not isinstance(state, dict) or "model" not in run:
        raise ValueError(f"--checkpoint {path}: holds no model description (run info and weights); "
                         f"use a checkpoint written by 'python -m mpi4dl_nb train --checkpoint-dir'")
    try:
        description = ModelDescription(
            family=str(run["model"]), num_layers=int(run["num_layers"]), num_filters=int(run["num_filters"]),
            num_classes=int(run["num_classes"]),
            resnet_version=None if run.get("resnet_version") is None else int(run["resnet_version"]),
            image_size=int(run["image_size"]), step=int(data.get("step", 0)), path=str(path))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"--checkpoint {path}: incomplete model description ({err})") from err
    return description, state


def load_network(path: str | Path, expected_family: str | None = None,
                 dtype: torch.dtype = torch.float32) -> tuple[list[nn.Module], ModelDescription]:
    """The checkpoint's layers (eval mode, ``dtype``) and description; clear errors for anything else."""
    layers, description, _ = load_trained(path, expected_family, dtype)
    return layers, description


def load_trained(path: str | Path, expected_family: str | None = None, dtype: torch.dtype = torch.float32,
                 check: bool = True) -> tuple[list[nn.Module], ModelDescription, dict[str, Any]]:
    """As ``load_network``, plus the rest of the loaded checkpoint (run info, identity, position).

    The file is memory-mapped: only the model's weights are read (never the optimizer state), straight into
    the layers. ``check=False`` skips the checksum against the manifest, for a caller whose other process
    checks the same file and stops this one too when it fails (every rank but rank 0 in an agreed stage).
    """
    from ..checkpoint.files import load_checkpoint

    file = find_checkpoint(path)
    data = load_checkpoint(file, lazy=True, check=check)
    description, state = describe_checkpoint(data, file)
    if description.family not in MODEL_NAMES:
        raise ConfigError("--checkpoint", f"{file} holds a {description.family!r} network; inference "
                          f"knows {', '.join(MODEL_NAMES)}")
    if expected_family is not None and expected_family != description.family:
        raise ConfigError("--model", f"{file} holds a {description.family} network, not {expected_family}; "
                          f"drop --model or pass a {expected_family} checkpoint")
    layers = build_model(description.family, num_layers=description.num_layers,
                         num_filters=description.num_filters, num_classes=description.num_classes,
                         version=description.resnet_version or 2)
    model = nn.Sequential(*layers)
    unfit = f"--checkpoint {file}: weights do not fit its own description ({description.describe()})"
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as err:      # a tensor of another shape: say which, not a traceback
        mismatch = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), str(err))
        raise ValueError(f"{unfit}: {mismatch}") from err
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"{unfit}: missing {result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]}")
    model.to(dtype).eval()
    return list(model), description, {k: v for k, v in data.items() if k not in ("model", "optimizer")}
