"""Piece: one layer of a cut model, running some of the model's modules (kept at their original paths) in order.

A model cut into pieces keeps every module where the model had it: piece ``i`` holds module
``layer1.0`` as its own ``layer1.0`` (through ``Branch`` containers), so the key of a tensor in
``nn.Sequential(*pieces)`` is ``"<i>.<the key in the model>"``. Dropping the first component maps an
engine checkpoint back to the model's keys, and the model's own keys find their piece by the same
rule: ``original_state_dict`` and ``engine_state_dict`` below. Operations the model's ``forward``
applies outside its modules (``torch.flatten``, ``F.relu``, ``x.mean((2, 3))``) become ``Functional``
steps, named ``"flatten()"`` and so on (parentheses: never a path of the model, never in a state dict).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..spatial.tile_marks import is_tiled

# torch functions with a ``training`` flag that a trace would freeze: run as the matching module instead
DROPOUTS: dict[Callable[..., torch.Tensor], type[nn.Module]] = {
    F.dropout: nn.Dropout, F.dropout2d: nn.Dropout2d, F.dropout1d: nn.Dropout1d, F.alpha_dropout: nn.AlphaDropout}


class ChainInput:
    """Where the running tensor goes among a functional step's arguments."""

    def __repr__(self) -> str:
        return "<input>"

    def __deepcopy__(self, memo: dict[int, object]) -> ChainInput:
        return self


CHAIN_INPUT = ChainInput()
Argument = object     # a traced call's argument: a constant, CHAIN_INPUT, or a tuple/list/dict of them


