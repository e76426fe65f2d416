"""timm's windowed and linear attention families on tiles: which converted module takes which timm block."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..layer import SpatialRuntime
from .linear import adopt_linear_attention, linear_attention_kinds
from .partition import adopt_partition_attention, partition_kinds

Convert = Callable[[nn.Module, str], nn.Module]   # the converter: a child and its full name -> converted child


def convert_attention_family(module: nn.Module, name: str, runtime: SpatialRuntime,
                             convert: Convert) -> nn.Module | None:
    """``module`` converted when it is MaxViT's partition attention or EfficientViT's LiteMLA, else None."""
    if isinstance(module, partition_kinds()):
        return adopt_partition_attention(module, name, runtime, convert)
    if isinstance(module, linear_attention_kinds()):
        return adopt_linear_attention(module, name, runtime, convert)
    return None
