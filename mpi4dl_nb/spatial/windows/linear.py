"""EfficientViT's multi-scale linear attention (timm's ``LiteMLA``) on tiles, exact.

LiteMLA's q/k/v projection and its multi-scale aggregation (a depthwise conv and a grouped 1x1 conv per scale) are
convs: they run as the converted spatial layers they are (halos where the kernel needs them). Its ReLU linear
attention ``out = q (k^T v) / q (k^T 1)`` sums the key-value products over every position of the image: each tile
computes the sum over its own positions, one all-reduce over the tile group gives the image's sum on every tile
(backward: the gradient of that sum, all-reduced, since every tile's queries used it), and each tile's queries
stay local. The attention is computed in the wider of the input's dtype and float32: timm casts it to float32, which
a float64 run would round to float32; in float16/bfloat16/float32 runs this is timm's own precision. The family's
record carries the planner's cost (``linear_cost``) and the same precision for one process (``keep_float64``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError
from ..cost import ExchangeBytes
from ..family import Family, TimmMatch
from ..geometry import TileGrid
from ..layer import Convert, SpatialRuntime, shallow_copy, spatial_class
from ..reduce import partitioned_sum
from ..tile_marks import is_tiled, mark_tiled


def wide_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, eps: float,
                   total: Callable[[torch.Tensor], torch.Tensor] = lambda sums: sums) -> torch.Tensor:
    """timm's ``LiteMLA._attn`` of ``q``, ``k`` and the ones-padded ``v`` in the wider of their dtype and float32
    (timm's: float32, which rounds a float64 run); ``total``: the key-value sums over the whole image."""
    work = torch.promote_types(v.dtype, torch.float32)
    out = q.to(work) @ total(k.to(work).transpose(-1, -2) @ v.to(work))
    return (out[..., :-1] / (out[..., -1:] + eps)).to(v.dtype)


def linear_attention(qkv: torch.Tensor, head_dim: int, kernel: nn.Module, eps: float,
                     runtime: SpatialRuntime) -> torch.Tensor:
    """LiteMLA's attention of a tile's multi-scale ``qkv`` ``(B, heads * 3 * head_dim, h, w)``: ``(B, heads *
    head_dim, h, w)``, the key-value sums taken over the whole image."""
    batch, _, height, width = qkv.shape
    shaped = qkv.reshape(batch, -1, 3 * head_dim, height * width).transpose(-1, -2)
    q, k, v = shaped.chunk(3, dim=-1)
    out = wide_attention(kernel(q), kernel(k), F.pad(v, (0, 1), mode="constant", value=1.0), eps=eps,
                         total=lambda sums: partitioned_sum(sums, runtime.ctx, runtime.group))
    return out.transpose(-1, -2).reshape(batch, -1, height, width)


class TileLinearAttention(nn.Module):
    """Mixin: timm's LiteMLA on this rank's tile (its convs spatial layers, the key-value sum over every tile)."""

    tile_runtime: SpatialRuntime
    layer_name: str
    qkv: nn.Module
    aggreg: nn.ModuleList
    proj: nn.Module
    kernel_func: nn.Module
    dim: int
    eps: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        multi_scale = torch.cat([qkv, *(op(qkv) for op in self.aggreg)], dim=1)
        if not is_tiled(multi_scale):
            raise ConfigError("model", f"layer {self.layer_name!r} (LiteMLA) runs on a replicated (pooled) tensor; "
                              f"on tiles, it attends over image tiles only")
        with torch._C.DisableTorchFunction():
            out = linear_attention(multi_scale, self.dim, self.kernel_func, self.eps, self.tile_runtime)
        out = self.proj(mark_tiled(out))
        return out


def adopt_linear_attention(module: nn.Module, name: str, runtime: SpatialRuntime,
                           convert: Convert) -> nn.Module:
    """``module`` (timm's LiteMLA) on tiles; its convs converted by ``convert``."""
    new = shallow_copy(module, spatial_class(TileLinearAttention, type(module)))
    object.__setattr__(new, "tile_runtime", runtime)
    object.__setattr__(new, "layer_name", name)
    for child_name, child in module.named_children():
        new._modules[child_name] = convert(child, f"{name}.{child_name}")
    return new


def linear_cost(module: nn.Module, grid: TileGrid, sizes: Sequence[int], element_bytes: int) -> ExchangeBytes:
    """``FamilyCost`` of LiteMLA: one all-reduce over the tiles of its key-value sums (every head of every scale:
    ``head_dim x (head_dim + 1)`` values, in float32 or wider), a ring all-reduce's ``2 (P-1)/P`` of them each way;
    held: the sums."""
    widths = int(vars(module.get_submodule("proj.conv"))["in_channels"])     # every scale's heads x head_dim
    held = widths * (int(vars(module)["dim"]) + 1) * max(element_bytes, 4)
    moved = math.ceil(2 * (grid.num_tiles - 1) * held / grid.num_tiles)
    return ExchangeBytes(moved, moved, held) if moved else ExchangeBytes()


def keep_float64(module: nn.Module) -> None:
    """LiteMLA's ``float64_patch``: its attention in the wider of its input's dtype and float32, as on tiles (timm's
    own precision in float32, float16 and bfloat16 runs)."""
    object.__setattr__(module, "_attn", functools.partial(wide_attention, eps=float(vars(module)["eps"])))


LINEAR_ATTENTION = Family("EfficientViT linear attention (timm LiteMLA)", TimmMatch((
    "timm.models.efficientvit_mit.LiteMLA",)), adopt_linear_attention, "tests/mpi/attention_families_exact.py",
    linear_cost, keep_float64)
