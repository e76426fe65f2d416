"""timm's Swin(V2) cut into its trunk (patch embedding, stages, norm, average pool) and its classifier.

The trunk is one piece (``SwinTrunk``) because its shifted windows and patch merges are exact on tiles only as a
whole (``spatial/windows/swin_trunk.py``): on a spatial stage it hands the pooled vector, the same on every tile,
to the classifier's layer stage. Both pieces hold the model's modules at their names, so the engine's keys are the
model's (``pieces.original_state_dict``). A Swin whose head is not timm's average-pooled ``ClassifierHead`` is left
to the chain cut (and refused on tiles, naming it).
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..spatial.family import from_timm, timm_classes
from ..spatial.windows.swin import SWIN_MODELS
from ..spatial.windows.swin_trunk import SWIN_TRUNK
from .pieces import Piece, SizedPiece

EMBEDDING = "patch_embed"
TRUNK = (EMBEDDING, "layers", "norm", "head.global_pool")      # the model's paths the trunk runs, in order
CLASSIFIER = ("head.drop", "head.fc", "head.flatten")


class SwinTrunk(SizedPiece):
    """A Swin's patch embedding, stages, final norm and average pool (on tiles: ``SwinTrunkTiles``); it refuses
    images of another size than the model was built for (ValueError naming both)."""

    tile_family = SWIN_TRUNK

    def __init__(self, steps: Sequence[tuple[str, nn.Module]], built: tuple[int, int], source: type[nn.Module]) -> None:
        super().__init__(steps, built, source.__name__)
        self.source = source

    def image_steps(self) -> list[nn.Module]:
        return [self.get_submodule(path) for path in self.paths[:self.paths.index(EMBEDDING)]]

    def with_steps(self, steps: Sequence[tuple[str, nn.Module]]) -> Piece:
        return SwinTrunk(steps, self.built, self.source)


def is_swin_model(model: nn.Module) -> bool:
    """Whether ``model`` is a timm Swin(V2) as timm builds it, with its head's average pool (what the trunk cut
    takes)."""
    if not (from_timm(model) and type(model) in timm_classes(SWIN_MODELS)):
        return False
    head = getattr(model, "head", None)
    pool = getattr(getattr(head, "global_pool", None), "pool_type", None)
    return pool == "avg" and all(isinstance(getattr(head, name.split(".")[1], None), nn.Module) for name in CLASSIFIER)


def swin_pieces(model: nn.Module, built: tuple[int, int]) -> list[nn.Module]:
    """``model`` (``is_swin_model``, built for ``built`` images) as its trunk and its classifier."""
    trunk = SwinTrunk([(path, model.get_submodule(path)) for path in TRUNK], built, type(model))
    return [trunk, Piece([(path, model.get_submodule(path)) for path in CLASSIFIER])]
