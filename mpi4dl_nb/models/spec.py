"""ModelSpec: which network a run builds (family and sizes), built alike on every rank and stored in checkpoints."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from ..config import Choice
from .build import DEFAULT_NUM_FILTERS, DEFAULT_NUM_LAYERS, build_model, image_multiple


class ModelFamily(Choice):
    """The model families ``build_model`` knows (``--model``)."""

    RESNET = "resnet"
    AMOEBANET = "amoebanet"

    @classmethod
    def parse(cls, text: str) -> ModelFamily:
        """``"resnet"`` (any case) -> ``ModelFamily.RESNET``; ValueError naming the families."""
        try:
            return cls(str(text).strip().lower())
        except ValueError:
            raise ValueError(f"unknown model {text!r}; choose one of {', '.join(cls.values())}") from None

    @property
    def versioned(self) -> bool:
        """Whether the family comes in versions (ResNet v1/v2)."""
        return self is ModelFamily.RESNET


@dataclass(frozen=True)
class ModelSpec:
    """Which network to build: its ``family`` and sizes (``build_model``'s arguments, defaults resolved).

    A checkpoint stores it as a plain dict (``to_dict``/``from_dict``). A field added later needs a
    default, so that files written before it still read; keys a reader does not know are ignored.
    """

    family: ModelFamily
    num_layers: int
    num_filters: int
    num_classes: int = 10
    resnet_version: int | None = None      # ResNet only (1 or 2); None for the other families
    in_channels: int = 3

    @classmethod
    def of(cls, family: ModelFamily | str = ModelFamily.RESNET, *, num_layers: int | None = None,
           num_filters: int | None = None, num_classes: int = 10, resnet_version: int = 2,
           in_channels: int = 3) -> ModelSpec:
        """``family`` with its default depth and width where not given (the version kept for ResNet only)."""
        kind = ModelFamily.parse(family)
        return cls(kind, DEFAULT_NUM_LAYERS[kind] if num_layers is None else num_layers,
                   DEFAULT_NUM_FILTERS[kind] if num_filters is None else num_filters, num_classes,
                   resnet_version if kind.versioned else None, in_channels)

    @property
    def image_multiple(self) -> int:
        """Image sides must be multiples of this (the network's total downsampling)."""
        return image_multiple(self.family)

    def build(self, image_size: int | None = None) -> list[nn.Module]:
        """The layer list (torch's current seed draws the weights); ``image_size`` checked against the downsampling."""
        return build_model(self.family, num_layers=self.num_layers, num_filters=self.num_filters,
                           num_classes=self.num_classes, version=self.resnet_version or 2,
                           in_channels=self.in_channels, image_size=image_size)

    def describe(self) -> str:
        """``resnet v1 8 layers x 4 filters, 2 classes``."""
        version = f" v{self.resnet_version}" if self.resnet_version else ""
        channels = f", {self.in_channels} input channels" if self.in_channels != 3 else ""
        return (f"{self.family}{version} {self.num_layers} layers x {self.num_filters} filters, "
                f"{self.num_classes} classes{channels}")

    def to_dict(self) -> dict[str, object]:
        """Plain values for a checkpoint (loadable with ``weights_only``) or JSON."""
        return {"family": str(self.family), "num_layers": self.num_layers, "num_filters": self.num_filters,
                "num_classes": self.num_classes, "resnet_version": self.resnet_version,
                "in_channels": self.in_channels}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> ModelSpec:
        """The spec ``to_dict`` wrote; ValueError naming a missing or mistyped field."""
        family = data.get("family")
        if not isinstance(family, str):
            raise ValueError(f"model field 'family': expected a name, got {family!r}")
        return cls(ModelFamily.parse(family), whole(data, "num_layers"), whole(data, "num_filters"),
                   whole(data, "num_classes"), optional_whole(data, "resnet_version"),
                   whole(data, "in_channels", 3))


def optional_whole(data: Mapping[str, object], key: str) -> int | None:
    """``data[key]`` as an integer (None when missing or None); ValueError for another type."""
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"field {key!r}: expected an integer, got {value!r}")
    return value


def whole(data: Mapping[str, object], key: str, default: int | None = None) -> int:
    """``data[key]`` as an integer (``default`` when missing); ValueError naming ``key`` otherwise."""
    value = optional_whole(data, key)
    if value is None:
        value = default
    if value is None:
        raise ValueError(f"field {key!r} is missing")
    return value
