"""The trained network of a checkpoint: find the file, read its record, rebuild its layers (or take the model
object a run built in Python), and the original model's state dict (``dl.model_state_dict``)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.record import LoadedCheckpoint, RunRecord, read_checkpoint
from ..config import ConfigError
from ..models.cut import layer_list
from ..models.pieces import original_state_dict, recut_state_dict
from ..models.spec import ModelFamily, ModelSpec, split_model

ModelObject = nn.Module | Sequence[nn.Module]    # a model built in Python: an nn.Module (cut) or a layer list


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
    """``--checkpoint``: a checkpoint file, or a directory (its newest ``step-*.pt``; ``--checkpoint-select``
    chooses another: ``checkpoint.files.select_checkpoint``)."""
    from ..checkpoint.files import select_checkpoint

    return select_checkpoint(path)


def load_layers(path: str | Path, expected_family: ModelFamily | str | None = None,
                dtype: torch.dtype = torch.float32,
                model: ModelObject | None = None) -> tuple[list[nn.Module], ModelDescription]:
    """The checkpoint's layers (eval mode, ``dtype``) and description, as trained (not yet fully convolutional:
    ``trained.load_network`` gives the network inference runs); clear errors for anything else."""
    layers, description, _ = load_trained(path, expected_family, dtype, model=model)
    return layers, description


def rebuilt(spec: ModelSpec, model: ModelObject | None = None) -> list[nn.Module]:
    """The layers of a checkpoint's ``spec`` (fresh weights), or of a copy of ``model``, the object a run built in
    Python (left as it is); ConfigError for an object whose layers an engine released (on the ``meta`` device)."""
    if model is not None:
        modules = [model] if isinstance(model, nn.Module) else list(model)
        if any(t.is_meta for m in modules for t in [*m.parameters(), *m.buffers()]):
            raise ConfigError("model", "the model object holds tensors on the meta device: a HybridEngine released "
                                       "the layers other ranks own. Pass a freshly built model (build it again "
                                       "the same way); its weights are replaced by the checkpoint's")
        return layer_list(copy.deepcopy(model))
    try:
        return spec.build()
    except ValueError as err:
        if spec.family is not ModelFamily.PYTHON:
            raise
        raise ConfigError("model", f"the checkpoint holds {spec.describe()}, built in Python: pass that model "
                                   f"(an nn.Module or its layer list) as model=... (dl.model_state_dict, "
                                   f"dl.infer_slide, dl.evaluate)") from err


def check_family(expected: ModelFamily | str, spec: ModelSpec, file: Path) -> None:
    """ConfigError when ``--model`` names another network than the checkpoint holds."""
    family = ModelFamily.parse(expected)
    source = split_model(expected)[1] if ":" in str(expected) else None
    if family is not spec.family or (source is not None and source != spec.source):
        raise ConfigError("--model", f"{file} holds a {spec.label} network, not {expected}; drop --model or pass a "
                                     f"{expected} checkpoint")


def load_trained(path: str | Path, expected_family: ModelFamily | str | None = None,
                 dtype: torch.dtype = torch.float32, check: bool = True,
                 model: ModelObject | None = None) -> tuple[list[nn.Module], ModelDescription, RunRecord]:
    """As ``load_layers``, plus the run's record (data, seed, identity, position).

    The file is memory-mapped: only the model's weights are read (never the optimizer state), straight into
    the layers. ``check=False`` skips the checksum against the manifest, for a caller whose other process
    checks the same file and stops this one too when it fails (every rank but rank 0 in an agreed stage).
    ``model``: the model object of a run built in Python (an nn.Module, cut by ``layer_list``, or a layer list),
    whose checkpoint no spec can rebuild; its weights are replaced by the checkpoint's.
    """
    file = find_checkpoint(path)
    checkpoint = read_checkpoint(file, lazy=True, check=check)
    description = ModelDescription.of(checkpoint)
    if expected_family is not None:
        check_family(expected_family, description.spec, file)
    record_dtype = getattr(torch, checkpoint.record.data.dtype)
    model = nn.Sequential(*rebuilt(description.spec, model)).to(record_dtype)  # no rounding
    unfit = f"--checkpoint {file}: weights do not fit its own description ({description.describe()})"
    try:
        result = model.load_state_dict(recut_state_dict(list(model), checkpoint.model_state), strict=False)
    except RuntimeError as err:      # a tensor of another shape: say which, not a traceback
        mismatch = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), str(err))
        raise ValueError(f"{unfit}: {mismatch}") from err
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"{unfit}: missing {result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]}")
    model.to(dtype).eval()
    return list(model), description, checkpoint.record


def model_state_dict(path: str | Path, model: ModelObject | None = None) -> dict[str, torch.Tensor]:
    """The trained weights of a checkpoint (a file, or a directory: its newest) with the keys of the model the run
    was built from, e.g. ``torchvision.models.resnet50(num_classes=2).load_state_dict(sd, strict=True)`` for a
    ``--model torchvision:resnet50`` run (a layer-list model's keys are those of ``nn.Sequential(*layers)``).
    ``model``: the model object of a run built in Python, which no spec rebuilds."""
    file = find_checkpoint(path)
    checkpoint = read_checkpoint(file, lazy=True)
    return original_state_dict(rebuilt(checkpoint.record.model, model), checkpoint.model_state)
