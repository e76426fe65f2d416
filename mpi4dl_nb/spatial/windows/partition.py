"""MaxViT's block and grid attention on tiles (timm's ``PartitionAttentionCl`` and ``PartitionAttention2d``), exact.

The block keeps its forward (norms, MLP, LayerScale and residuals run per token under the op guard); only its
``_partition_attn`` is replaced: every token goes to the tile attending its window (``owners.py``: block
windows inside a tile stay there, grid windows and windows straddling tiles are brought whole to one tile, each tile
attending about 1/P of the windows), timm's attention (relative position bias included) runs on those whole windows
as one process runs it, and the results go back to the tiles owning the tokens (each way one
``exchange.TokenExchange``; the backward moves the gradients the reverse way). The attention's parameters take
each tile's share of their gradient, summed over the tiles with the spatial layers'.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ...errors import ConfigError
from ..family import Family, TimmMatch
from ..function_ctx import FunctionContext
from ..layer import Convert, SpatialRuntime, shallow_copy, spatial_class
from ..tile_layout import STANDARD, TileLayout
from ..tile_marks import is_tiled, layout_of, mark_tiled
from .exchange import TokenExchange
from .owners import PartitionKind, PartitionPlan, WindowPartition, partition_plan
from .traffic import partition_cost

CHANNELS_LAST = TileLayout(-3, -2)   # (B, rows, cols, C): PartitionAttentionCl's input


def exchanges_for(runtime: SpatialRuntime, plan: PartitionPlan) -> tuple[TokenExchange, TokenExchange]:
    """The token moves of ``plan`` into its windows and back (cached with the plan)."""
    key = ("maxvit moves", plan.partition)
    found = runtime.plans.get(key)
    if not isinstance(found, tuple):
        found = runtime.plans[key] = tuple(TokenExchange(moves.gather(), runtime.ctx, runtime.ranks, runtime.group)
                                           for moves in (plan.moves, plan.moves.reversed()))
    into, back = found
    return into, back


def cached_partition_plan(runtime: SpatialRuntime, partition: WindowPartition, where: str) -> PartitionPlan:
    """This tile's plan of ``partition`` (cached per partition and token grid)."""
    key = ("maxvit windows", partition)
    plan = runtime.plans.get(key)
    if not isinstance(plan, PartitionPlan):
        if not partition.fits():
            raise ConfigError("image_size", f"{where}: its {partition.kind.value} partition {partition.size} does "
                              f"not divide the {partition.tokens} token grid (one process fails there too); use an "
                              f"image size whose token grids are multiples of the window and grid sizes")
        plan = partition_plan(partition, runtime.grid, runtime.tile)
        runtime.plans[key] = plan
    return plan


class TilePartitionAttention(nn.Module):
    """Mixin: a timm MaxViT partition-attention block whose windows are attended whole on one tile each."""

    tile_runtime: SpatialRuntime
    layer_name: str
    serial_class: type[nn.Module]
    partition_block: bool
    partition_size: tuple[int, int]
    channels_last: bool   # PartitionAttentionCl's (B, rows, cols, C), else PartitionAttention2d's (B, C, rows, cols)
    attn: nn.Module

    def _partition_attn(self, x: torch.Tensor) -> torch.Tensor:
        runtime, channels_last = self.tile_runtime, self.channels_last
        layout = layout_of(x)
        if not is_tiled(x) or layout != (CHANNELS_LAST if channels_last else STANDARD):
            shape = "(B, rows, cols, C)" if channels_last else "(B, C, rows, cols)"
            raise ConfigError("model", f"layer {self.layer_name!r} ({self.serial_class.__name__}) gets a tensor "
                              f"that is not an image tile {shape}; on tiles, it runs inside timm's MaxxVitBlock only")
        with torch._C.DisableTorchFunction():
            out = self._attend_windows(x, runtime, channels_last)
        return mark_tiled(out, layout)

    def _attend_windows(self, x: torch.Tensor, runtime: SpatialRuntime, channels_last: bool) -> torch.Tensor:
        """The windows' attention (the op guard off): move, attend, move back."""
        if not channels_last:
            x = x.permute(0, 2, 3, 1)
        batch, height, width, channels = x.shape
        kind = PartitionKind.BLOCK if self.partition_block else PartitionKind.GRID
        tokens = runtime.image_size_of(self, (height, width))
        where = f"layer {self.layer_name!r} ({self.serial_class.__name__})"
        check_no_dropout(self.attn, self.layer_name)
        plan = cached_partition_plan(runtime, WindowPartition(kind, tuple(self.partition_size), tokens), where)   # type: ignore[arg-type]
        into, back_out = exchanges_for(runtime, plan)
        windows = into(x.reshape(batch, height * width, channels))
        if plan.windows_here:
            shaped = windows.view(batch * plan.windows_here, *plan.partition.window, channels)
            attended = self.attn(shaped if channels_last else shaped.permute(0, 3, 1, 2))
            windows = (attended if channels_last else attended.permute(0, 2, 3, 1)).reshape(windows.shape)
        elif torch.is_grad_enabled():   # no window here: a zero share for every parameter (the tiles sum alike)
            windows = _ZeroShares.apply(windows, *self.attn.parameters())
        back = back_out(windows).view(batch, height, width, channels)
        return back if channels_last else back.permute(0, 3, 1, 2)


