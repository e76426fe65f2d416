"""timm's SwinTransformer and SwinTransformerV2 on tiles: shifted windows and patch merging gathered across tiles.
More: docs/spatial.md#notes-by-module."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ...errors import ConfigError
from ..dropout import check_random_state
from ..family import PATCH_EMBED, Family, TimmMatch, refused, timm_classes
from ..layer import Convert, SpatialRuntime, shallow_copy, spatial_class
from ..reduce import replicated_sum
from ..tokens.tiles import check_patch_grid, int_pair
from .exchange import TokenExchange
from .masks import RegionMask
from .plan import ShiftedWindows, TokenBoxes, WindowLayout, plan_merge
from .traffic import swin_block_cost, swin_cost, swin_merge_cost

STAGE_DROPOUTS = ("drop_path1", "drop_path2")
SWIN_MODELS = ("timm.models.swin_transformer.SwinTransformer", "timm.models.swin_transformer_v2.SwinTransformerV2")
SWIN_BLOCKS = ("timm.models.swin_transformer.SwinTransformerBlock",
               "timm.models.swin_transformer_v2.SwinTransformerV2Block")
SWIN_MERGES = ("timm.models.swin_transformer.PatchMerging", "timm.models.swin_transformer_v2.PatchMerging")
SWIN_MERGE_V2 = ("timm.models.swin_transformer_v2.PatchMerging",)   # its norm after the reduction
SWIN_STAGES = ("timm.models.swin_transformer.SwinTransformerStage",
               "timm.models.swin_transformer_v2.SwinTransformerV2Stage")


def _runtime(module: nn.Module) -> SpatialRuntime:
    runtime = module.__dict__["tile_runtime"]
    assert isinstance(runtime, SpatialRuntime)
    return runtime


class _WindowPlan:
    """One tile's windows of one block geometry: the gathers in and out, the mask of its windows (None: unshifted)."""

    def __init__(self, runtime: SpatialRuntime, windows: ShiftedWindows) -> None:
        layout = WindowLayout(windows, TokenBoxes(runtime.grid, windows.sizes))
        tile = runtime.tile
        self.lengths = layout.boxes.lengths(tile)
        self.count = len(layout.owned(tile))
        self.area = windows.area
        self.into = TokenExchange(layout.into_windows()[tile], runtime.ctx, runtime.ranks, runtime.group)
        self.back = TokenExchange(layout.out_of_windows()[tile], runtime.ctx, runtime.ranks, runtime.group)
        self.region_mask = RegionMask(torch.tensor(layout.labels(tile), dtype=torch.long).reshape(
            self.count, self.area)) if windows.shifted and self.count else None

    def mask(self, like: torch.Tensor) -> torch.Tensor | None:
        """Swin's ``(windows, area, area)`` mask of this tile's windows in ``like``'s dtype (None: unshifted)."""
        return None if self.region_mask is None else self.region_mask.like(like)


class WindowBlock(nn.Module):
    """Mixin: a timm Swin(V2) block whose ``_attn`` computes the windows of the global grid across tiles."""

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        runtime = _runtime(self)
        window, shift = int_pair(self.window_size), int_pair(self.shift_size)
        sizes = int_pair(self.input_resolution)
        key = ("swin windows", sizes, window, shift)
        plan = runtime.plans.get(key)
        if not isinstance(plan, _WindowPlan):
            plan = runtime.plans[key] = _WindowPlan(runtime, ShiftedWindows(sizes, window, shift))
        batch, channels = x.shape[0], x.shape[-1]
        if tuple(x.shape[1:3]) != plan.lengths:
            raise ValueError(f"tile {runtime.tile}: a block of the {sizes} token grid expects a {plan.lengths} tile, "
                             f"got {tuple(x.shape)}")
        windows = plan.into(x.reshape(batch, -1, channels)).reshape(batch * plan.count, plan.area, channels)
        attention = self.get_submodule("attn")
        if plan.count:
            attended = attention(windows, mask=plan.mask(x))
        else:   # no window here: attention of one zero window appended to the empty ones, none of it kept (zero
            # gradients on every rank; the gather's backward still runs, to return the tokens other tiles used)
            attended = attention(torch.cat([windows, windows.new_zeros((1, plan.area, channels))]))[:0]
        return plan.back(attended.reshape(batch, plan.count * plan.area, channels)).reshape(x.shape)


