"""A Swin cut at its stages, on tiles: its embedding, stage and head pieces, each a tile version of timm's own parts.

A timm ``SwinTransformer``/``SwinTransformerV2`` cut into layers (``models/swin.py``) has an embedding piece (steps
put in front such as a normalisation, then ``patch_embed``), one piece per stage (``layers.<i>``) and a head piece
(``norm``, ``head.global_pool`` and the classifier); each names its record below as its ``tile_family``. On a spatial
stage the embedding becomes a ``SwinEmbeddingTiles`` (the projection a spatial conv: this tile's box of the token
grid, a channels-first map as between the pieces), a stage a ``SwinStageTiles`` (its patch merge and shifted windows
gathered across tiles, as the whole model's: ``swin.convert_stage``) and the head a ``SwinHeadTiles`` (the final
norm on the tile, the mean over every token of the image by one all-reduce, the classifier on that vector: the
logits on every tile). A stage that ends on the embedding or a stage hands its boxes to the next layer stage as
feature-map tiles (``pipeline/handoff.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..cost import ExchangeBytes
from ..family import Family, names_family
from ..geometry import TileGrid
from ..layer import Convert, SpatialRuntime, shallow_copy, spatial_class
from ..tile_marks import mark_tiled
from ..tokens.tiles import int_pair
from .swin import (
    check_forward,
    check_swin_embedding,
    check_swin_pool,
    check_swin_stage,
    convert_stage,
    mean_on_tiles,
    patch_embed_on_tiles,
    tokens_on_tiles,
)
from .traffic import swin_block_cost, swin_merge_cost

CLASSIFIER = ("head.drop", "head.fc", "head.flatten")


def _runtime(module: nn.Module) -> SpatialRuntime:
    runtime = module.__dict__["tile_runtime"]
    assert isinstance(runtime, SpatialRuntime)
    return runtime


class SwinEmbeddingTiles(nn.Module):
    """Mixin: a cut Swin's embedding piece on this rank's image tile; its output, the tile's token box."""

    source: type[nn.Module]                   # the piece's (models/swin.SwinEmbedding): the model class it cuts
    image_steps: Callable[[], list[nn.Module]]   # the steps before the patch embedding (a normalisation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for step in self.image_steps():
            x = step(x)
        tokens, _ = tokens_on_tiles(self, x, self.source.__name__)
        return mark_tiled(tokens.permute(0, 3, 1, 2))


