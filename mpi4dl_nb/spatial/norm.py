"""Normalisation over the whole image (or volume) across tiles: BatchNorm, GroupNorm, InstanceNorm (2-D and 3-D).

Each computes its statistics exactly as the serial layer does, but over every tile: two
passes (sum, then sum of squared deviations), each one all-reduce over the tile group
(BatchNorm: over ``runtime.stats_group``, which ``sync_batchnorm`` widens to the
data-parallel copies), divided by the global element count; backward all-reduces the
matching gradient sums. Running statistics update in place exactly as PyTorch does; eval
mode with running statistics needs no communication.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.handles import Group
from ..comm.protocol import Comm
from ..errors import ConfigError
from .batchnorm_fn import LOW_PRECISION, tile_batch_norm
from .layer import SpatialLayer, SpatialRuntime, adopt
from .reduce import partitioned_sum


def moments(x: torch.Tensor, sample: torch.Tensor, dims: Sequence[int], count: float, ctx: Comm,
            group: Group | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x - mean, mean, var)`` with mean and biased variance of ``sample`` over ``dims`` of
    every rank of ``group`` (``count`` elements in all), kept as broadcastable dims."""
    dims = tuple(dims)
    mean = partitioned_sum(sample.sum(dim=dims, keepdim=True), ctx, group) / count
    centered = x - mean
    sample_centered = centered if sample is x else sample - mean
    var = partitioned_sum((sample_centered * sample_centered).sum(dim=dims, keepdim=True), ctx,
                          group) / count
    return centered, mean, var


