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
* hands the ops of a family that computes them on tiles itself to that family's handlers (an ``OpFamilyHandlers``,
  data each family module exports: ``interpolate.py`` for ``F.interpolate``, ``reductions.py`` for means
  and maxima over the image, ...): the guard imports no family; it is given the table of them
  (``families.OP_FAMILIES``, through ``SpatialRuntime``);
* tracks where a tile keeps the image's rows and columns (``tile_layout.TileLayout``, marked on
  the tensor): ops on a tile whose rows and columns are not its last two dims (channels-last,
  flattened) go to the layout handler (``relayout.py``) and are refused when it does not take them;
* hands out the sizes of a tile's rows and columns as ``TileDim`` ints (``x.shape``, ``x.size()``),
  so a family can resolve them to the image's sizes (``F.interpolate(x, size=skip.shape[-2:])``).

Handled layers (SpatialConv, ...) run with the mode suspended, as do modules registered
with ``spatialize(..., elementwise=(Cls,))`` and functions wrapped in ``exact_function``.
"""

from __future__ import annotations

import functools
import sys
import traceback
from collections.abc import Callable, Collection, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import FrameType
from typing import ParamSpec, Protocol, TypeGuard, TypeVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..comm.handles import Group
from ..comm.protocol import Comm
from ..errors import ConfigError
from . import ops
from .function_ctx import FunctionContext
from .geometry import TileGrid
from .ops import Args, Kwargs, OpKind, TorchOp
from .reduce import GroupSumCtx
from .tile_layout import STANDARD, Axis, TileDim, TileLayout

T = TypeVar("T")
P = ParamSpec("P")


class GuardedModel(Protocol):
    """What the guard needs of a spatialized model's runtime (``layer.SpatialRuntime`` has it)."""

    ctx: Comm
    group: Group | None
    ranks: list[int]
    module_names: dict[int, str]
    grid: TileGrid

    def note_use(self, layer: nn.Module, tiled: bool) -> None: ...
    def claim_tile_share(self, parameter: nn.Parameter) -> bool: ...
    def takes_tile_share(self, parameter: nn.Parameter) -> bool: ...
    def serially(self, layer: nn.Module) -> AbstractContextManager[None]: ...


class Declined(Enum):
    """What a handler returns for an op it leaves to the others (and then to the guard's own rules)."""

    DECLINED = "declined"


DECLINED = Declined.DECLINED


class OpHandler(Protocol):
    """An op family's own computation on tiles: called for each op of its kind that touches a tile
    (or, listed as ``untiled`` in its OpFamilyHandlers, for every op of its kind); returns the op's result, or
    ``DECLINED`` to leave the op to the next handler and the guard's rules."""

    def __call__(self, guard: SpatialGuard, func: TorchOp, args: tuple[object, ...],
                 kwargs: dict[str, object]) -> object: ...


@dataclass(frozen=True)
class OpFamilyHandlers:
    """One op family's handlers, as data (each op-family module exports one; ``families.OP_FAMILIES`` lists them):
    ``tiled``: kind -> its handler of ops of that kind on an image's tiles; ``untiled``: of ops of that kind that
    touch no tile (random draws, whose random state must agree on every tile; a resampling to a size read from a
    tile); ``volume``: on a volume's tiles (a TileGrid with depth); ``layout``: of the ops on tiles whose rows and
    columns are not their last two dims that no kind handler took (what it declines is refused); ``ops``: this
    family's own functions and their OpKind (``mil_pool.softmax_pool``), where ``ops.kind_of`` knows none."""

    tiled: Mapping[OpKind, OpHandler] = field(default_factory=dict)
    untiled: Mapping[OpKind, OpHandler] = field(default_factory=dict)
    volume: Mapping[OpKind, OpHandler] = field(default_factory=dict)
    layout: OpHandler | None = None
    ops: Mapping[TorchOp, OpKind] = field(default_factory=dict)


@dataclass(frozen=True)
class OpHandlers:
    """The handlers a guard asks, composed from op families: per kind, in the families' order."""

    tiled: dict[OpKind, list[OpHandler]]
    untiled: dict[OpKind, list[OpHandler]]
    volume: dict[OpKind, list[OpHandler]]
    layout: list[OpHandler]
    ops: dict[TorchOp, OpKind]

    @staticmethod
    def of(families: Iterable[OpFamilyHandlers]) -> OpHandlers:
        """The handlers of ``families``, each kind's asked in the families' order."""
        handlers = OpHandlers({}, {}, {}, [], {})
        for family in families:
            for table, own in ((handlers.tiled, family.tiled), (handlers.untiled, family.untiled),
                               (handlers.volume, family.volume)):
                for kind, handler in own.items():
                    if handler not in table.setdefault(kind, []):
                        table[kind].append(handler)
            if family.layout is not None and family.layout not in handlers.layout:
                handlers.layout.append(family.layout)
            handlers.ops.update(family.ops)
        return handlers


