"""The op guard: placement tracking and per-op checks during a spatial forward.

While a spatialized model runs, a ``torch.overrides.TorchFunctionMode`` sees every torch
operation outside the handled spatial layers and

* tracks placements: the model's input tiles and everything computed from a tile are
  *tiles* (partitioned, marked on the tensor); parameters, buffers, constants and the output
  of a global pool are *replicated* (the same on every tile, unmarked);
* where an operation combines a tile with a replicated tensor that requires grad (an SE gate
  ``x * gate``, a per-channel ``x * scale``), passes that operand through an identity whose
  backward sums the gradient over the tile group: each tile's gradient for it is only its
  share, so after the sum every tile holds the full gradient, as for the classifier head
  after a global pool (whose backward rule, "replicated consumer", stays right for both);
* with ``check_ops`` (the default) refuses, with a ConfigError naming the module, the op and
  the way out, every operation on a tile that is not exact on tiles (see ``ops.py``);
* hands the ops of a family that computes them on tiles itself to the handler that family
  registered (``register_handler``; ``interpolate.py`` for ``F.interpolate``): the guard
  imports no family.

Handled layers (SpatialConv2d, ...) run with the mode suspended, as do modules registered
with ``spatialize(..., elementwise=(Cls,))`` and functions wrapped in ``exact_function``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from types import FrameType
from typing import ParamSpec, Protocol, TypeGuard, TypeVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..comm.handles import Group
from ..comm.protocol import Comm
from ..errors import ConfigError
from . import ops
from .ops import Args, Kwargs, OpKind, TorchOp
from .reduce import GroupSumCtx

T = TypeVar("T")
P = ParamSpec("P")


class GuardedModel(Protocol):
    """What the guard needs of a spatialized model's runtime (``layer.SpatialRuntime`` has it)."""

    ctx: Comm
    group: Group | None
    ranks: list[int]
    module_names: dict[int, str]

    def note_use(self, layer: nn.Module, tiled: bool) -> None: ...
    def serially(self, layer: nn.Module) -> AbstractContextManager[None]: ...


class OpHandler(Protocol):
    """An op family's own computation on tiles: called for each op of its kind that touches a tile."""

    def __call__(self, guard: SpatialGuard, func: TorchOp, args: tuple[object, ...],
                 kwargs: dict[str, object]) -> object: ...


HANDLERS: dict[OpKind, OpHandler] = {}


def register_handler(kind: OpKind, handler: OpHandler) -> None:
    """Let ``handler`` compute every op of ``kind`` on tiles (one handler per kind; the family's module
    registers it when imported, e.g. ``interpolate.py`` for ``OpKind.RESAMPLE``)."""
    HANDLERS[kind] = handler


MARK = "_mpi4dl_tile"
_ACTIVE: list[SpatialGuard] = []

_TEMPLATE_ONLY = {"to", "type_as", "new_empty", "new_full", "new_ones", "new_tensor", "new_zeros"}


def is_tiled(t: object) -> TypeGuard[torch.Tensor]:
    """Whether ``t`` holds this rank's tile of an image-sized tensor (set during a spatial forward)."""
    return isinstance(t, torch.Tensor) and t.__dict__.get(MARK, False)


def mark_tiled(obj: T) -> T:
    """Mark every tensor in ``obj`` (a tensor or nested tuples/lists) as a tile; returns ``obj``."""
    if isinstance(obj, torch.Tensor):
        obj.__dict__[MARK] = True
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            mark_tiled(item)
    return obj


def any_tiled(obj: object) -> bool:
    """Whether ``obj`` (a tensor, or nested tuples/lists/dicts of them) holds a tile."""
    if isinstance(obj, torch.Tensor):
        return is_tiled(obj)
    if isinstance(obj, (tuple, list)):
        return any(any_tiled(item) for item in obj)
    if isinstance(obj, dict):
        return any(any_tiled(item) for item in obj.values())
    return False