class TileMerge(nn.Module):
    """Mixin: timm's PatchMerging (V1: norm, reduction; V2: reduction, norm) of the global grid on tiles."""

    grid_in: tuple[int, int]
    norm_last: bool   # V2's order: the reduction, then the norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        runtime = _runtime(self)
        key = ("swin merge", self.grid_in)
        exchange = runtime.plans.get(key)
        if not isinstance(exchange, TokenExchange):
            exchange = runtime.plans[key] = TokenExchange(plan_merge(TokenBoxes(runtime.grid, self.grid_in))
                                                          [runtime.tile], runtime.ctx, runtime.ranks, runtime.group)
        merged_grid = TokenBoxes(runtime.grid, tuple((n + 1) // 2 for n in self.grid_in))
        batch, channels = x.shape[0], x.shape[-1]
        merged = exchange(x.reshape(batch, -1, channels))
        merged = merged.reshape(batch, *merged_grid.lengths(runtime.tile), 4 * channels)
        norm, reduction = self.get_submodule("norm"), self.get_submodule("reduction")
        return norm(reduction(merged)) if self.norm_last else reduction(norm(merged))


class SwinTileModel(nn.Module):
    """Mixin: a timm SwinTransformer(V2)'s forward on this rank's image tile (its output on every rank)."""

    serial_class: type[nn.Module]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = pooled_on_tiles(self, x, type(self).__name__)
        with torch._C.DisableTorchFunction():
            for step in ("head.drop", "head.fc", "head.flatten"):
                pooled = self.get_submodule(step)(pooled)
        return pooled


def pooled_on_tiles(model: nn.Module, x: torch.Tensor, label: str) -> torch.Tensor:
    """The average over the image's last-stage tokens (replicated on every tile) of a converted Swin(V2) on this
    rank's image tile ``x``."""
    tokens, token_grid = tokens_on_tiles(model, x, label)
    with torch._C.DisableTorchFunction():
        tokens = model.get_submodule("norm")(model.get_submodule("layers")(tokens))
    return mean_on_tiles(tokens, _runtime(model), final_tokens(model, token_grid))


def tokens_on_tiles(model: nn.Module, x: torch.Tensor, label: str) -> tuple[torch.Tensor, tuple[int, int]]:
    """The patch embedding (``model.patch_embed``, of a Swin or of a cut one's embedding piece) on this rank's image
    tile ``x``: the tile's box of the token grid ``(B, h, w, C)``, and that grid."""
    runtime = _runtime(model)
    check_forward(model, runtime, x.device)
    embed = model.get_submodule("patch_embed")
    size = runtime.root_size
    assert size is not None and len(size) == 2
    token_grid = check_patch_grid(runtime.grid, (size[0], size[1]), int_pair(embed.patch_size), label)
    built = int_pair(embed.grid_size)
    if token_grid != built:
        raise ConfigError("image_size", f"{label} was built for a {built} token grid (its windows, masks and "
                          f"merges), the image gives {token_grid}; create it with img_size= the image's size")
    tokens = embed.get_submodule("proj")(x)   # a spatial conv, under the op guard
    with torch._C.DisableTorchFunction():
        return embed.get_submodule("norm")(tokens.permute(0, 2, 3, 1)), token_grid


def mean_on_tiles(tokens: torch.Tensor, runtime: SpatialRuntime, count: int) -> torch.Tensor:
    """The mean over the image's ``count`` tokens of every tile's ``(B, h, w, C)`` box: one all-reduce, the same
    ``(B, C)`` on every tile."""
    with torch._C.DisableTorchFunction():
        total = replicated_sum(tokens.sum(dim=(1, 2)), runtime.ctx, runtime.group) \
            if len(runtime.ranks) > 1 else tokens.sum(dim=(1, 2))
        return total / count


def final_tokens(model: nn.Module, token_grid: tuple[int, int]) -> int:
    """Tokens of the last stage's grid: the patch grid halved (rounded up) by every merge."""
    rows, cols = token_grid
    for stage in model.get_submodule("layers").children():
        if not isinstance(stage.get_submodule("downsample"), nn.Identity):
            rows, cols = (rows + 1) // 2, (cols + 1) // 2
    return rows * cols


def _random_draws(model: nn.Module) -> Iterator[tuple[str, nn.Module, float]]:
    """(name, module, rate) of every dropout and stochastic depth of the model that draws in training."""
    for name, module in model.named_modules():
        rate = float(getattr(module, "p", 0.0) or getattr(module, "drop_prob", 0.0) or 0.0)
        if rate and (isinstance(module, nn.Dropout) or type(module).__name__ == "DropPath"):
            yield name, module, rate


def check_forward(model: nn.Module, runtime: SpatialRuntime, device: torch.device) -> None:
    """Refuse what a forward on tiles would not compute as one process: element-wise dropout inside the stages
    (its mask would be drawn per tile or per window), tiles holding different random states when stochastic depth or
    the head's dropout draw (one number per sample, as one process draws them), recomputation of blocks that
    communicate."""
    draws = list(_random_draws(model)) if model.training else []
    for name, module, rate in draws:
        if isinstance(module, nn.Dropout) and not name.startswith("head."):
            raise ConfigError("model", f"{type(model).__name__}.{name} (dropout, rate {rate}) in training draws its "
                              f"mask per tile and window, not for the whole image; create the model with "
                              f"proj_drop_rate=0 and attn_drop_rate=0 (drop_path_rate and drop_rate are exact)")
    if draws:
        check_random_state(runtime.guard, torch.bernoulli, device)
    stages = model._modules.get("layers")     # a cut Swin's embedding or head piece has none
    for index, stage in stages.named_children() if stages is not None else ():
        if getattr(stage, "grad_checkpointing", False):
            raise ConfigError("model", f"{type(model).__name__}.layers.{index}: grad checkpointing recomputes blocks "
                              f"that exchange windows across tiles; call set_grad_checkpointing(False)")


def _check_model(model: nn.Module, name: str) -> None:
    """Refuse before work what the tile forward does not compute exactly."""
    where = f"layer {name or '<root>'!r} ({type(model).__name__})"
    if type(model) not in timm_classes(SWIN_MODELS):
        raise ConfigError("model", f"{where}: a subclass of {type(model).__mro__[1].__name__} with its own forward "
                          f"is not supported on tiles; supported: SwinTransformer and SwinTransformerV2 as timm "
                          f"builds them")
    check_swin_parts(model, where)


def check_swin_parts(model: nn.Module, where: str) -> None:
    """Refuse before work a patch embedding, pool, stage, merge or block of a Swin that the tile forward does not
    compute exactly."""
    check_swin_embedding(model.get_submodule("patch_embed"), where)
    check_swin_pool(model.get_submodule("head.global_pool"), where)
    for stage_name, stage in model.get_submodule("layers").named_children():
        check_swin_stage(stage, f"layers.{stage_name}", where)


def check_swin_embedding(embed: nn.Module, where: str) -> None:
    """Refuse a Swin's patch embedding that the tiles cannot compute (dynamic size or padding)."""
    if type(embed) not in timm_classes(PATCH_EMBED) or getattr(embed, "dynamic_img_pad", False) or \
            not getattr(embed, "strict_img_size", True):
        raise ConfigError("model", f"{where}: patch embedding {type(embed).__name__} (dynamic size or padding) is "
                          f"not supported on tiles; create the model with a fixed img_size")


def check_swin_pool(pool_module: nn.Module, where: str) -> None:
    """Refuse a Swin head's pool other than the average."""
    pool = getattr(pool_module, "pool_type", None)
    if pool != "avg":
        raise ConfigError("model", f"{where}: global_pool={pool!r} is not supported on tiles; create the model with "
                          f"global_pool='avg'")


def check_swin_stage(stage: nn.Module, path: str, where: str) -> None:
    """Refuse a Swin stage (at ``path`` in its model) whose merge or blocks the tiles do not compute exactly."""
    if type(stage) not in timm_classes(SWIN_STAGES):
        raise ConfigError("model", f"{where}: stage {path} ({type(stage).__name__}) is not supported on tiles")
    merge = stage.get_submodule("downsample")
    if not isinstance(merge, nn.Identity) and type(merge) not in timm_classes(SWIN_MERGES):
        raise ConfigError("model", f"{where}: {path}.downsample ({type(merge).__name__}) is not supported on tiles; "
                          f"supported: timm's PatchMerging")
    for block_name, block in stage.get_submodule("blocks").named_children():
        if type(block) not in timm_classes(SWIN_BLOCKS):
            raise ConfigError("model", f"{where}: block {path}.blocks.{block_name} ({type(block).__name__}) is not "
                              f"supported on tiles")


def _bound(module: nn.Module, mixin: type[nn.Module], runtime: SpatialRuntime, name: str) -> nn.Module:
    new = shallow_copy(module, spatial_class(mixin, type(module)))
    object.__setattr__(new, "tile_runtime", runtime)
    runtime.module_names.setdefault(id(new), name)
    return new


def convert_stage(stage: nn.Module, name: str, runtime: SpatialRuntime) -> nn.Module:
    """A stage sharing ``stage``'s state: its merge a ``TileMerge``, its blocks ``WindowBlock``s."""
    new = shallow_copy(stage, type(stage))
    merge = stage.get_submodule("downsample")
    if not isinstance(merge, nn.Identity):
        merged = _bound(merge, TileMerge, runtime, f"{name}.downsample")
        object.__setattr__(merged, "grid_in", int_pair(stage.input_resolution))
        object.__setattr__(merged, "norm_last", type(merge) in timm_classes(SWIN_MERGE_V2))
        new._modules["downsample"] = merged
    blocks = stage.get_submodule("blocks")
    new_blocks = shallow_copy(blocks, type(blocks))
    for block_name, block in blocks.named_children():
        new_blocks._modules[block_name] = _bound(block, WindowBlock, runtime, f"{name}.blocks.{block_name}")
    new._modules["blocks"] = new_blocks
    return new


def patch_embed_on_tiles(embed: nn.Module, prefix: str, convert: Convert) -> nn.Module:
    """A copy of a Swin's ``patch_embed`` whose patch projection is converted (a spatial conv)."""
    copied = shallow_copy(embed, type(embed))
    copied._modules["proj"] = convert(embed.get_submodule("proj"), f"{prefix}patch_embed.proj")
    return copied


def swin_on_tiles(module: nn.Module, name: str, runtime: SpatialRuntime, convert: Convert,
                  mixin: type[nn.Module]) -> nn.Module:
    """``module`` (a timm Swin, or a cut one's trunk: ``patch_embed``, ``layers``, ``norm``, ``head`` at the model's
    names, other children image steps in front) bound to ``mixin``: its patch projection a spatial conv, its stages'
    merges and blocks their tile versions, every parameter but the head's a tile share."""
    new = _bound(module, mixin, runtime, name)
    prefix = f"{name}." if name else ""
    for child_name, child in module.named_children():
        if child_name == "patch_embed":
            new._modules[child_name] = patch_embed_on_tiles(child, prefix, convert)
        elif child_name == "layers":
            stages = new._modules[child_name] = shallow_copy(child, type(child))
            for stage_name, stage in child.named_children():
                stages._modules[stage_name] = convert_stage(stage, f"{prefix}layers.{stage_name}", runtime)
        elif child_name not in ("norm", "head"):     # a cut trunk's image steps in front (a normalisation)
            new._modules[child_name] = convert(child, f"{prefix}{child_name}")
    head = set(map(id, module.get_submodule("head").parameters()))
    for parameter in module.parameters():
        if id(parameter) not in head:
            runtime.claim_tile_share(parameter)
    return new


ALONE = ("Swin's shifted windows and patch merges are exact on tiles inside timm's SwinTransformer/SwinTransformerV2 "
         "on an image's grid only; spatialize the whole model, or put this layer after the spatial stage")


def convert_swin_model(module: nn.Module, name: str, runtime: SpatialRuntime, convert: Convert) -> nn.Module:
    """A timm Swin(V2) model converted for image tiles (refused on a volume's grid)."""
    if runtime.grid.volumetric:
        refused(ALONE)(module, name, runtime, convert)
    _check_model(module, name)
    new = swin_on_tiles(module, name, runtime, convert, SwinTileModel)
    object.__setattr__(new, "serial_class", type(module))
    return new


SWIN_V2_CR = Family("Swin (timm SwinTransformerV2Cr: refused)", TimmMatch((
    "timm.models.swin_transformer_v2_cr.SwinTransformerV2Cr",)), refused(
    "timm's Swin-V2 'cr' models (swinv2_cr_*) have their own stages and blocks, which have no tile version; use a "
    "swinv2_* model (SwinTransformerV2), or train this one without spatial parallelism"), "tests/mpi/swin_exact.py",
    swin_cost)
SWIN = Family("Swin (timm SwinTransformer, SwinTransformerV2)", TimmMatch(SWIN_MODELS), convert_swin_model,
              "tests/mpi/swin_exact.py", swin_cost)
SWIN_BLOCK_ALONE = Family("Swin (timm Swin blocks outside their model: refused)", TimmMatch(SWIN_BLOCKS),
                          refused(ALONE), "tests/mpi/swin_exact.py", swin_block_cost)
SWIN_MERGE_ALONE = Family("Swin (timm Swin patch merges outside their model: refused)", TimmMatch(SWIN_MERGES),
                          refused(ALONE), "tests/mpi/swin_exact.py", swin_merge_cost)
