"""Why an op on a tile is not exact: the guard's refusal rules, shared by an image's tiles and a volume's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import ops
from .ops import Args, Kwargs, OpKind, TorchOp
from .tile_marks import is_tiled

TEMPLATE_ONLY = {"to", "type_as", "new_empty", "new_full", "new_ones", "new_tensor", "new_zeros"}

KindRule = Callable[[OpKind | None, TorchOp, Args, Kwargs, list[torch.Tensor]], str | None]


def in_place(name: str) -> bool:
    """Whether the op ``name`` writes into its first argument (``add_``, ``__iadd__``, ``__setitem__``)."""
    return (name.endswith("_") and not name.startswith("__")) or name.startswith("__i") \
        or name == "__setitem__"


def dims_refusal(name: str, args: Args, kwargs: Kwargs, tensors: list[torch.Tensor],
                 offsets: tuple[int, ...]) -> str | None:
    """Why a dimension-wise op on a tile is not exact (None when it is): it works along a tiled dim (the
    last ``len(offsets)``) or joins a tile with a replicated tensor."""
    if ops.is_binary_extremum(name, args, kwargs):
        return ops.check_pointwise(tensors, is_tiled, offsets)
    if name in ("cat", "concat", "concatenate", "stack"):
        joined = args[0] if args else kwargs.get("tensors", ())
        if isinstance(joined, (list, tuple)) and any(
                isinstance(t, torch.Tensor) and not is_tiled(t) for t in joined):
            return (f"{name} joins a tile with a replicated tensor; make it a tile first "
                    f"(e.g. t.expand_as(tile) for a per-channel value)")
    tile = ops.first_tiled(args, is_tiled)
    return None if tile is None else ops.check_dims(name, args, kwargs, tile, len(offsets))


@dataclass(frozen=True)
class TileRules:
    """What the guard does on one kind of grid's tiles (an image's; a volume's: a TileGrid with depth): the rules
    both share, over its tiled dims, then its own rules for the other kinds."""

    offsets: tuple[int, ...]   # a tile's tiled dims, the last ones: rows, cols; on a volume depth too
    whole: str                 # what the tiles split, for the messages: "image", "volume"
    own_rules: KindRule        # why an op of a kind the shared rules leave is not exact (None when it is)
    tile_dims: bool            # a tile's ``shape``/``size()`` give its rows and columns as ``TileDim``
    reshape_refused: bool      # a view/reshape a tile cannot take is refused, not left a bare RuntimeError

    def refusal(self, kind: OpKind | None, func: TorchOp, args: Args, kwargs: Kwargs,
                tensors: list[torch.Tensor]) -> str | None:
        """Why ``func`` on these tiles is not exact, or None when it is."""
        name = ops.op_name(func)
        first = args[0] if args else None
        if in_place(name) and isinstance(first, torch.Tensor) and not is_tiled(first):
            return f"writes tile values into a replicated tensor (one not split like the {self.whole})"
        if kind is OpKind.POINTWISE:
            operands = [first] if name in TEMPLATE_ONLY and isinstance(first, torch.Tensor) else tensors
            return ops.check_pointwise(operands, is_tiled, self.offsets)
        if kind is OpKind.DIMS:   # along batch or channels only (a channel concatenation, a softmax)
            return dims_refusal(name, args, kwargs, tensors, self.offsets)
        if kind is OpKind.CHANNEL:   # per channel (prelu, eval-mode batch_norm)
            return ops.check_channel(func, args, kwargs)
        return self.own_rules(kind, func, args, kwargs, tensors)


def _image_rules(kind: OpKind | None, func: TorchOp, args: Args, kwargs: Kwargs,
                 tensors: list[torch.Tensor]) -> str | None:
    first = args[0] if args else None
    if kind is None:
        return ("is not known to act on each pixel (or along batch/channels) of a tile; if it "
                "does, register it: mpi4dl_nb.spatial.ops.register_op(fn)")
    if kind is OpKind.SHAPE:
        if isinstance(first, torch.Tensor) and not is_tiled(first):
            return ops.check_pointwise([first, *(t for t in tensors if is_tiled(t))], is_tiled)
        return None
    if kind is OpKind.INDEX:
        if isinstance(first, torch.Tensor) and is_tiled(first):
            reason = ops.check_index(first, args[1] if len(args) > 1 else ())
            if reason is None and ops.op_name(func) == "__setitem__" and len(args) > 2 \
                    and isinstance(args[2], torch.Tensor):
                return ops.check_pointwise([args[2], first], is_tiled)
            return reason
        return None   # a replicated table indexed by tile values: per pixel
    if kind is OpKind.CONV:
        return ops.check_conv(args, kwargs)
    if kind is OpKind.DROPOUT:
        return ops.check_dropout(func, args, kwargs)
    if kind is OpKind.RANDOM:
        return ("draws random numbers for one tile (each tile would draw its own, unlike the serial "
                "model); use dropout (made exact on tiles) or move it after the spatial stage")
    if kind is OpKind.WINDOW:
        return ("sees only this rank's tile, without the halo it needs; use the module form "
                "(nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d(1), nn.ConvTranspose2d), "
                "which spatialize makes exact")
    return ops.refusal_hint(func)


def _volume_rules(kind: OpKind | None, func: TorchOp, args: Args, kwargs: Kwargs,
                  tensors: list[torch.Tensor]) -> str | None:
    if kind is OpKind.SHAPE:   # view/reshape: checked on its outputs (the voxel dims stay last)
        return None
    return ("is not known to be exact on a volume's tiles (a TileGrid with depth): only per-voxel "
            "maths and the layers spatialize converts are, so far")


IMAGE = TileRules(offsets=(-2, -1), whole="image", own_rules=_image_rules, tile_dims=True, reshape_refused=True)
# a volume's: per-voxel maths, views keeping the voxel dims last, the op families' handlers for volumes (the other
# families' rules, reductions, functional pools and interpolation, are for images so far)
VOLUME = TileRules(offsets=(-3, -2, -1), whole="volume", own_rules=_volume_rules, tile_dims=False,
                   reshape_refused=False)
