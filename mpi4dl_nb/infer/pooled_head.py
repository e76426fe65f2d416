"""A cut classifier's pooled head (a global pool, then layers on the pooled vector) applied to every output cell.

``layer_list`` ends a torchvision or timm classifier with one piece that starts where the image is
pooled away: ``avgpool, flatten(), fc`` (ResNet), ``global_pool.pool, global_pool.flatten, fc`` (timm),
``avgpool, classifier.0 (LayerNorm2d), classifier.1 (Flatten), classifier.2 (Linear)`` (ConvNeXt).
As a fully convolutional network the global pool becomes a ``K x K`` window pool (``K`` the trunk's
feature side at the training size) and every later layer acts on each cell's vector: a Linear as a
1x1 convolution with its weights, LayerNorm and BatchNorm1d over the channels of each cell,
activations as they are; flattening and dropout (inference) drop out. A cell's output is then
exactly the head on the features of one training-size patch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..config import ConfigError
from ..models.named_pool import global_pool_kind as pool_kind
from ..models.pieces import Functional, Piece

DROPPED = (nn.Flatten, nn.Identity, nn.modules.dropout._DropoutNd)
# modules that act on each value alone: the same on a cell's vector as on the pooled one
PER_VALUE = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Hardswish, nn.Hardsigmoid, nn.Sigmoid, nn.Tanh, nn.LeakyReLU,
             nn.ELU, nn.Mish, nn.PReLU)


@dataclass(frozen=True)
class PooledHead:
    """A classifier's head: how it pools (``avg``/``max``) and the steps after the pool."""

    pool: str
    steps: tuple[tuple[str, nn.Module], ...]


def pooled_head(layers: Sequence[nn.Module]) -> PooledHead | None:
    """The head of a cut classifier (its last piece, starting with a global pool), or None."""
    last = layers[-1] if layers else None
    if not isinstance(last, Piece):
        return None
    (_, first), *rest = last.steps()
    kind = pool_kind(first)
    return None if kind is None else PooledHead(kind, tuple(rest))


class PerCell(nn.Module):
    """A layer on vectors ``(N, C)`` applied to each cell of ``(N, C, h, w)`` (channels last while it runs)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def as_convolution(linear: nn.Linear) -> nn.Conv2d:
    """``linear`` as a 1x1 convolution with the same weights."""
    conv = nn.Conv2d(linear.in_features, linear.out_features, 1, bias=linear.bias is not None).to(
        linear.weight.dtype)
    with torch.no_grad():
        conv.weight.copy_(linear.weight[:, :, None, None])
        if linear.bias is not None and conv.bias is not None:
            conv.bias.copy_(linear.bias)
    return conv


def per_cell(path: str, module: nn.Module) -> nn.Module | None:
    """``module`` of a head, acting on every cell's vector (None: it drops out); ConfigError for one that cannot."""
    if isinstance(module, DROPPED) or (isinstance(module, Functional) and module.call.name == "flatten"):
        return None
    if isinstance(module, nn.Linear):
        return as_convolution(module)
    if isinstance(module, PER_VALUE):
        return module
    if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) == 1:
        # a LayerNorm over channels written for (N, C, H, W) (ConvNeXt's LayerNorm2d) already acts per cell
        return module if type(module).forward is not nn.LayerNorm.forward else PerCell(module)
    if isinstance(module, nn.BatchNorm1d):
        return PerCell(module)
    raise ConfigError("--checkpoint", f"the classifier's head applies {path} ({type(module).__name__}) after its "
                                      f"global pool; only Linear, LayerNorm, BatchNorm1d, activations, flatten and "
                                      f"dropout can be applied to each output cell, so the network cannot be made "
                                      f"fully convolutional")


def head_on_cells(head: PooledHead, window: int, stride: int) -> list[nn.Module]:
    """The head as a window pool (``window`` x ``window`` feature cells, ``stride``) and per-cell layers."""
    pool: nn.Module = nn.AvgPool2d(window, stride=stride) if head.pool == "avg" else nn.MaxPool2d(window, stride)
    converted = [per_cell(path, module) for path, module in head.steps]
    return [pool, *(m for m in converted if m is not None)]