def _affine(y: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """Per-channel scale and shift of an ``(N, C, *spatial)`` tile."""
    shape = (-1, *[1] * (y.dim() - 2))
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y


def update_running(running_mean: torch.Tensor, running_var: torch.Tensor, mean: torch.Tensor,
                   var: torch.Tensor, count: float, factor: float) -> None:
    """PyTorch's running-statistics update: unbiased variance over ``count`` elements."""
    with torch.no_grad():
        running_mean.mul_(1 - factor).add_(mean.detach().reshape(running_mean.shape), alpha=factor)
        unbiased = var.detach() * (count / (count - 1)) if count > 1 else var.detach()
        running_var.mul_(1 - factor).add_(unbiased.reshape(running_var.shape), alpha=factor)


def batch_norm_factor(bn: nn.modules.batchnorm._NormBase) -> float:
    """Count this training step and return its running-statistics factor, as nn.BatchNorm does."""
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        if bn.momentum is None:
            return 1.0 / float(bn.num_batches_tracked)
    return 0.0 if bn.momentum is None else bn.momentum


def train_batch_norm(bn: nn.modules.batchnorm._BatchNorm, runtime: SpatialRuntime, x: torch.Tensor,
                     pixels: int) -> torch.Tensor:
    """``bn`` on the tile ``x`` of an image (or volume) of ``pixels`` positions: batch statistics over every
    tile (and, with sync_batchnorm, every data-parallel copy: ``runtime.stats_group``/``stats_copies``),
    running mean/var (unbiased, N = batch x all pixels) updated in place exactly as serial; eval mode with
    running statistics needs no communication."""
    if not bn.training and bn.running_mean is not None and bn.running_var is not None:
        return F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
    # one Function saving only the input tile (statistics in float32 for bf16/fp16 tiles)
    factor = batch_norm_factor(bn)
    count = float(x.shape[0] * pixels * runtime.stats_copies)
    y, mean, var = tile_batch_norm(x, bn.weight if bn.affine else None, bn.bias if bn.affine else None,
                                   count, bn.eps, runtime.ctx, runtime.stats_group)
    if bn.track_running_stats and bn.running_mean is not None and bn.running_var is not None:
        update_running(bn.running_mean, bn.running_var, mean, var, count, factor)
    return y


class SpatialBatchNorm(SpatialLayer, nn.modules.batchnorm._BatchNorm):
    """nn.BatchNorm2d / nn.BatchNorm3d whose batch statistics cover every tile of the image or volume (see
    ``train_batch_norm``)."""

    @classmethod
    def from_module(cls, bn: nn.BatchNorm2d | nn.BatchNorm3d, runtime: SpatialRuntime, name: str = "") -> Self:
        return adopt(cls, bn, runtime, name)

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        return train_batch_norm(self, self.runtime, x, math.prod(self.runtime.axis_sizes(self, x)))

    def normalize(self, x: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` with batch statistics of ``sample`` (this tile's owned part of
        ``x``; a fused halo block passes the owned window of an extended tile), image or volume."""
        factor = batch_norm_factor(self)
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        if not use_batch:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        runtime = self.runtime
        pixels = math.prod(runtime.axis_sizes(self, sample))
        count = float(sample.shape[0] * pixels * runtime.stats_copies)   # exact integer
        centered, mean, var = moments(x, sample, (0, *range(2, sample.dim())), count, runtime.ctx,
                                      runtime.stats_group)
        y = _affine(centered * torch.rsqrt(var + self.eps), self.weight if self.affine else None,
                    self.bias if self.affine else None)
        if (self.training and self.track_running_stats and self.running_mean is not None
                and self.running_var is not None):
            update_running(self.running_mean, self.running_var, mean, var, count, factor)
        return y


def group_norm_tile(runtime: SpatialRuntime, owner: object, x: torch.Tensor, groups: int,
                    weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``F.group_norm`` of the whole image, on this (N, C, H, W) tile (a volume's: (N, C, D, H, W); ``owner``:
    the runtime's size key)."""
    if x.dtype in LOW_PRECISION:   # statistics accumulate in float32 (mixed precision)
        return group_norm_tile(runtime, owner, x.float(), groups, weight, bias, eps).to(x.dtype)
    n, c = x.shape[:2]
    positions = math.prod(runtime.axis_sizes(owner, x))
    grouped = x.reshape(n, groups, c // groups, *x.shape[2:])
    count = float(c // groups * positions)
    centered, _, var = moments(grouped, grouped, tuple(range(2, grouped.dim())), count, runtime.ctx,
                               runtime.group)
    y = (centered * torch.rsqrt(var + eps)).reshape(x.shape)
    return _affine(y, weight, bias)


def instance_norm_tile(runtime: SpatialRuntime, owner: object, x: torch.Tensor,
                       running: tuple[torch.Tensor, torch.Tensor] | None, weight: torch.Tensor | None,
                       bias: torch.Tensor | None, momentum: float, eps: float) -> torch.Tensor:
    """``F.instance_norm`` with input statistics of the whole image, on this (N, C, H, W) tile (a volume's:
    (N, C, D, H, W)); the running statistics (when given) updated as the serial call does."""
    count = float(math.prod(runtime.axis_sizes(owner, x)))
    centered, mean, var = moments(x, x, tuple(range(2, x.dim())), count, runtime.ctx, runtime.group)
    y = _affine(centered * torch.rsqrt(var + eps), weight, bias)
    if running is not None:
        update_running(running[0], running[1], mean.mean(0), var.mean(0), count, momentum)
    return y


class SpatialGroupNorm(SpatialLayer, nn.GroupNorm):
    """GroupNorm with per-sample, per-group statistics over the whole image (every tile)."""

    @classmethod
    def from_module(cls, gn: nn.GroupNorm, runtime: SpatialRuntime, name: str = "") -> SpatialGroupNorm:
        return adopt(cls, gn, runtime, name)

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 + self.runtime.grid.ndim:
            raise ConfigError("model", f"{self.layer_name}: spatial GroupNorm needs {tile_shape(self.runtime)} "
                              f"tiles, got {x.dim()}-d")
        return group_norm_tile(self.runtime, self, x, self.num_groups, self.weight if self.affine else None,
                               self.bias if self.affine else None, self.eps)


def tile_shape(runtime: SpatialRuntime) -> str:
    """The shape a layer's tiles have on ``runtime``'s grid, for messages."""
    return "(N, C, D, H, W)" if runtime.grid.volumetric else "(N, C, H, W)"


class SpatialInstanceNorm(SpatialLayer, nn.modules.instancenorm._InstanceNorm):
    """nn.InstanceNorm2d / nn.InstanceNorm3d with per-sample, per-channel statistics over the whole image (or
    volume).

    ``track_running_stats``: running mean/var are the batch means of the per-sample
    statistics (unbiased variance), updated with ``momentum`` (None counts as 0, as in
    PyTorch); eval mode then uses them with no communication.
    """

    @classmethod
    def from_module(cls, norm: nn.InstanceNorm2d | nn.InstanceNorm3d, runtime: SpatialRuntime,
                    name: str = "") -> Self:
        return adopt(cls, norm, runtime, name)

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 + self.runtime.grid.ndim:
            raise ConfigError("model", f"{self.layer_name}: spatial {self.serial_class.__name__} needs batched "
                              f"{tile_shape(self.runtime)} tiles, got {x.dim()}-d")
        use_input_stats = self.training or not self.track_running_stats
        if not use_input_stats:
            return F.instance_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                   False, 0.0, self.eps)
        running = None
        if self.training and self.running_mean is not None and self.running_var is not None:
            running = (self.running_mean, self.running_var)
        return instance_norm_tile(self.runtime, self, x, running, self.weight if self.affine else None,
                                  self.bias if self.affine else None,
                                  0.0 if self.momentum is None else self.momentum, self.eps)