class SwinStageTiles(nn.Module):
    """Mixin: a cut Swin's stage piece on this rank's token box (its merge and windows across the tiles)."""

    paths: tuple[str, ...]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_forward(self, _runtime(self), x.device)
        with torch._C.DisableTorchFunction():
            out = self.get_submodule(self.paths[0])(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return mark_tiled(out)


class SwinHeadTiles(nn.Module):
    """Mixin: a cut Swin's head piece on this rank's token box: the logits of the whole image on every tile."""

    final_grid: tuple[int, int]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        runtime = _runtime(self)
        check_forward(self, runtime, x.device)
        with torch._C.DisableTorchFunction():
            tokens = self.get_submodule("norm")(x.permute(0, 2, 3, 1))
            pooled = mean_on_tiles(tokens, runtime, self.final_grid[0] * self.final_grid[1])
            for step in CLASSIFIER:
                pooled = self.get_submodule(step)(pooled)
        return pooled


def _bound(module: nn.Module, mixin: type[nn.Module], name: str, runtime: SpatialRuntime) -> nn.Module:
    new = shallow_copy(module, spatial_class(mixin, type(module)))
    object.__setattr__(new, "tile_runtime", runtime)
    runtime.module_names.setdefault(id(new), name)
    return new


def _where(module: nn.Module, name: str, part: str) -> str:
    return f"layer {name or '<root>'!r} (the {part} of a cut Swin)"


def convert_swin_embedding(module: nn.Module, name: str, runtime: SpatialRuntime, convert: Convert) -> nn.Module:
    """A cut Swin's embedding piece on tiles: its image steps and patch projection converted (a spatial conv), its
    parameters tile shares."""
    embed = module.get_submodule("patch_embed")
    check_swin_embedding(embed, _where(module, name, "patch embedding"))
    new = _bound(module, SwinEmbeddingTiles, name, runtime)
    prefix = f"{name}." if name else ""
    for child_name, child in module.named_children():
        if child_name == "patch_embed":
            new._modules[child_name] = patch_embed_on_tiles(child, prefix, convert)
        else:       # image steps in front (a normalisation)
            new._modules[child_name] = convert(child, f"{prefix}{child_name}")
    for parameter in embed.parameters():
        runtime.claim_tile_share(parameter)
    return new


def convert_swin_stage(module: nn.Module, name: str, runtime: SpatialRuntime, convert: Convert) -> nn.Module:
    """A cut Swin's stage piece on tiles: its merge and blocks their tile versions, its parameters tile shares."""
    path = vars(module)["paths"][0]
    stage = module.get_submodule(path)
    check_swin_stage(stage, path, _where(module, name, f"stage {path}"))
    new = _bound(module, SwinStageTiles, name, runtime)
    branch_name, stage_name = path.split(".")
    held = module.get_submodule(branch_name)
    branch = new._modules[branch_name] = shallow_copy(held, type(held))
    branch._modules[stage_name] = convert_stage(stage, f"{name}.{path}" if name else path, runtime)
    for parameter in stage.parameters():
        runtime.claim_tile_share(parameter)
    return new


def convert_swin_head(module: nn.Module, name: str, runtime: SpatialRuntime, convert: Convert) -> nn.Module:
    """A cut Swin's head piece on tiles: the final norm a tile share, the classifier replicated."""
    check_swin_pool(module.get_submodule("head.global_pool"), _where(module, name, "head"))
    new = _bound(module, SwinHeadTiles, name, runtime)
    for parameter in module.get_submodule("norm").parameters():
        runtime.claim_tile_share(parameter)
    return new


def swin_stage_cost(module: nn.Module, grid: TileGrid, sizes: Sequence[int], element_bytes: int) -> ExchangeBytes:
    """``FamilyCost`` of a cut Swin's stage piece: its merge and blocks on the grid the stage takes (its
    ``input_resolution``; ``sizes`` is not needed), summed (held: the largest)."""
    stage = module.get_submodule(vars(module)["paths"][0])
    current = int_pair(stage.input_resolution)
    merge = stage.get_submodule("downsample")
    parts = [] if isinstance(merge, nn.Identity) else [swin_merge_cost(merge, grid, current, element_bytes)]
    current = int_pair(getattr(stage, "output_resolution", current))
    blocks = stage.get_submodule("blocks").children()
    parts += [swin_block_cost(block, grid, current, element_bytes) for block in blocks]
    return ExchangeBytes(sum(p.sent for p in parts), sum(p.received for p in parts),
                         max((p.held for p in parts), default=0))


SWIN_CUT_EMBEDDING: Family = Family(
    "Swin (a cut Swin's embedding piece: models/swin.py's SwinEmbedding)",
    lambda module: names_family(module, SWIN_CUT_EMBEDDING), convert_swin_embedding, "tests/mpi/swin_cut_exact.py")
SWIN_CUT_STAGE: Family = Family(
    "Swin (a cut Swin's stage piece: models/swin.py's SwinStagePiece)",
    lambda module: names_family(module, SWIN_CUT_STAGE), convert_swin_stage, "tests/mpi/swin_cut_exact.py",
    swin_stage_cost)
SWIN_CUT_HEAD: Family = Family(
    "Swin (a cut Swin's head piece: models/swin.py's SwinHead)",
    lambda module: names_family(module, SWIN_CUT_HEAD), convert_swin_head, "tests/mpi/swin_cut_exact.py")
