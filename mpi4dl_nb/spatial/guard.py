"""The op guard: placement tracking and per-op checks during a spatial forward, one dispatcher for images and volumes.
More: docs/spatial.md#notes-by-module."""

from __future__ import annotations

import functools
import sys
import traceback
from collections.abc import Callable, Collection, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import Enum
from typing import ParamSpec, Protocol, TypeVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..comm.handles import Group
from ..comm.protocol import Comm
from ..errors import ConfigError
from . import ops
from .geometry import TileGrid
from .guard_frames import innermost_module, tile_failure_note
from .guard_functions import ShareOfTiles, SumGradOverTiles
from .guard_rules import IMAGE, TEMPLATE_ONLY, VOLUME, TileRules
from .ops import OpKind, TorchOp
from .tile_layout import TileLayout
from .tile_marks import any_tiled, first_layout, is_tiled, layout_of, mark_outputs, mark_tiled, tensors_out, tile_sizes

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


_ACTIVE: list[SpatialGuard] = []   # the guards whose forward is running (exact_function asks)


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
        """A model's own error on a tile: add a note naming the module and the way out (``guard_frames``)."""
        if len(self.runtime.ranks) > 1:
            note = tile_failure_note(error, self.runtime.module_names, PASSING_ON)
            if note is not None:
                error.add_note(note)

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
            summed: T = SumGradOverTiles.apply(t, self.runtime.ctx, self.runtime.group)
            return summed
        return t

    def _replicated_uses(self, args: tuple[object, ...], kwargs: dict[str, object], tensors: list[torch.Tensor]
                         ) -> tuple[tuple[object, ...], dict[str, object]]:
        """An op on replicated values: a parameter that takes tile shares passes ``ShareOfTiles``."""
        if not any(isinstance(t, nn.Parameter) for t in tensors):
            return args, kwargs
        return self._operands(args, kwargs, self._share_of_tiles)

    def _share_of_tiles(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter) and t.requires_grad and self.runtime.takes_tile_share(t):
            shared: torch.Tensor = ShareOfTiles.apply(t, len(self.runtime.ranks))
            return shared
        return t

    def _operands(self, args: tuple[object, ...], kwargs: dict[str, object],
                  swap: Callable[[torch.Tensor], torch.Tensor]) -> tuple[tuple[object, ...], dict[str, object]]:
        """``args`` and ``kwargs``, each tensor in them (and in their lists and tuples) passed through ``swap``, when
        gradients flow across tiles."""
        if not torch.is_grad_enabled() or len(self.runtime.ranks) == 1:
            return args, kwargs

        def each(a: object) -> object:
            if isinstance(a, torch.Tensor):
                return swap(a)
            if isinstance(a, (list, tuple)) and not hasattr(a, "_fields") and any(
                    isinstance(b, torch.Tensor) for b in a):
                return type(a)(each(b) for b in a)
            return a

        return tuple(each(a) for a in args), {k: each(v) for k, v in kwargs.items()}

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
            out = _handled(self.handlers.untiled.get(kind, []) if kind is not None else [], self, func, args, kwargs)
            if out is not DECLINED:
                return out
            args, kwargs = self._replicated_uses(args, kwargs, tensors)
            return func(*args, **kwargs)
        rules, table = (VOLUME, self.handlers.volume) if self.runtime.grid.volumetric else (IMAGE, self.handlers.tiled)
        out = self._taken(rules, table, kind, func, args, kwargs, tiles)
        if out is not DECLINED:
            return out
        if self.check_ops:
            reason = rules.refusal(kind, func, args, kwargs, tensors)
            if reason is not None:
                raise self.error(func, reason)
        if ops.op_name(func) in TEMPLATE_ONLY:   # x.to(other), x.new_zeros(...): other/x only give dtype, device
            out, first = func(*args, **kwargs), args[0] if args else None
            axes = len(rules.offsets)
            if is_tiled(first) and all(t.shape[-axes:] == first.shape[-axes:] for t in tensors_out(out)):
                mark_outputs(out)
            return out
        args, kwargs = self.shared_operands(func, args, kwargs)
        if kind is OpKind.SHAPE:
            return self._shaped(rules, func, args, kwargs)
        return mark_outputs(func(*args, **kwargs))

    def _taken(self, rules: TileRules, table: Mapping[OpKind, list[OpHandler]], kind: OpKind | None, func: TorchOp,
               args: tuple[object, ...], kwargs: dict[str, object], tiles: list[torch.Tensor]) -> object:
        """An op on tiles that ends before the rules: sizes, an op family's handler (``table``: the grid's), tiles
        whose rows and columns are not their last two dims, iteration over the batch; else ``DECLINED``."""
        if kind is OpKind.METADATA:
            return self._metadata(func, args, kwargs) if rules.tile_dims else func(*args, **kwargs)
        out = _handled(table.get(kind, []) if kind is not None else [], self, func, args, kwargs)
        if out is not DECLINED:
            return out
        if not all(layout_of(t).standard for t in tiles):
            return self._relaid(func, args, kwargs, layout_of(tiles[0]))
        if kind is OpKind.ITERATE:   # iter(tile): its only argument is the tile
            return iter(mark_tiled(tuple(tiles[0].unbind(0))))
        return DECLINED

    def _shaped(self, rules: TileRules, func: TorchOp, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        """A view/reshape: its outputs keep the tile's tiled sizes last; on an image, one that a tile cannot take (a
        shape fixed for the whole image, e.g. an attention's ``reshape(B, heads, -1, N)`` with the image's N) is
        refused naming module and op, not a bare RuntimeError."""
        tile = args[0] if args else None
        try:
            out = func(*args, **kwargs)
        except RuntimeError as error:
            if not (rules.reshape_refused and self.check_ops and is_tiled(tile)):
                raise
            raise self.error(func, f"cannot reshape a tile of spatial size {tuple(tile.shape[-2:])} as the model "
                                   f"asks ({error}): a shape fixed for the whole image") from error
        if self.check_ops and is_tiled(tile):
            reason = ops.check_shape(tile, tensors_out(out), axes=len(rules.offsets))
            if reason is not None:
                raise self.error(func, reason)
        return mark_outputs(out)

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
        """An op on a tile whose rows and columns are not their last two dims: the layout handler's, or refused."""
        out = _handled(self.handlers.layout, self, func, args, kwargs)
        if out is not DECLINED:
            return out
        if self.check_ops:
            raise self.error(func, f"works on a tile with its {layout.describe()} (after a permute or "
                             f"flatten); only per-pixel work is known to be exact there (point-wise "
                             f"maths, LayerNorm/Linear over channels, permuting back)")
        return mark_tiled(func(*args, **kwargs), layout)

    def shared_operands(self, func: TorchOp, args: tuple[object, ...], kwargs: dict[str, object]
                                  ) -> tuple[tuple[object, ...], dict[str, object]]:
        """Replicated operands that require grad go through ``shared``."""
        return self._operands(args, kwargs, self.shared)

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
        frames = (frame for frame, _ in traceback.walk_stack(sys._getframe(1)))   # innermost first
        return innermost_module(frames, self.runtime.module_names) or "the spatialized model"


PASSING_ON = SpatialGuard.__torch_function__.__code__   # the guard passing a model's op on to torch: not own code


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