class _SumGradOverTiles(torch.autograd.Function):
    """Identity whose backward sums the gradient over the tile group (a replicated operand of a tile op)."""

    @staticmethod
    def forward(fctx: GroupSumCtx, x: torch.Tensor, comm: Comm, group: Group | None) -> torch.Tensor:
        fctx.comm, fctx.group = comm, group
        return x.view_as(x)

    @staticmethod
    def backward(fctx: GroupSumCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = grad.detach().clone(memory_format=torch.contiguous_format)
        return fctx.comm.all_reduce(out, group=fctx.group), None, None


class SpatialGuard(TorchFunctionMode):
    """Placement tracking (always) and op checks (``check_ops``) for one spatialized model."""

    def __init__(self, runtime: GuardedModel, check_ops: bool = True) -> None:
        super().__init__()
        self.runtime = runtime
        self.check_ops = check_ops
        self.depth = 0
        self._suspended: list[tuple[AbstractContextManager[None], bool]] = []
        self.combined = 0     # replicated operands whose gradient was summed over tiles (last forward)
        self.ops_seen = 0     # torch operations the mode saw (last forward)
        self.enabled = True   # False only to measure the guard's cost (SE gates are then wrong)

    # ------------------------------------------------------------- enter / leave
    @property
    def active(self) -> bool:
        return self.depth > 0

    def begin(self, args: tuple[object, ...]) -> None:
        """Root forward pre-hook: the inputs are tiles; enter the mode (outermost call only)."""
        mark_tiled(args)
        if not self.enabled:
            return
        if self.depth == 0:
            self.combined = self.ops_seen = 0
            self.__enter__()
            _ACTIVE.append(self)
        self.depth += 1

    def end(self) -> None:
        """Root forward hook (also after an exception): leave the mode."""
        if self.depth == 0:
            return
        self.depth -= 1
        if self.depth == 0:
            _ACTIVE.remove(self)
            self.__exit__(None, None, None)

    def __deepcopy__(self, memo: dict[int, object]) -> SpatialGuard:
        return self

    # ----------------------------------------------------------- handled layers
    def call_handled(self, layer: nn.Module, call: Callable[..., T], args: tuple[object, ...],
                     kwargs: dict[str, object], tiled_output: bool = True) -> T:
        """Run a handled spatial layer: on tiles with the mode suspended, else serially."""
        if any_tiled(args):
            self.runtime.note_use(layer, tiled=True)
            with torch._C.DisableTorchFunction():
                out = call(*args, **kwargs)
            return mark_tiled(out) if tiled_output else out
        self.runtime.note_use(layer, tiled=False)
        with self.runtime.serially(layer):
            return call(*args, **kwargs)

    def suspend(self, module: nn.Module, args: tuple[object, ...]) -> None:
        """Forward pre-hook of a module registered as exact: run it unchecked."""
        if not self.active:
            return
        tiled = any_tiled(args)
        self.runtime.note_use(module, tiled=tiled)
        disable = torch._C.DisableTorchFunction()
        disable.__enter__()
        self._suspended.append((disable, tiled))

    def resume(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        """Forward hook (always called) of a module registered as exact."""
        if not self._suspended:
            return
        disable, tiled = self._suspended.pop()
        disable.__exit__(None, None, None)
        if tiled:
            mark_tiled(output)

    # --------------------------------------------------------------- every op
    def __torch_function__(self, func: TorchOp, types: Collection[type], args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        self.ops_seen += 1
        tensors = ops.tensors_in(args, kwargs)
        tiles = [t for t in tensors if is_tiled(t)]
        if not tiles:
            return func(*args, **kwargs)
        kind = ops.kind_of(func)
        if kind is OpKind.METADATA:
            return _mark_tensors(func(*args, **kwargs))
        handler = HANDLERS.get(kind) if kind is not None else None
        if handler is not None:
            return handler(self, func, args, kwargs)
        if kind is OpKind.ITERATE:   # iter(tile): its only argument is the tile
            return iter(mark_tiled(tuple(tiles[0].unbind(0))))
        if self.check_ops:
            reason = self._refusal(kind, func, args, kwargs, tensors)
            if reason is not None:
                raise self.error(func, reason)
        name = ops.op_name(func)
        if name in _TEMPLATE_ONLY:   # x.to(other), x.new_zeros(...): other/x only give dtype, device
            out = func(*args, **kwargs)
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and is_tiled(first) and all(
                    tuple(t.shape[-2:]) == tuple(first.shape[-2:]) for t in _tensor_outputs(out)):
                _mark_tensors(out)
            return out
        args, kwargs = self._sum_replicated_gradients(func, args, kwargs)
        out = func(*args, **kwargs)
        if self.check_ops and kind is OpKind.SHAPE and is_tiled(args[0]):
            reason = ops.check_shape(args[0], _tensor_outputs(out))
            if reason is not None:
                raise self.error(func, reason)
        return _mark_tensors(out)

    def _refusal(self, kind: OpKind | None, func: TorchOp, args: Args, kwargs: Kwargs,
                 tensors: list[torch.Tensor]) -> str | None:
        name = ops.op_name(func)
        first = args[0] if args else None
        if _in_place(name) and isinstance(first, torch.Tensor) and not is_tiled(first):
            return "writes tile values into a replicated tensor (one not split like the image)"
        if kind is None:
            return ("is not known to act on each pixel (or along batch/channels) of a tile; if it "
                    "does, register it: mpi4dl_nb.spatial.ops.register_op(fn)")
        if kind is OpKind.POINTWISE:
            operands = [first] if name in _TEMPLATE_ONLY and isinstance(first, torch.Tensor) else tensors
            return ops.check_pointwise(operands, is_tiled)
        if kind is OpKind.DIMS:
            if ops.is_binary_extremum(name, args, kwargs):
                return ops.check_pointwise(tensors, is_tiled)
            if name in ("cat", "concat", "concatenate", "stack"):
                joined = args[0] if args else kwargs.get("tensors", ())
                if isinstance(joined, (list, tuple)) and any(
                        isinstance(t, torch.Tensor) and not is_tiled(t) for t in joined):
                    return (f"{name} joins a tile with a replicated tensor; make it a tile first "
                            f"(e.g. t.expand_as(tile) for a per-channel value)")
            tile = ops.first_tiled(args, is_tiled)
            return None if tile is None else ops.check_dims(name, args, kwargs, tile)
        if kind is OpKind.SHAPE:
            if isinstance(first, torch.Tensor) and not is_tiled(first):
                return ops.check_pointwise([first, *(t for t in tensors if is_tiled(t))], is_tiled)
            return None
        if kind is OpKind.INDEX:
            if isinstance(first, torch.Tensor) and is_tiled(first):
                reason = ops.check_index(first, args[1] if len(args) > 1 else ())
                if reason is None and name == "__setitem__" and len(args) > 2 \
                        and isinstance(args[2], torch.Tensor):
                    return ops.check_pointwise([args[2], first], is_tiled)
                return reason
            return None   # a replicated table indexed by tile values: per pixel
        if kind is OpKind.CHANNEL:
            return ops.check_channel(func, args, kwargs)
        if kind is OpKind.CONV:
            return ops.check_conv(args, kwargs)
        if kind is OpKind.DROPOUT:
            return ops.check_dropout(func, args, kwargs)
        if kind is OpKind.WINDOW:
            return ("sees only this rank's tile, without the halo it needs; use the module form "
                    "(nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d(1), nn.ConvTranspose2d), "
                    "which spatialize makes exact")
        return ops.refusal_hint(func)

    def _sum_replicated_gradients(self, func: TorchOp, args: tuple[object, ...], kwargs: dict[str, object]
                                  ) -> tuple[tuple[object, ...], dict[str, object]]:
        """Replicated operands that require grad go through ``_SumGradOverTiles``."""
        if not torch.is_grad_enabled() or len(self.runtime.ranks) == 1:
            return args, kwargs

        def swap(a: object) -> object:
            if isinstance(a, torch.Tensor) and a.requires_grad and not is_tiled(a):
                self.combined += 1
                return _SumGradOverTiles.apply(a, self.runtime.ctx, self.runtime.group)
            if isinstance(a, (list, tuple)) and any(isinstance(b, torch.Tensor) for b in a):
                return type(a)(swap(b) for b in a) if not hasattr(a, "_fields") else a
            return a

        return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}

    # ---------------------------------------------------------------- errors
    def error(self, func: TorchOp, reason: str) -> ConfigError:
        where = self.module_path()
        return ConfigError("model", f"{where}: {ops.display_name(func)} {reason}. Spatial "
                           f"parallelism splits the image into tiles, so this would silently differ "
                           f"from the serial model. Ways out: use a module spatialize supports, move "
                           f"this computation after the spatial stage, or, if it is exact on tiles, "
                           f"register it (spatialize(..., elementwise=(YourModule,)) or "
                           f"mpi4dl_nb.spatial.ops.register_op)")

    def module_path(self) -> str:
        """``layer '3.conv' (Block)``: the innermost module of this model whose forward is running."""
        names = self.runtime.module_names
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in names:
                return f"layer {names[id(owner)] or '<root>'!r} ({type(owner).__name__})"
            frame = frame.f_back
        return "the spatialized model"


def _in_place(name: str) -> bool:
    return (name.endswith("_") and not name.startswith("__")) or name.startswith("__i") \
        or name == "__setitem__"


def _tensor_outputs(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, torch.Tensor)]
    return []


def _mark_tensors(out: T) -> T:
    for t in _tensor_outputs(out):
        t.__dict__[MARK] = True
    return out


def exact_function(fn: Callable[P, T]) -> Callable[P, T]:
    """Decorator: ``fn`` is exact on tiles as it is; during a spatial forward it runs unchecked
    and its outputs are tiles when an input is."""
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        if not _ACTIVE:
            return fn(*args, **kwargs)
        tiled = any_tiled(args) or any_tiled(kwargs)
        with torch._C.DisableTorchFunction():
            out = fn(*args, **kwargs)
        return mark_tiled(out) if tiled else out
    return wrapper
