"""Per-pixel losses of dense models computed on tiles, never gathering the prediction."""

from __future__ import annotations

import torch
from torch import nn

from .convert import runtime_of
from .reduce import replicated_sum


def tile_mean(values: torch.Tensor, net: nn.Module, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``values`` over every tile of ``net``'s tile group: the serial mean of the full tensor.

    ``values`` is this rank's tile of a per-element quantity (e.g.
    ``F.cross_entropy(out_tile, target_tile, reduction="none")``); ``weights`` (same shape)
    gives a weighted mean ``sum(w * v) / sum(w)`` (ignore masks, class weights). The result
    is the same on every tile; back-propagate it on every tile (each tile's inputs then get
    exactly their share, as with a loss computed from ``gather_tiles``), then sum the tile
    gradients (``reduce_tile_gradients``).
    """
    runtime = runtime_of(net)
    if weights is None:
        numerator = values.sum()
        denominator = values.new_tensor(float(values.numel()))
    else:
        numerator = (values * weights).sum()
        denominator = weights.detach().sum().to(values.dtype)
    total = replicated_sum(torch.stack([numerator, denominator]), runtime.ctx, runtime.group)
    return total[0] / total[1]
