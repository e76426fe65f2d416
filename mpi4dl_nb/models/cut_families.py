"""The model families ``layer_list`` cuts, one entry each: what it matches, how its pieces are made, its check side.

``CUT_FAMILIES`` is read in order and the first entry matching the model is followed: a timm ViT/Eva (its tokens:
``vit.token_pieces``, checked at the image size it was built for unless it takes any), timm's Swin (its embedding,
each stage and its head: ``swin.swin_pieces``, checked at its size), a chain built for one image size (timm's MaxViT,
a Swin with another head: ``chain.chain_pieces``, checked at that size: their patch embedding or window partition
asserts it), and the fallback, any chain of its modules (checked at ``layer_list``'s ``check_size``).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import nn

from .chain import Side, chain_pieces
from .pieces import Piece, SizedPiece
from .swin import is_swin_model, swin_pieces
from .vit import is_token_model, token_image_size, token_pieces

CHECK_SIZE = 64          # side of the random images a model that takes any size is checked on


@dataclass(frozen=True)
class CutFamily:
    """One family of models the cut takes: ``matches`` the model; ``pieces`` of the model (the check side given:
    the chain cut finds its head there); ``side`` of the check images, from the model and ``layer_list``'s
    ``check_size``."""

    name: str
    matches: Callable[[nn.Module], bool]
    pieces: Callable[[nn.Module, Side], list[nn.Module]]
    side: Callable[[nn.Module, int], Side]


def _pair(value: object) -> tuple[int, int] | None:
    if isinstance(value, int) and value > 0:
        return value, value
    if isinstance(value, (tuple, list)) and len(value) >= 2 and all(isinstance(v, int) for v in value[-2:]):
        return int(value[-2]), int(value[-1])
    return None


def built_image_size(model: nn.Module) -> tuple[int, int] | None:
    """The (rows, cols) a model was built for and only takes, None for one that takes any size: a strict patch
    embedding's ``img_size`` (timm's Swin), the model's ``img_size`` (timm's MaxxVit), or its config's
    ``input_size`` when the config says the size is fixed."""
    embed = getattr(model, "patch_embed", None)
    if getattr(embed, "strict_img_size", False) and not getattr(embed, "dynamic_img_pad", False) \
            and not getattr(model, "dynamic_img_size", False):
        return _pair(getattr(embed, "img_size", None))
    own = _pair(getattr(model, "img_size", None))
    if own is not None:
        return own
    config = getattr(model, "pretrained_cfg", None)
    if isinstance(config, Mapping) and config.get("fixed_input_size"):
        return _pair(config.get("input_size"))
    return None


def _sized_pieces(model: nn.Module, side: Side) -> list[nn.Module]:
    """The chain cut, its first piece refusing images of another size than the model's (ValueError)."""
    first, *rest = chain_pieces(model, side)
    built = built_image_size(model)
    if built is None or not isinstance(first, Piece):
        return [first, *rest]
    return [SizedPiece(first.steps(), built, type(model).__name__), *rest]


def _swin_pieces(model: nn.Module, side: Side) -> list[nn.Module]:
    built = built_image_size(model)
    assert built is not None, "timm's Swin is built for one image size"
    return swin_pieces(model, built)


def _built_side(model: nn.Module, check_size: int) -> Side:
    return built_image_size(model) or check_size


CUT_FAMILIES: tuple[CutFamily, ...] = (
    CutFamily("vision transformer (timm ViT, Eva)", is_token_model, lambda model, side: token_pieces(model),
              # a ViT's side: the size it was built for (``check_size`` when it takes any)
              lambda model, size: size if getattr(model, "dynamic_img_size", False) else token_image_size(model)),
    CutFamily("timm Swin (embedding, stages, head)",
              lambda model: is_swin_model(model) and bool(built_image_size(model)), _swin_pieces, _built_side),
    CutFamily("chain built for one image size (timm Swin, MaxViT)", lambda model: bool(built_image_size(model)),
              _sized_pieces, _built_side),
    CutFamily("chain of its modules", lambda model: True, chain_pieces, lambda model, size: size),
)


def cut_family(model: nn.Module) -> CutFamily:
    """The first entry of ``CUT_FAMILIES`` matching ``model`` (the last matches every model)."""
    return next(family for family in CUT_FAMILIES if family.matches(model))