ADDED: list[OpFamilyHandlers] = []   # run-time additions (register_handler, register_layout_handler), after the table's


def register_handler(kind: OpKind, handler: OpHandler, *, untiled: bool = False, volume: bool = False) -> None:
    """Run-time addition: let ``handler`` compute ops of ``kind`` on tiles in models spatialized from now on, asked
    after the package's own op families (``families.OP_FAMILIES``; the package's families are data there, not
    registered). ``untiled``: also ask it about ops of ``kind`` that touch no tile; ``volume``: ask it about ops of
    ``kind`` on a volume's tiles (a TileGrid with depth) instead of an image's."""
    table = {kind: handler}
    ADDED.append(OpFamilyHandlers(untiled=table) if untiled else
                 OpFamilyHandlers(volume=table) if volume else OpFamilyHandlers(tiled=table))


def register_layout_handler(handler: OpHandler) -> None:
    """Run-time addition: let ``handler`` take the ops on tiles whose rows and columns are not their last two dims
    that no kind handler took, in models spatialized from now on; what it declines is refused."""
    ADDED.append(OpFamilyHandlers(layout=handler))


def _handled(handlers: list[OpHandler], guard: SpatialGuard, func: TorchOp, args: tuple[object, ...],
             kwargs: dict[str, object]) -> object:
    for handler in handlers:
        out = handler(guard, func, args, kwargs)
        if out is not DECLINED:
            return out
    return DECLINED


MARK = "_mpi4dl_tile"
TILE_FAILURE = "mpi4dl_nb: raised in"   # the start of the note a model's own error on a tile gets
_ACTIVE: list[SpatialGuard] = []

VOLUME_OFFSETS = (-3, -2, -1)   # the tiled dims of a volume's tile (depth, rows, cols)
TEMPLATE_ONLY = {"to", "type_as", "new_empty", "new_full", "new_ones", "new_tensor", "new_zeros"}


def is_tiled(t: object) -> TypeGuard[torch.Tensor]:
    """Whether ``t`` holds this rank's tile of an image-sized tensor (set during a spatial forward)."""
    return isinstance(t, torch.Tensor) and isinstance(t.__dict__.get(MARK), TileLayout)


def layout_of(t: torch.Tensor) -> TileLayout:
    """Where the tile ``t`` keeps the image's rows and columns (``STANDARD`` when unmarked)."""
    layout = t.__dict__.get(MARK)
    return layout if isinstance(layout, TileLayout) else STANDARD


def mark_tiled(obj: T, layout: TileLayout = STANDARD) -> T:
    """Mark every tensor in ``obj`` (a tensor or nested tuples/lists) as a tile laid out as ``layout``;
    returns ``obj``."""
    if isinstance(obj, torch.Tensor):
        obj.__dict__[MARK] = layout
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            mark_tiled(item, layout)
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


def first_layout(obj: object) -> TileLayout:
    """The layout of the first tile in ``obj`` (nested tuples/lists/dicts), ``STANDARD`` if none."""
    if isinstance(obj, torch.Tensor):
        return layout_of(obj)
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    for item in items:
        if any_tiled(item):
            return first_layout(item)
    return STANDARD


def tile_sizes(tile: torch.Tensor, sizes: torch.Size) -> torch.Size:
    """``sizes`` (the tile's shape) with its row and column counts as ``TileDim``."""
    layout = layout_of(tile)
    if layout.flat or not layout.fits(len(sizes)):
        return sizes
    out = list(sizes)
    for offset, axis in ((layout.rows, Axis.ROWS), (layout.cols, Axis.COLS)):
        out[offset] = TileDim(sizes[offset], axis)
    return torch.Size(out)


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


