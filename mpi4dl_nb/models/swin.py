"""timm's Swin(V2) cut at its stages: the patch embedding, each stage, and the head (final norm, pool, classifier).

These are the pieces a pipeline places (``pipeline/default_cut.py`` balances them): ``SwinEmbedding`` (steps put in
front such as a normalisation, then ``patch_embed``), one ``SwinStagePiece`` per ``layers.<i>`` (its patch merge, then
its blocks) and ``SwinHead`` (``norm``, ``head.global_pool``, ``head.drop``, ``head.fc``, ``head.flatten``). Between
pieces the token grid is a channels-first map ``(B, C, rows, cols)`` (timm's is channels last: each piece permutes
in and out, views), so a stage cut, the planner and the hand-off see it as any feature map. Each piece names the
record that runs it on tiles (``spatial/windows/swin_trunk.py``): on a spatial stage the embedding and stages hand
this tile's box of the token grid on, which the hand-off to a layer stage joins as feature-map tiles.
Every module stays at its path in the model, so the engine's keys are the model's (``pieces.original_state_dict``; a
checkpoint of another cut of the model loads through ``pieces.recut_state_dict``). A Swin whose head is not timm's
average-pooled ``ClassifierHead`` is left to the chain cut (and refused on tiles, naming it).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..spatial.family import from_timm, timm_classes
from ..spatial.windows.swin import SWIN_MODELS
from ..spatial.windows.swin_trunk import SWIN_CUT_EMBEDDING, SWIN_CUT_HEAD, SWIN_CUT_STAGE
from .pieces import Piece, SizedPiece

EMBEDDING = "patch_embed"
STAGES = "layers"
HEAD = ("norm", "head.global_pool", "head.drop", "head.fc", "head.flatten")   # the model's paths the head runs
CLASSIFIER = HEAD[2:]                                                          # after the pool


def _grid(value: object) -> tuple[int, int]:
    """timm's ``(rows, cols)`` of a token grid as ints."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"a Swin's token grid is (rows, cols), got {value!r}")
    return int(value[0]), int(value[1])


class SwinEmbedding(SizedPiece):
    """A Swin's patch embedding (on tiles: ``SwinEmbeddingTiles``): the image's tokens ``(B, C, rows, cols)``; it
    refuses images of another size than the model was built for (ValueError naming both)."""

    tile_family = SWIN_CUT_EMBEDDING

    def __init__(self, steps: Sequence[tuple[str, nn.Module]], built: tuple[int, int], source: type[nn.Module]) -> None:
        super().__init__(steps, built, source.__name__)
        self.source = source

    def image_steps(self) -> list[nn.Module]:
        """The steps before the patch embedding (a normalisation put in front), run on the image."""
        return [self.get_submodule(path) for path in self.paths[:self.paths.index(EMBEDDING)]]

    def token_grid(self) -> tuple[int, int]:
        """The token grid the embedding makes (the model's patch grid)."""
        return _grid(self.get_submodule(EMBEDDING).grid_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).permute(0, 3, 1, 2)

    def with_steps(self, steps: Sequence[tuple[str, nn.Module]]) -> Piece:
        return SwinEmbedding(steps, self.built, self.source)


class SwinStagePiece(Piece):
    """One stage of a Swin, ``layers.<i>`` (its patch merge, then its blocks; on tiles: ``SwinStageTiles``)."""

    tile_family = SWIN_CUT_STAGE

    def __init__(self, path: str, stage: nn.Module) -> None:
        super().__init__([(path, stage)])

    def stage(self) -> nn.Module:
        return self.get_submodule(self.paths[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.stage()(x.permute(0, 2, 3, 1))
        return out.permute(0, 3, 1, 2)

    def with_steps(self, steps: Sequence[tuple[str, nn.Module]]) -> Piece:
        if len(steps) != 1:
            raise ValueError("a Swin stage piece runs its stage alone")
        return SwinStagePiece(*steps[0])


class SwinHead(Piece):
    """A Swin's final norm, average pool and classifier (on tiles: ``SwinHeadTiles``, the mean over every token of
    the image, the logits on every tile); ``final_grid``: the token grid it pools."""

    tile_family = SWIN_CUT_HEAD

    def __init__(self, steps: Sequence[tuple[str, nn.Module]], final_grid: tuple[int, int]) -> None:
        super().__init__(steps)
        self.final_grid = final_grid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1))

    def with_steps(self, steps: Sequence[tuple[str, nn.Module]]) -> Piece:
        raise ValueError("a Swin's head piece takes no other steps")


def is_swin_model(model: nn.Module) -> bool:
    """Whether ``model`` is a timm Swin(V2) as timm builds it, with its head's average pool (what the stage cut
    takes)."""
    if not (from_timm(model) and type(model) in timm_classes(SWIN_MODELS)):
        return False
    head = getattr(model, "head", None)
    pool = getattr(getattr(head, "global_pool", None), "pool_type", None)
    return pool == "avg" and all(isinstance(getattr(head, name.split(".")[1], None), nn.Module) for name in CLASSIFIER)


def swin_pieces(model: nn.Module, built: tuple[int, int]) -> list[nn.Module]:
    """``model`` (``is_swin_model``, built for ``built`` images) as its embedding, each stage, and its head."""
    embedding = SwinEmbedding([(EMBEDDING, model.get_submodule(EMBEDDING))], built, type(model))
    stages = [SwinStagePiece(f"{STAGES}.{name}", stage) for name, stage in model.get_submodule(STAGES).named_children()]
    final = _grid(stages[-1].stage().output_resolution) if stages else embedding.token_grid()
    return [embedding, *stages, SwinHead([(path, model.get_submodule(path)) for path in HEAD], final)]