def _filled(value: Argument, x: torch.Tensor) -> Argument:
    if value is CHAIN_INPUT:
        return x
    if isinstance(value, (tuple, list)):
        return type(value)(_filled(v, x) for v in value)
    if isinstance(value, dict):
        return {k: _filled(v, x) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class Call:
    """One operation of a model's ``forward`` outside its modules: a torch function or a tensor method."""

    target: Callable[..., torch.Tensor] | str     # a function, or the name of a tensor method
    args: tuple[Argument, ...]
    kwargs: Mapping[str, Argument]

    @property
    def name(self) -> str:
        """``flatten``, ``relu``, ``mean`` ..."""
        return self.target if isinstance(self.target, str) else getattr(self.target, "__name__", "call")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        args = _filled(self.args, x)
        kwargs = _filled(dict(self.kwargs), x)
        assert isinstance(args, tuple) and isinstance(kwargs, dict)
        if isinstance(self.target, str):
            tensor, *rest = args
            assert isinstance(tensor, torch.Tensor), "a tensor method's first argument is the running tensor"
            return getattr(tensor, self.target)(*rest, **kwargs)
        return self.target(*args, **kwargs)


class Functional(nn.Module):
    """A ``Call`` as a module: no parameters, no state; the op guard checks it like any custom forward."""

    def __init__(self, call: Call) -> None:
        super().__init__()
        self.call = call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(x)

    def extra_repr(self) -> str:
        shown = [repr(a) for a in self.call.args] + [f"{k}={v!r}" for k, v in self.call.kwargs.items()]
        return f"{self.call.name}({', '.join(shown)})"


def as_module(call: Call) -> nn.Module:
    """The module that runs ``call``: ``F.dropout(x, p, training=...)`` becomes ``nn.Dropout(p)`` (it follows
    ``train()``/``eval()`` as the model's own call did), anything else a ``Functional``."""
    kind = DROPOUTS.get(call.target) if not isinstance(call.target, str) else None
    if kind is not None and call.args and call.args[0] is CHAIN_INPUT:
        p = call.kwargs.get("p", call.args[1] if len(call.args) > 1 else 0.5)
        inplace = bool(call.kwargs.get("inplace", call.args[3] if len(call.args) > 3 else False))
        if isinstance(p, (int, float)):
            return kind(float(p), inplace=inplace)
    return Functional(call)


class Branch(nn.Module):
    """A container standing for a module of the original model on a piece's path (it has no forward)."""


class Piece(nn.Module):
    """One layer of a cut model: its ``steps`` (paths in the model, or ``name()`` for a functional step) in order."""

    def __init__(self, steps: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        if not steps:
            raise ValueError("a piece runs at least one step")
        self.paths = tuple(path for path, _ in steps)
        for path, module in steps:
            place(self, path, module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for path in self.paths:      # looked up by path: spatialize's copy holds converted modules there
            x = self.get_submodule(path)(x)
        return x

    def with_steps(self, steps: Sequence[tuple[str, nn.Module]]) -> Piece:
        """A piece like this one running ``steps`` (``normalized`` puts a step in front of the first piece's)."""
        return Piece(steps)

    def steps(self) -> list[tuple[str, nn.Module]]:
        """(path, module) of every step, in order."""
        return [(path, self.get_submodule(path)) for path in self.paths]

    def extra_repr(self) -> str:
        return f"steps: {', '.join(self.paths)}"


def place(root: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` at the dotted ``path`` below ``root``, creating ``Branch`` containers on the way."""
    *parents, name = path.split(".")
    node = root
    for part in parents:
        child = node._modules.get(part)
        if child is None:
            child = Branch()
            node.add_module(part, child)
        node = child
    if name in node._modules:
        raise ValueError(f"two steps of a piece at the same path {path!r}")
    node.add_module(name, module)


def is_cut(layers: Sequence[nn.Module]) -> bool:
    """Whether ``layers`` came from ``layer_list`` (keys map back to a model) rather than a plain layer list."""
    return bool(layers) and all(isinstance(layer, Piece) for layer in layers)


def original_key(key: str) -> str:
    """``"5.layer1.0.conv1.weight"`` -> ``"layer1.0.conv1.weight"`` (a cut model's engine key -> the model's)."""
    index, _, rest = key.partition(".")
    if not index.isdigit() or not rest:
        raise ValueError(f"{key!r} is not a key of a layer list ('<layer>.<name>')")
    return rest


def original_state_dict(layers: Sequence[nn.Module], state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's state dict from an engine state dict of ``layers`` (keys of ``nn.Sequential(*layers)``).

    A cut model's keys lose their layer index; a plain layer list's model is ``nn.Sequential(*layers)``,
    whose keys these already are.
    """
    if not is_cut(layers):
        return dict(state)
    return {original_key(key): value for key, value in state.items()}


def engine_keys(layers: Sequence[nn.Module]) -> dict[str, str]:
    """The model's key -> the engine's key (``nn.Sequential(*layers)``), for every tensor of ``layers``."""
    keys = nn.Sequential(*layers).state_dict(keep_vars=True).keys()
    if not is_cut(layers):
        return {key: key for key in keys}
    return {original_key(key): key for key in keys}


def engine_state_dict(layers: Sequence[nn.Module], state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An original model's state dict with the keys of ``nn.Sequential(*layers)`` (keys the layers lack are kept
    as they are, for the caller's strict load to name)."""
    keys = engine_keys(layers)
    return {keys.get(key, key): value for key, value in state.items()}


def recut_state_dict(layers: Sequence[nn.Module], state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An engine state dict of ``layers``' model written under another cut of it (a Swin's checkpoint of its trunk and
    classifier, before it was cut at its stages), with ``layers``' keys: every key maps to the model's and back
    (``state`` as it is when ``layers`` are not a cut model or it holds a key of no layer list)."""
    if not is_cut(layers) or not all(key.partition(".")[0].isdigit() for key in state):
        return dict(state)
    return engine_state_dict(layers, original_state_dict(layers, state))


class SizedPiece(Piece):
    """The first piece of a model built for one image size (timm's Swin, MaxViT): it refuses another size with a
    ValueError naming both (as a cut ViT's embedding does), before the model's own assertion; a tile of a spatial
    stage passes."""

    def __init__(self, steps: Sequence[tuple[str, nn.Module]], built: tuple[int, int], model: str) -> None:
        super().__init__(steps)
        self.built, self.model = built, model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_tiled(x) and tuple(x.shape[-2:]) != self.built:   # a tile: the spatial stage checks its grid
            raise ValueError(f"{self.model} was built for {self.built[0]}x{self.built[1]} images (--image-size), "
                             f"given {x.shape[-2]}x{x.shape[-1]}")
        return super().forward(x)

    def with_steps(self, steps: Sequence[tuple[str, nn.Module]]) -> Piece:
        return SizedPiece(steps, self.built, self.model)
