"""timm's attention modules on token tiles: their own forward, with scaled_dot_product_attention spanning the ring."""

from __future__ import annotations

from collections.abc import Collection
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ...errors import ConfigError
from ..family import Family, TimmMatch
from ..layer import Convert, SpatialRuntime, shallow_copy, spatial_class
from ..ops import TorchOp, argument
from ..tile_marks import is_tiled, layout_of, mark_tiled
from .pools import first_tile_value
from .ring import Ring, ring_attention
from .tiles import TokenTiles
from .traffic import attention_ring_cost

TOKEN_TILES = "vit token tiles"   # key of the running forward's TokenTiles in SpatialRuntime.plans


class _RingScaledDotProduct(TorchFunctionMode):
    """Inside a known attention's forward: every op runs as it is, except scaled_dot_product_attention, which
    attends to every ring member's keys."""

    def __init__(self, ring: Ring, where: str, first_tile: TokenTiles | None = None) -> None:
        super().__init__()
        self.ring, self.where, self.first_tile = ring, where, first_tile   # first_tile: tile 0's result everywhere

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
        grouped = argument(args, kwargs, 7, "enable_gqa", False)
        if mask is not None or causal or dropout or grouped:
            what = "an attention mask" if mask is not None else "causal masking" if causal else \
                "attention dropout" if dropout else "enable_gqa"
            raise ConfigError("model", f"{self.where}: F.scaled_dot_product_attention with {what} is not supported "
                              f"on token tiles (attention spans every tile's tokens). Ways out: no mask, "
                              f"attn_drop_rate=0, or train this model without spatial parallelism")
        assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
        out = ring_attention(q, k, v, self.ring, scale=scale if isinstance(scale, float) else None)
        if self.first_tile is None:
            return out
        return first_tile_value(out, self.first_tile, self.ring.comm, self.ring.group)


class TokenAttention(nn.Module):
    """Mixin: a timm attention module on this rank's token tile (its prefix-token count is this tile's); an
    attention pool (``pools``: its latent queries, the same on every tile) gives tile 0's result on every rank."""

    tile_runtime: SpatialRuntime
    layer_name: str
    serial_class: type[nn.Module]
    pools: bool

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        runtime = self.tile_runtime
        tiles = runtime.plans.get(TOKEN_TILES)
        where = f"layer {self.layer_name!r} ({self.serial_class.__name__})"
        if not isinstance(tiles, TokenTiles) or not is_tiled(x) or not layout_of(x).flat:
            raise ConfigError("model", f"{where} attends over a tensor that is not a vision transformer's token "
                              f"tile: on tiles, timm's attention runs inside a VisionTransformer or Eva only")
        if not torch._C._is_torch_function_enabled():
            raise ConfigError("model", f"{where} runs with the op guard suspended (registered as element-wise?); "
                              f"its attention must span the tiles: do not pass its block in elementwise=")
        if x.shape[1] != tiles.key_counts[tiles.tile]:
            raise ValueError(f"{where}: {x.shape[1]} tokens here, the token tiles say {tiles.key_counts[tiles.tile]}")
        ring = Ring(runtime.ctx, runtime.group, tiles.key_counts, name=self.layer_name)
        with _RingScaledDotProduct(ring, where, tiles if self.pools else None):
            out = super().forward(x, *args, **kwargs)
        return out if self.pools else mark_tiled(out, layout_of(x))


# an attention pool's parameters used per token or for the queries tile 0's result comes from: tile shares
POOL_SHARES = ("latent", "q.", "q_norm.", "kv.", "k_norm.")


def _adopt(pools: bool, module: nn.Module, name: str, runtime: SpatialRuntime, _: Convert) -> nn.Module:
    """``module`` (a timm attention, or with ``pools`` an attention pool) as a TokenAttention sharing its state; its
    parameters used on tokens are tile shares (an attention pool's projection and MLP act on its replicated result)."""
    if pools and getattr(module, "pos_embed", None) is not None:
        raise ConfigError("model", f"layer {name!r} ({type(module).__name__}) adds a position embedding of a fixed "
                          f"token count to the tokens; not supported on tiles (create it with pos_embed='')")
    new = shallow_copy(module, spatial_class(TokenAttention, type(module)))
    object.__setattr__(new, "tile_runtime", runtime)
    object.__setattr__(new, "layer_name", name)
    object.__setattr__(new, "serial_class", type(module))
    object.__setattr__(new, "pools", pools)
    object.__setattr__(new, "fused_attn", True)   # tokens mix only in scaled_dot_product_attention
    if hasattr(module, "num_prefix_tokens") and runtime.tile != 0:
        object.__setattr__(new, "num_prefix_tokens", 0)   # tile 0 holds the class/register tokens
    for parameter_name, parameter in module.named_parameters():
        if not pools or parameter_name.startswith(POOL_SHARES):
            runtime.claim_tile_share(parameter)
    return new


VIT_ATTENTION = Family("ViT attention (timm Attention, AttentionRope, EvaAttention)", TimmMatch((
    "timm.layers.attention.Attention", "timm.layers.attention.AttentionRope", "timm.models.eva.EvaAttention")),
    partial(_adopt, False), "tests/mpi/vit_exact.py", attention_ring_cost)
VIT_ATTENTION_POOL = Family("ViT attention (timm AttentionPoolLatent)", TimmMatch((
    "timm.layers.attention_pool.AttentionPoolLatent",)), partial(_adopt, True), "tests/mpi/vit_exact.py",
    attention_ring_cost)
