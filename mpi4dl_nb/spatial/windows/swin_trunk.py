"""A cut Swin's trunk on tiles: the patch embedding, stages and final norm of timm's Swin(V2), pooled to one vector.

A timm ``SwinTransformer``/``SwinTransformerV2`` cut into layers (``models/swin.py``) has two pieces: its trunk (its
class naming ``SWIN_TRUNK`` as its ``tile_family``: any steps put in front such as a normalisation, then the model's
``patch_embed``, ``layers``, ``norm`` and its head's average pool, at the model's names) and its classifier. On a
spatial stage the trunk becomes a ``SwinTrunkTiles``: its image steps on the tile, then the whole Swin's tile forward
(``swin.pooled_on_tiles``: shifted windows and patch merges gathered across tiles) up to the average over every token
of the image, the same vector on every tile, which the hand-off passes on once (``pipeline/handoff.join_tiles``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..family import Family, names_family
from ..layer import Convert, SpatialRuntime
from .swin import check_swin_parts, pooled_on_tiles, swin_on_tiles
from .traffic import swin_cost


class SwinTrunkTiles(nn.Module):
    """Mixin: a cut Swin's trunk on this rank's image tile; its output, the pooled vector, on every tile."""

    source: type[nn.Module]                   # the piece's (models/swin.SwinTrunk): the model class it cuts
    image_steps: Callable[[], list[nn.Module]]   # the steps before the patch embedding (a normalisation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for step in self.image_steps():
            x = step(x)
        return pooled_on_tiles(self, x, self.source.__name__)


def convert_swin_trunk(module: nn.Module, name: str, runtime: SpatialRuntime, convert: Convert) -> nn.Module:
    """A cut Swin's trunk converted for tiles (its Swin parts checked first, a ConfigError naming what the tiles
    cannot compute exactly)."""
    source: type[nn.Module] = vars(module)["source"]   # the model class the piece cuts
    check_swin_parts(module, f"layer {name or '<root>'!r} (the trunk of a cut {source.__name__})")
    return swin_on_tiles(module, name, runtime, convert, SwinTrunkTiles)


SWIN_TRUNK: Family = Family("Swin (a cut Swin's trunk: models/swin.py's SwinTrunk, patch embedding .. average pool)",
                    lambda module: names_family(module, SWIN_TRUNK), convert_swin_trunk,
                    "tests/mpi/transformer_families_cli.py", swin_cost)
