"""SpatialBatchNorm2d: BatchNorm statistics over the whole image across tiles, running stats as serial."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import SpatialLayer, SpatialRuntime, adopt
from .reduce import partitioned_sum


class SpatialBatchNorm2d(SpatialLayer, nn.BatchNorm2d):
    """BatchNorm2d whose batch statistics cover every tile of the image.

    Training: two-pass statistics (sum, then sum of squared deviations), each one
    all-reduce over the tile group, divided by N x H x W (global size from the runtime);
    backward all-reduces the matching gradient sums.
    Running mean/var (unbiased, N = batch x all pixels) update in place exactly as serial.
    Eval mode with running stats needs no communication.
    """

    @classmethod
    def from_module(cls, bn: nn.BatchNorm2d, runtime: SpatialRuntime, name: str = "") -> SpatialBatchNorm2d:
        return adopt(cls, bn, runtime, name)

    def _momentum(self) -> float:
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                return 1.0 / float(self.num_batches_tracked)
        return 0.0 if self.momentum is None else self.momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        return self.normalize(x, x)

    def normalize(self, x: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` with batch statistics of ``sample`` (this tile's owned part of
        ``x``; a fused halo block passes the owned window of an extended tile)."""
        factor = self._momentum()
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        if not use_batch:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        ctx, group = self.runtime.ctx, self.runtime.group
        height, width = self.runtime.input_size(self, sample)
        count = float(sample.shape[0] * height * width)   # exact integer, any dtype
        mean = partitioned_sum(sample.sum(dim=(0, 2, 3)), ctx, group) / count
        centered = x - mean[None, :, None, None]
        sample_centered = centered if sample is x else sample - mean[None, :, None, None]
        var = partitioned_sum((sample_centered * sample_centered).sum(dim=(0, 2, 3)), ctx,
                              group) / count
        y = centered * torch.rsqrt(var + self.eps)[None, :, None, None]
        if self.affine:
            y = y * self.weight[None, :, None, None] + self.bias[None, :, None, None]
        if (self.training and self.track_running_stats and self.running_mean is not None
                and self.running_var is not None):
            n = count
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
                unbiased = var.detach() * (n / (n - 1)) if n > 1 else var.detach()
                self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
        return y