class _ZeroShares(torch.autograd.Function):
    """Identity on ``x`` whose backward gives each of ``parameters`` a zero gradient: this tile's share when it
    attends no window, so every tile sums the same parameters' gradients."""

    @staticmethod
    def forward(fctx: FunctionContext, x: torch.Tensor, *parameters: torch.Tensor) -> torch.Tensor:
        fctx.save_for_backward(*parameters)
        return x.view_as(x)

    @staticmethod
    def backward(fctx: FunctionContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (grad, *(torch.zeros_like(p) for p in fctx.saved_tensors))


def check_no_dropout(attention: nn.Module, name: str) -> None:
    """Refuse training-mode dropout inside the window attention (attention or projection dropout, the dropout of
    a relative position MLP): its mask would be drawn per window owner, not as one process draws it."""
    for part, module in attention.named_modules():
        rate = float(getattr(module, "p", 0.0)) if isinstance(module, nn.Dropout) else 0.0
        if rate and attention.training:
            raise ConfigError("model", f"layer '{name}.attn.{part}' (Dropout, p={rate}) inside MaxViT's window "
                              f"attention draws its mask per window owner on tiles; not supported in training. "
                              f"Ways out: a model without it (attn_drop=0, proj_drop=0; relative position bias "
                              f"instead of the MLP's), eval mode, or train it without spatial parallelism")


def _adopt(channels_last: bool, module: nn.Module, name: str, runtime: SpatialRuntime, convert: Convert) -> nn.Module:
    """``module`` (a timm MaxViT partition-attention block, ``channels_last``: PartitionAttentionCl) on tiles; its
    children converted by ``convert``."""
    new = shallow_copy(module, spatial_class(TilePartitionAttention, type(module)))
    object.__setattr__(new, "tile_runtime", runtime)
    object.__setattr__(new, "layer_name", name)
    object.__setattr__(new, "serial_class", type(module))
    object.__setattr__(new, "channels_last", channels_last)
    for child_name, child in module.named_children():
        if child_name != "attn":   # the attention runs whole on windows, unconverted
            new._modules[child_name] = convert(child, f"{name}.{child_name}")
    for parameter in module.attn.parameters():   # type: ignore[union-attr]
        runtime.claim_tile_share(parameter)
    return new


PARTITION_ATTENTION_CL = Family("MaxViT partition attention (timm PartitionAttentionCl)", TimmMatch((
    "timm.models.maxxvit.PartitionAttentionCl",)), partial(_adopt, True), "tests/mpi/attention_families_exact.py",
    partition_cost)
PARTITION_ATTENTION_2D = Family("MaxViT partition attention (timm PartitionAttention2d)", TimmMatch((
    "timm.models.maxxvit.PartitionAttention2d",)), partial(_adopt, False), "tests/mpi/attention_families_exact.py",
    partition_cost)
