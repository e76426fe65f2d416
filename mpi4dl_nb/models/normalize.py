"""The input normalisation pretrained weights expect (ImageNet's mean and std, or given), as the model's first step.

Images reach every model as pixel values in [0, 1]; a model trained from ImageNet weights expects
``(x - mean) / std`` per channel. Putting that into the model (a ``Normalize`` step at the start of its
first piece) makes training, ``evaluate`` and ``infer`` see the same input without a data path of
their own, and it is exact on tiles (per pixel, per channel). Its mean and std are not weights: they
never appear in a state dict, so the model's keys stay the original model's.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError
from .pieces import Piece

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
STEP = "normalize()"      # the step's name in a piece (parentheses: never a path of the model)


@dataclass(frozen=True)
class Normalization:
    """Per-channel ``mean`` and ``std`` of ``(x - mean) / std``; ``name`` for a known one (``imagenet``)."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    name: str | None = None

    def __post_init__(self) -> None:
        if len(self.mean) != len(self.std) or not self.mean:
            raise ValueError(f"normalisation: {len(self.mean)} means for {len(self.std)} standard deviations")
        if not all(s > 0 for s in self.std):
            raise ValueError(f"normalisation: every standard deviation must be > 0, got {self.std}")

    @classmethod
    def parse(cls, text: str, channels: int = 3) -> Normalization | None:
        """``--normalize``: ``imagenet``, ``none`` (None), ``M,S`` (every channel) or ``M1,..,Mc,S1,..,Sc``."""
        key = str(text).strip().lower()
        if key == "none":
            return None
        if key == "imagenet":
            return IMAGENET
        try:
            numbers = tuple(float(part) for part in key.split(","))
        except ValueError:
            numbers = ()
        if len(numbers) == 2:
            return cls((numbers[0],) * channels, (numbers[1],) * channels)
        if len(numbers) == 2 * channels:
            return cls(numbers[:channels], numbers[channels:])
        raise ConfigError("--normalize", f"{text!r}: give imagenet, none, 'M,S' (one mean and std for every "
                                         f"channel) or {channels} means then {channels} standard deviations")

    def describe(self) -> str:
        """``imagenet`` or ``mean (0.5, 0.5, 0.5) std (0.25, 0.25, 0.25)``."""
        return self.name or f"mean {self.mean} std {self.std}"

    def to_dict(self) -> dict[str, object]:
        return {"mean": list(self.mean), "std": list(self.std), "name": self.name}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Normalization:
        """The normalisation ``to_dict`` wrote; ValueError for a bad field."""
        mean, std, name = data.get("mean"), data.get("std"), data.get("name")
        if not (isinstance(mean, list) and isinstance(std, list)
                and all(isinstance(v, (int, float)) for v in [*mean, *std])):
            raise ValueError(f"field 'normalize': expected lists of numbers, got {mean!r} and {std!r}")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"field 'normalize.name': expected text, got {name!r}")
        return cls(tuple(float(v) for v in mean), tuple(float(v) for v in std), name)


IMAGENET = Normalization(IMAGENET_MEAN, IMAGENET_STD, "imagenet")


class Normalize(nn.Module):
    """``(x - mean) / std`` per channel; mean and std are buffers outside the state dict (they follow ``.to()``)."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, normalization: Normalization) -> None:
        super().__init__()
        self.normalization = normalization
        shape = (len(normalization.mean), 1, 1)
        self.register_buffer("mean", torch.tensor(normalization.mean).reshape(shape), persistent=False)
        self.register_buffer("std", torch.tensor(normalization.std).reshape(shape), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def extra_repr(self) -> str:
        return self.normalization.describe()


def normalized(layers: Sequence[nn.Module], normalization: Normalization | None) -> list[nn.Module]:
    """``layers`` whose first piece starts with ``Normalize`` (unchanged when ``normalization`` is None).

    Only a cut model (``layer_list``'s pieces) takes it without changing its keys; a plain layer list is
    refused: put the normalisation into its first layer.
    """
    if normalization is None:
        return list(layers)
    first = layers[0] if layers else None
    if not isinstance(first, Piece):
        raise ConfigError("--normalize", "applies to models cut from torchvision, timm or an nn.Module; a layer "
                                         "list (resnet, amoebanet, a callable returning a list) normalises in its "
                                         "own first layer: use --normalize none")
    if first.paths[0] == STEP:
        raise ValueError("the layers are normalised already")
    return [first.with_steps([(STEP, Normalize(normalization)), *first.steps()]), *layers[1:]]
