"""timm's attention modules on token tiles: their own forward, with scaled_dot_product_attention spanning the ring."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..comm.handles import Group
from ..comm.protocol import Comm
from ..errors import ConfigError
from .guard import is_tiled, layout_of, mark_tiled
from .layer import SpatialRuntime, shallow_copy, spatial_class
from .ops import TorchOp, argument
from .reduce import partitioned_sum
from .tokens import TokenTiles

TOKEN_TILES = "vit token tiles"   # key of the running forward's TokenTiles in SpatialRuntime.plans


@dataclass(frozen=True)
class Ring:
    """STAND-IN for ``ring_attention.Ring`` (same fields) until the ring branch is merged."""

    comm: Comm
    group: Group | None
    key_counts: tuple[int, ...]


def _gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring,
                        scale: float | None = None) -> torch.Tensor:
    """STAND-IN for ``ring_attention`` (same signature): every member's keys and values all-gathered
    (a differentiable sum of zero-padded blocks whose backward sums the gradients), then plain attention."""
    members = ring.comm.world_size if ring.group is None else len(ring.group.ranks)
    position = ring.comm.rank if ring.group is None else list(ring.group.ranks).index(ring.comm.rank)
    start = sum(ring.key_counts[:position])
    total = sum(ring.key_counts)

    if members == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    # keys and values in ONE sum: two sums' backwards may run in different orders on different ranks
    padded = F.pad(torch.cat([k, v], dim=-1), (0, 0, start, total - start - k.shape[-2]))
    keys, values = partitioned_sum(padded, ring.comm, ring.group).split([k.shape[-1], v.shape[-1]], dim=-1)
    return F.scaled_dot_product_attention(q, keys, values, scale=scale)


ring_attention = _gathered_attention


@cache
def attention_kinds() -> tuple[type[nn.Module], ...]:
    """timm's attention classes whose forward mixes tokens only through scaled_dot_product_attention (when
    ``fused_attn``); empty without timm."""
    try:
        from timm.layers.attention import Attention, AttentionRope
        from timm.models.eva import EvaAttention
    except ImportError:
        return ()
    return (Attention, AttentionRope, EvaAttention)


class _RingScaledDotProduct(TorchFunctionMode):
    """Inside a known attention's forward: every op runs as it is, except scaled_dot_product_attention, which
    attends to every ring member's keys."""

    def __init__(self, ring: Ring, where: str) -> None:
        super().__init__()
        self.ring, self.where = ring, where

    def __torch_function__(self, func: TorchOp, types: Collection[type], args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunction():
            if func is not F.scaled_dot_product_attention:
                return func(*args, **kwargs)
            return self._attention(args, kwargs)

    def _attention(self, args: tuple[object, ...], kwargs: dict[str, object]) -> torch.Tensor:
        q, k, v = (argument(args, kwargs, i, name) for i, name in enumerate(("query", "key", "value")))
        mask, dropout = argument(args, kwargs, 3, "attn_mask"), argument(args, kwargs, 4, "dropout_p", 0.0)
        causal, scale = argument(args, kwargs, 5, "is_causal", False), argument(args, kwargs, 6, "scale")
        if mask is not None or causal or dropout:
            what = "an attention mask" if mask is not None else "causal masking" if causal else "attention dropout"
            raise ConfigError("model", f"{self.where}: F.scaled_dot_product_attention with {what} is not supported "
                              f"on token tiles (attention spans every tile's tokens). Ways out: no mask, "
                              f"attn_drop_rate=0, or train this model without spatial parallelism")
        assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
        return ring_attention(q, k, v, self.ring, scale=scale if isinstance(scale, float) else None)


class TokenAttention(nn.Module):
    """Mixin: a timm attention module on this rank's token tile (its prefix-token count is this tile's)."""

    tile_runtime: SpatialRuntime
    layer_name: str
    serial_class: type[nn.Module]

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        runtime = self.tile_runtime
        tiles = runtime.plans.get(TOKEN_TILES)
        where = f"layer {self.layer_name!r} ({self.serial_class.__name__})"
        if not isinstance(tiles, TokenTiles) or not is_tiled(x) or not layout_of(x).flat:
            raise ConfigError("model", f"{where} attends over a tensor that is not a vision transformer's token "
                              f"tile: on tiles, timm's attention runs inside a VisionTransformer or Eva only")
        if x.shape[1] != tiles.key_counts[tiles.tile]:
            raise ValueError(f"{where}: {x.shape[1]} tokens here, the token tiles say {tiles.key_counts[tiles.tile]}")
        layout = layout_of(x)
        with _RingScaledDotProduct(Ring(runtime.ctx, runtime.group, tiles.key_counts), where):
            out = super().forward(x, *args, **kwargs)
        return mark_tiled(out, layout)


def adopt_attention(module: nn.Module, runtime: SpatialRuntime, name: str) -> nn.Module:
    """``module`` (a timm attention) as a TokenAttention sharing its state; its parameters are tile shares."""
    new = shallow_copy(module, spatial_class(TokenAttention, type(module)))
    object.__setattr__(new, "tile_runtime", runtime)
    object.__setattr__(new, "layer_name", name)
    object.__setattr__(new, "serial_class", type(module))
    object.__setattr__(new, "fused_attn", True)   # tokens mix only in scaled_dot_product_attention
    if hasattr(module, "num_prefix_tokens") and runtime.tile != 0:
        object.__setattr__(new, "num_prefix_tokens", 0)   # tile 0 holds the class/register tokens
    for parameter in module.parameters():
        runtime.claim_tile_share(parameter)
    return new
