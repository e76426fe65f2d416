"""A cut Swin's trunk on tiles: the patch embedding, stages and final norm of timm's Swin(V2), pooled to one vector.

A timm ``SwinTransformer``/``SwinTransformerV2`` cut into layers (``models/swin.py``) has two pieces: its trunk (a
``SwinTrunkPiece``: any steps put in front such as a normalisation, then the model's ``patch_embed``, ``layers``,
``norm`` and its head's average pool, at the model's names) and its classifier. On a spatial stage the trunk becomes
a ``SwinTrunkTiles``: its image steps on the tile, then the whole Swin's tile forward (``swin.pooled_on_tiles``:
shifted windows and patch merges gathered across tiles) up to the average over every token of the image, the same
vector on every tile, which the hand-off passes on once (``pipeline/handoff.join_tiles``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..layer import Convert, SpatialRuntime, shallow_copy
from .swin import _bound, _child, _convert_stage, check_swin_parts, pooled_on_tiles


class SwinTrunkPiece:
    """Base of a cut Swin's trunk piece (``models/swin.SwinTrunk``): it holds the model's ``patch_embed``, ``layers``,
    ``norm`` and ``head.global_pool`` at the model's names and runs the model class ``source``'s features and pool.
    On a spatial stage it becomes a ``SwinTrunkTiles``."""

    source: type[nn.Module]

    def image_steps(self) -> list[nn.Module]:
        """The steps before the patch embedding (a normalisation), run on the image as they are."""
        raise NotImplementedError


class SwinTrunkTiles(nn.Module):
    """Mixin: a cut Swin's trunk on this rank's image tile; its output, the pooled vector, on every tile."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert isinstance(self, SwinTrunkPiece)
        for step in self.image_steps():
            x = step(x)
        return pooled_on_tiles(self, x, self.source.__name__)


def convert_swin_trunk(module: nn.Module, name: str, runtime: SpatialRuntime, convert: Convert) -> nn.Module | None:
    """``module`` converted for tiles when it is a cut Swin's trunk (its Swin parts checked first, a ConfigError
    naming what the tiles cannot compute exactly); else None."""
    if not isinstance(module, SwinTrunkPiece):
        return None
    where = f"layer {name or '<root>'!r} (the trunk of a cut {module.source.__name__})"
    check_swin_parts(module, where)
    new = _bound(module, SwinTrunkTiles, runtime, name)
    prefix = f"{name}." if name else ""
    for child_name, child in module.named_children():
        if child_name == "patch_embed":
            embed = shallow_copy(child, type(child))
            embed._modules["proj"] = convert(_child(child, "proj"), f"{prefix}patch_embed.proj")
            new._modules[child_name] = embed
        elif child_name == "layers":
            stages = shallow_copy(child, type(child))
            for stage_name, stage in child.named_children():
                stages._modules[stage_name] = _convert_stage(stage, f"{prefix}layers.{stage_name}", runtime)
            new._modules[child_name] = stages
        elif child_name not in ("norm", "head"):     # the image steps in front (a normalisation)
            new._modules[child_name] = convert(child, f"{prefix}{child_name}")
    for parameter in module.parameters():
        runtime.claim_tile_share(parameter)
    return new
