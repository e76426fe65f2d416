"""``layer_list``: a model cut into splittable pieces as its family (``cut_families.py``) cuts it, then checked.

The model's family is found once (``cut_families.cut_family``: a timm ViT/Eva's tokens, a chain built for one image
size such as timm's Swin and MaxViT, any other chain of its modules) and followed: its pieces are made, and the
pieces' forward is checked against the model's on random images of the side the family names (eval and train mode,
same random state) before the list is returned; ConfigError names the model and what to do instead.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..config import ConfigError
from .chain import Side, check_images, mode, side_text, state_kept
from .cut_families import CHECK_SIZE, cut_family

TOLERANCE = 1e-6         # relative: the pieces run the very same operations in the same order


def _differs(a: object, b: object) -> str | None:
    """Why two outputs differ (None: they are equal to TOLERANCE)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return f"the model returns a {type(a).__name__}, not one tensor"
    if a.shape != b.shape:
        return f"output shape {tuple(b.shape)} instead of the model's {tuple(a.shape)}"
    scale = float(a.abs().max()) if a.numel() else 0.0
    gap = float((a - b).abs().max()) if a.numel() else 0.0
    if not gap <= TOLERANCE * max(scale, 1.0):
        return f"outputs differ by {gap:.3g} (largest output {scale:.3g})"
    return None


def train_mode_difference(model: nn.Module, pieces: Sequence[nn.Module], x: torch.Tensor) -> str | None:
    """Why the pieces differ from ``model`` in train mode on ``x`` (None: equal), each run from the same
    buffers and random state (dropout and stochastic depth draw the same masks); both are kept as they were."""
    net = nn.Sequential(*pieces)
    with torch.no_grad(), mode(model, True), mode(net, True):
        with state_kept(model):
            start = torch.random.get_rng_state()
            expected = model(x)
        with state_kept(model):
            torch.random.set_rng_state(start)
            got = net(x)
    return _differs(expected, got)


def layer_list(model: nn.Module | Sequence[nn.Module], *, check_size: int = CHECK_SIZE,
               check: bool = True) -> list[nn.Module]:
    """``model`` as the engine's splittable layer list (``Piece`` layers sharing the model's modules).

    ``nn.Sequential(*layer_list(model))`` computes ``model(x)``; its state-dict keys are
    ``"<layer>.<the model's key>"`` (``pieces.original_state_dict`` maps an engine checkpoint back).
    A list of modules is returned as a list (it is a layer list already). ``check_size``: side of the
    random images the cut is checked on (and the head found with) for a model that takes any size (one built for a
    size is checked at it); ``check=False`` skips the check. ConfigError when ``model`` is not a chain of its
    modules.
    """
    if isinstance(model, Sequence) and not isinstance(model, nn.Module):
        return list(model)
    family = cut_family(model)
    side = family.side(model, check_size)
    return checked_pieces(model, family.pieces(model, side), side, check)


def checked_pieces(model: nn.Module, pieces: list[nn.Module], size: Side,
                   check: bool) -> list[nn.Module]:
    """``pieces`` once their chain equals ``model`` on random images in eval mode, and in train mode from the same
    random state (``check=False``: as they are); ConfigError saying how they differ."""
    if not check:
        return pieces
    name = type(model).__name__
    x = check_images(model, size)
    if x.is_meta:                 # built on the meta device (the weights' names and shapes checked): no values to
        return pieces             # compare; the real build checks the cut
    net = nn.Sequential(*pieces)
    try:
        with mode(model, False), mode(net, False), state_kept(model), torch.no_grad():
            reason = _differs(model(x), net(x))
    except (RuntimeError, AssertionError) as err:
        raise ConfigError("model", f"{name} fails on a {side_text(size)} check image ({err}); "
                          f"pass layer_list(model, check_size=...) a size it takes") from None
    if reason is None:
        reason = train_mode_difference(model, pieces, x)
        reason = None if reason is None else f"in train mode, {reason}"
    else:
        reason = f"in eval mode, {reason}"
    if reason is not None:
        raise ConfigError("model", f"{name} cannot be cut into a layer list: its forward is not the chain "
                          f"of its modules it appears to be ({reason}); build the layer list yourself "
                          f"(modules whose nn.Sequential equals your model) and pass that")
    return pieces
