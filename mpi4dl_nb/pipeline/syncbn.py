"""sync_batchnorm: BatchNorm statistics over the data-parallel copies of a micro-batch.

With ``ParallelConfig(sync_batchnorm=True)`` the copies that run the same stage on the same
micro-batch at the same tick (full data-parallel replicas, local-DP copies) normalise over
their combined samples: each BatchNorm all-reduces its sums over the copies' group, as the
spatial BatchNorm does over tiles, and backward all-reduces the gradient sums. Running
statistics are updated from the combined statistics, identically on every copy.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.handles import Group
from ..comm.protocol import Comm
from ..spatial.layer import shallow_copy
from ..spatial.norm import batch_norm_factor, moments, update_running


class _SyncBatchNorm:
    """Mixin over an nn.BatchNorm{1,2,3}d: batch statistics over ``sync_group``."""

    sync_ctx: Comm
    sync_group: Group
    sync_copies: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn = cast(nn.modules.batchnorm._BatchNorm, self)   # the mixin is only ever over a BatchNorm class
        bn._check_input_dim(x)
        if not bn.training and bn.running_mean is not None:
            return F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
        factor = batch_norm_factor(bn)
        dims = [0, *range(2, x.dim())]
        count = float(x.numel() // x.shape[1] * self.sync_copies)   # equal chunks on every copy
        centered, mean, var = moments(x, x, dims, count, self.sync_ctx, self.sync_group)
        y = centered * torch.rsqrt(var + bn.eps)
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        if bn.affine:
            y = y * bn.weight.view(shape) + bn.bias.view(shape)
        if bn.training and bn.track_running_stats and bn.running_mean is not None and bn.running_var is not None:
            update_running(bn.running_mean, bn.running_var, mean, var, count, factor)
        return y


_SYNC_CLASSES: dict[type, type] = {}


def _sync_class(cls: type) -> type:
    """``Sync<cls>``: the BatchNorm class ``cls`` with the synchronised forward (one per class)."""
    if cls not in _SYNC_CLASSES:
        _SYNC_CLASSES[cls] = type(f"Sync{cls.__name__}", (_SyncBatchNorm, cls), {})
    return _SYNC_CLASSES[cls]


def synchronize_batchnorm(module: nn.Module, ctx: Comm, group: Group, copies: int) -> nn.Module:
    """A copy of ``module`` whose BatchNorms normalise over ``group`` (``copies`` equal batches).

    Containers are shallow copies, parameters and buffers the same objects (as spatialize).
    """
    done: dict[int, nn.Module] = {}

    def convert(m: nn.Module) -> nn.Module:
        if id(m) in done:
            return done[id(m)]
        new: nn.Module
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and type(m).__module__.startswith("torch."):
            new = shallow_copy(m, _sync_class(type(m)))
            object.__setattr__(new, "sync_ctx", ctx)
            object.__setattr__(new, "sync_group", group)
            object.__setattr__(new, "sync_copies", copies)
        elif any(True for _ in m.children()):
            new = shallow_copy(m, type(m))
            for name, child in m.named_children():
                new._modules[name] = convert(child)
        else:
            new = m
        done[id(m)] = new
        return new

    return convert(module)