class _ShareOfTiles(torch.autograd.Function):
    """Identity whose backward divides the gradient by the tile count: a parameter whose gradient is
    summed over the tiles at the end, used on a replicated tensor (every tile computes the same full
    gradient there; the sum then counts it once)."""

    @staticmethod
    def forward(fctx: _SharesCtx, x: torch.Tensor, tiles: int) -> torch.Tensor:
        fctx.tiles = tiles
        return x.view_as(x)

    @staticmethod
    def backward(fctx: _SharesCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad / fctx.tiles, None


class _SharesCtx(FunctionContext, Protocol):
    tiles: int


def _dims_refusal(name: str, args: Args, kwargs: Kwargs, tensors: list[torch.Tensor],
                  offsets: tuple[int, ...]) -> str | None:
    """Why a dimension-wise op on a tile is not exact (None when it is): it works along a tiled dim (the
    last ``len(offsets)``) or joins a tile with a replicated tensor."""
    if ops.is_binary_extremum(name, args, kwargs):
        return ops.check_pointwise(tensors, is_tiled, offsets)
    if name in ("cat", "concat", "concatenate", "stack"):
        joined = args[0] if args else kwargs.get("tensors", ())
        if isinstance(joined, (list, tuple)) and any(
                isinstance(t, torch.Tensor) and not is_tiled(t) for t in joined):
            return (f"{name} joins a tile with a replicated tensor; make it a tile first "
                    f"(e.g. t.expand_as(tile) for a per-channel value)")
    tile = ops.first_tiled(args, is_tiled)
    return None if tile is None else ops.check_dims(name, args, kwargs, tile, len(offsets))


class SpatialGuard(TorchFunctionMode):
    """Placement tracking (always) and op checks (``check_ops``) for one spatialized model."""

    def __init__(self, runtime: GuardedModel, check_ops: bool = True,
                 op_families: Iterable[OpFamilyHandlers] = ()) -> None:
        super().__init__()
        self.runtime = runtime
        self.check_ops = check_ops
        self.handlers = OpHandlers.of((*op_families, *ADDED))   # the op families computing their ops on tiles
        self.depth = 0
        self._suspended: list[tuple[AbstractContextManager[None], TileLayout | None]] = []
        self.combined = 0     # replicated operands whose gradient was summed over tiles (last forward)
        self.ops_seen = 0     # torch operations the mode saw (last forward)
        self.enabled = True   # False only to measure the guard's cost (SE gates are then wrong)
        self.forward_notes: set[str] = set()   # what handlers did once this forward (e.g. a state check)
        self._error_before = id(None)   # id of the error a caller was handling when the forward began

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
            self.forward_notes.clear()
            self._error_before = id(sys.exc_info()[1])   # a caller's handled error, not this forward's (an id:
            # holding the error would keep its frames alive)
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
            error = sys.exc_info()[1]
            if isinstance(error, Exception) and id(error) != self._error_before:
                self._note_tile_failure(error)

    def _note_tile_failure(self, error: Exception) -> None:
        """A model's own error on a tile (an assertion on its input's size, a position embedding of the
        image's size, ...; raised where the guard saw no op to refuse): add a note naming the module and
        the way out. Errors of this package's own code (communication, spatial layers) are left as they are."""
        notes = getattr(error, "__notes__", [])
        if isinstance(error, ConfigError) or len(self.runtime.ranks) == 1 or any(
                note.startswith(TILE_FAILURE) for note in notes):
            return
        frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
        if any(_own_code(frame) for frame in frames):   # raised by (or through) this package's code
            return
        where = _innermost_module(frames, self.runtime.module_names)
        if where is not None:
            error.add_note(f"{TILE_FAILURE} {where} on this rank's tile of the image (spatial "
                           f"parallelism). If the model runs on the whole image, this module needs it whole "
                           f"(a position embedding or attention bias of the image's size, a check of the "
                           f"input's height and width) and cannot run on tiles. Ways out: cut the model "
                           f"before it (it then runs after the spatial stage: --balance) or train this "
                           f"model without spatial parallelism")

    def __deepcopy__(self, memo: dict[int, object]) -> SpatialGuard:
        return self

    # ----------------------------------------------------------- handled layers
    def call_handled(self, layer: nn.Module, call: Callable[..., T], args: tuple[object, ...],
                     kwargs: dict[str, object], tiled_output: bool = True) -> T:
        """Run a handled spatial layer: on tiles with the mode suspended, else serially."""
        if any_tiled(args):
            self.runtime.note_use(layer, tiled=True)
            layout = first_layout(args)
            if not layout.standard:
                raise self.layer_error(layer, f"gets a tile with its {layout.describe()}; it needs "
                                       f"the image's rows and columns as the last two dims (permute "
                                       f"them back first)")
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
        self._suspended.append((disable, first_layout(args) if tiled else None))

    def resume(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        """Forward hook (always called) of a module registered as exact."""
        if not self._suspended:
            return
        disable, layout = self._suspended.pop()
        disable.__exit__(None, None, None)
        if layout is not None:
            mark_tiled(output, layout)

    # ------------------------------------------------------- for op handlers
    def shared(self, t: T) -> T:
        """``t`` as an operand of an op on tiles: a replicated tensor that requires grad passes an
        identity whose backward sums its gradient over the tile group (see the module docstring); a
        parameter used so (a Linear's weight on channels-last tiles) keeps its tile share instead, summed
        once at the end with the spatial layers' shares (``SpatialRuntime.claim_tile_share``)."""
        if (isinstance(t, torch.Tensor) and t.requires_grad and not is_tiled(t)
                and torch.is_grad_enabled() and len(self.runtime.ranks) > 1):
            if isinstance(t, nn.Parameter) and self.runtime.claim_tile_share(t):
                return t
            self.combined += 1
            summed: T = _SumGradOverTiles.apply(t, self.runtime.ctx, self.runtime.group)
            return summed
        return t

    def _replicated_uses(self, args: tuple[object, ...], kwargs: dict[str, object], tensors: list[torch.Tensor]
                         ) -> tuple[tuple[object, ...], dict[str, object]]:
        """An op on replicated values: a parameter that takes tile shares passes ``_ShareOfTiles``."""
        if not torch.is_grad_enabled() or len(self.runtime.ranks) == 1:
            return args, kwargs

        def share(a: object) -> object:
            if isinstance(a, nn.Parameter) and a.requires_grad and self.runtime.takes_tile_share(a):
                return _ShareOfTiles.apply(a, len(self.runtime.ranks))
            if isinstance(a, (list, tuple)) and not hasattr(a, "_fields") and any(
                    isinstance(b, nn.Parameter) for b in a):
                return type(a)(share(b) for b in a)
            return a

        if not any(isinstance(t, nn.Parameter) for t in tensors):
            return args, kwargs
        return tuple(share(a) for a in args), {k: share(v) for k, v in kwargs.items()}

    def once_per_forward(self, note: str) -> bool:
        """True the first time ``note`` is asked about in this forward (for checks made once)."""
        if note in self.forward_notes:
            return False
        self.forward_notes.add(note)
        return True

    # --------------------------------------------------------------- every op
    def __torch_function__(self, func: TorchOp, types: Collection[type], args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        self.ops_seen += 1
        tensors = ops.tensors_in(args, kwargs)
        tiles = [t for t in tensors if is_tiled(t)]
        kind = ops.kind_of(func)
        if kind is None:
            kind = self.handlers.ops.get(func)
        if not tiles:
            handlers = self.handlers.untiled.get(kind) if kind is not None else None
            if handlers:
                out = _handled(handlers, self, func, args, kwargs)
                if out is not DECLINED:
                    return out
            args, kwargs = self._replicated_uses(args, kwargs, tensors)
            return func(*args, **kwargs)
        if self.runtime.grid.volumetric:
            return self._volume_op(func, kind, args, kwargs, tensors, tiles[0])
        if kind is OpKind.METADATA:
            return self._metadata(func, args, kwargs)
        handlers = self.handlers.tiled.get(kind) if kind is not None else None
        if handlers:
            out = _handled(handlers, self, func, args, kwargs)
            if out is not DECLINED:
                return out
        layout = layout_of(tiles[0])
        if not all(layout_of(t).standard for t in tiles):
            return self._relaid(func, args, kwargs, layout)
        if kind is OpKind.ITERATE:   # iter(tile): its only argument is the tile
            return iter(mark_tiled(tuple(tiles[0].unbind(0))))
        if self.check_ops:
            reason = self._refusal(kind, func, args, kwargs, tensors)
            if reason is not None:
                raise self.error(func, reason)
        name = ops.op_name(func)
        if name in TEMPLATE_ONLY:   # x.to(other), x.new_zeros(...): other/x only give dtype, device
            out = func(*args, **kwargs)
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and is_tiled(first) and all(
                    tuple(t.shape[-2:]) == tuple(first.shape[-2:]) for t in _tensor_outputs(out)):
                _mark_tensors(out)
            return out
        args, kwargs = self.shared_operands(func, args, kwargs)
        out = self._shaped(func, args, kwargs) if kind is OpKind.SHAPE else func(*args, **kwargs)
        if self.check_ops and kind is OpKind.SHAPE and is_tiled(args[0]):
            reason = ops.check_shape(args[0], _tensor_outputs(out))
            if reason is not None:
                raise self.error(func, reason)
        return _mark_tensors(out)

    def _shaped(self, func: TorchOp, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        """A view/reshape: one that a tile cannot take (a shape fixed for the whole image, e.g. an attention's
        ``reshape(B, heads, -1, N)`` with the image's N) is refused naming module and op, not a bare RuntimeError."""
        try:
            return func(*args, **kwargs)
        except RuntimeError as error:
            tile = args[0] if args else None
            if not (self.check_ops and isinstance(tile, torch.Tensor) and is_tiled(tile)):
                raise
            raise self.error(func, f"cannot reshape a tile of spatial size {tuple(tile.shape[-2:])} as the model "
                                   f"asks ({error}): a shape fixed for the whole image") from error

    def _volume_op(self, func: TorchOp, kind: OpKind | None, args: tuple[object, ...], kwargs: dict[str, object],
                   tensors: list[torch.Tensor], tile: torch.Tensor) -> object:
        """An op on a volume's tile: sizes, iteration over the batch, per-voxel maths, views keeping the voxel
        dims last (activation recomputation's ``view_as``) and the op families' handlers for volumes (dropout);
        anything else is refused (the other families' rules, reductions, functional pools and interpolation, are
        for images so far)."""
        if kind is OpKind.METADATA:
            return func(*args, **kwargs)
        if kind is OpKind.ITERATE:
            return iter(mark_tiled(tuple(tile.unbind(0))))
        handlers = self.handlers.volume.get(kind) if kind is not None else None
        if handlers:
            handled = _handled(handlers, self, func, args, kwargs)
            if handled is not DECLINED:
                return handled
        name, first = ops.op_name(func), args[0] if args else None
        if self.check_ops:
            if in_place(name) and isinstance(first, torch.Tensor) and not is_tiled(first):
                reason: str | None = "writes tile values into a replicated tensor (one not split like the volume)"
            elif kind is OpKind.POINTWISE:
                operands = [first] if name in TEMPLATE_ONLY and isinstance(first, torch.Tensor) else tensors
                reason = ops.check_pointwise(operands, is_tiled, VOLUME_OFFSETS)
            elif kind is OpKind.DIMS:   # along batch or channels only (a channel concatenation, a softmax)
                reason = _dims_refusal(name, args, kwargs, tensors, VOLUME_OFFSETS)
            elif kind is OpKind.CHANNEL:   # per channel (prelu, eval-mode batch_norm)
                reason = ops.check_channel(func, args, kwargs)
            elif kind is OpKind.SHAPE:   # view/reshape: checked on its outputs (the voxel dims stay last)
                reason = None
            else:
                reason = ("is not known to be exact on a volume's tiles (a TileGrid with depth): only per-voxel "
                          "maths and the layers spatialize converts are, so far")
            if reason is not None:
                raise self.error(func, reason)
        args, kwargs = self.shared_operands(func, args, kwargs)
        out = func(*args, **kwargs)
        if self.check_ops and kind is OpKind.SHAPE and isinstance(first, torch.Tensor) and is_tiled(first):
            reason = ops.check_shape(first, _tensor_outputs(out), axes=3)
            if reason is not None:
                raise self.error(func, reason)
        for t in _tensor_outputs(out):
            if t.shape[-3:] == tile.shape[-3:]:
                mark_tiled(t)
        return out

    def _metadata(self, func: TorchOp, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        """Sizes and flags; a tile's own ``shape``/``size()`` give its row and column counts as TileDim."""
        out = func(*args, **kwargs)
        first = args[0] if args else None
        if not (isinstance(first, torch.Tensor) and is_tiled(first)) or ops.op_name(func) not in ("shape", "size"):
            return out
        if isinstance(out, torch.Size):
            return tile_sizes(first, out)
        dim = ops.argument(args, kwargs, 1, "dim")
        if isinstance(out, int) and isinstance(dim, int):
            return tile_sizes(first, first.shape)[dim]
        return out

    def _relaid(self, func: TorchOp, args: tuple[object, ...], kwargs: dict[str, object],
                layout: TileLayout) -> object:
        """An op on a tile whose rows and columns are not its last two dims: the layout handler's, or refused."""
        out = _handled(self.handlers.layout, self, func, args, kwargs)
        if out is not DECLINED:
            return out
        if self.check_ops:
            raise self.error(func, f"works on a tile with its {layout.describe()} (after a permute or "
                             f"flatten); only per-pixel work is known to be exact there (point-wise "
                             f"maths, LayerNorm/Linear over channels, permuting back)")
        return mark_tiled(func(*args, **kwargs), layout)

    def _refusal(self, kind: OpKind | None, func: TorchOp, args: Args, kwargs: Kwargs,
                 tensors: list[torch.Tensor]) -> str | None:
        name = ops.op_name(func)
        first = args[0] if args else None
        if in_place(name) and isinstance(first, torch.Tensor) and not is_tiled(first):
            return "writes tile values into a replicated tensor (one not split like the image)"
        if kind is None:
            return ("is not known to act on each pixel (or along batch/channels) of a tile; if it "
                    "does, register it: mpi4dl_nb.spatial.ops.register_op(fn)")
        if kind is OpKind.POINTWISE:
            operands = [first] if name in TEMPLATE_ONLY and isinstance(first, torch.Tensor) else tensors
            return ops.check_pointwise(operands, is_tiled)
        if kind is OpKind.DIMS:
            return _dims_refusal(name, args, kwargs, tensors, (-2, -1))
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
        if kind is OpKind.RANDOM:
            return ("draws random numbers for one tile (each tile would draw its own, unlike the serial "
                    "model); use dropout (made exact on tiles) or move it after the spatial stage")
        if kind is OpKind.WINDOW:
            return ("sees only this rank's tile, without the halo it needs; use the module form "
                    "(nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d(1), nn.ConvTranspose2d), "
                    "which spatialize makes exact")
        return ops.refusal_hint(func)

    def shared_operands(self, func: TorchOp, args: tuple[object, ...], kwargs: dict[str, object]
                                  ) -> tuple[tuple[object, ...], dict[str, object]]:
        """Replicated operands that require grad go through ``shared``."""
        if not torch.is_grad_enabled() or len(self.runtime.ranks) == 1:
            return args, kwargs

        def swap(a: object) -> object:
            if isinstance(a, torch.Tensor):
                return self.shared(a)
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

    def layer_error(self, layer: nn.Module, reason: str) -> ConfigError:
        name = self.runtime.module_names.get(id(layer), "")
        shown = getattr(layer, "serial_class", type(layer)).__name__   # Conv2d, not SpatialConv2d
        return ConfigError("model", f"layer {name or '<root>'!r} ({shown}) {reason}")

    def module_path(self) -> str:
        """``layer '3.conv' (Block)``: the innermost module of this model whose forward is running."""
        frames: list[FrameType] = []
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            frames.insert(0, frame)
            frame = frame.f_back
        return _innermost_module(frames, self.runtime.module_names) or "the spatialized model"


def _innermost_module(frames: list[FrameType], names: dict[int, str]) -> str | None:
    """``layer '3.conv' (Block)``: the module of the innermost frame (outermost first in ``frames``) that is
    the forward of a module in ``names``."""
    for frame in reversed(frames):
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            return f"layer {names[id(owner)] or '<root>'!r} ({type(owner).__name__})"
    return None


PACKAGE = Path(__file__).resolve().parents[1]


def _own_code(frame: FrameType) -> bool:
    """Whether ``frame`` is this package's code, other than the guard passing a model's op on to torch."""
    path = Path(frame.f_code.co_filename).resolve()
    return path.is_relative_to(PACKAGE) and not (path == Path(__file__).resolve()
                                                 and frame.f_code.co_name == "__torch_function__")


def in_place(name: str) -> bool:
    """Whether the op ``name`` writes into its first argument (``add_``, ``__iadd__``, ``__setitem__``)."""
    return (name.endswith("_") and not name.startswith("__")) or name.startswith("__i") \
        or name == "__setitem__"


def _tensor_outputs(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, torch.Tensor)]
    return []


def _mark_tensors(out: T, layout: TileLayout = STANDARD) -> T:
    for t in _tensor_outputs(out):
        t.__dict__[MARK] = layout
    return out


def exact_function(fn: Callable[P, T]) -> Callable[P, T]:
    """Decorator: ``fn`` is exact on tiles as it is; during a spatial forward it runs unchecked
    and its outputs are tiles when an input is."""
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        if not _ACTIVE:
            return fn(*args, **kwargs)
        tiled = any_tiled(args) or any_tiled(kwargs)
        layout = first_layout(args) if any_tiled(args) else first_layout(kwargs)
        with torch._C.DisableTorchFunction():
            out = fn(*args, **kwargs)
        return mark_tiled(out, layout) if tiled else out
    return wrapper
