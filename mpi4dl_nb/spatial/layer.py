"""Shared machinery of spatial layers: the per-model runtime and adopting a torch layer's state.

A spatial layer is a subclass of the torch layer it replaces, built around the *same*
parameter and buffer objects (so optimizers, state dicts and the serial model stay shared);
only ``forward`` differs. Tiles carry no global size, so the runtime learns each layer's
global input size once per image size (one small all-gather on the tile group at the first
call) and caches it; after that, a forward needs only halo messages and BatchNorm sums.
During a forward of the spatialized model the runtime's guard (guard.py) tracks which
tensors are tiles; a spatial layer given a replicated tensor (a 1x1 conv in an SE gate,
after the global pool) runs as its serial torch layer, and its parameters then hold the
full gradient on every tile instead of a tile's share.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar, cast

import torch
from torch import nn

from ..comm.handles import Group
from ..comm.protocol import Comm
from ..errors import ConfigError
from .geometry import LayerHalo, TileGrid
from .guard import OpFamilyHandlers, SpatialGuard
from .halo import HaloExchange
from .tiles import tile_ranks

ForwardState = tuple[tuple[int, ...] | None, dict[int, int]]   # (image size, per-layer call counts)
Convert = Callable[[nn.Module, str], nn.Module]   # spatialize's converter: a child and its full name -> converted child


class SpatialRuntime:
    """What every spatial layer of one spatialized model shares: grid, ranks, size cache."""

    def __init__(self, grid: TileGrid, ctx: Comm, group: Group | None = None,
                 image_size: tuple[int, int] | None = None, check_ops: bool = True,
                 op_families: Iterable[OpFamilyHandlers] = ()) -> None:
        self.grid = grid
        self.ctx = ctx
        self.group = group
        self.ranks, self.tile = tile_ranks(grid, ctx, group)
        self.image_size: tuple[int, int] | None = None
        if image_size is not None:
            height, width = image_size
            self.image_size = (int(height), int(width))
        self.root_size: tuple[int, ...] | None = None   # (H, W), a volume grid's (D, H, W)
        self._calls: dict[int, int] = {}
        self._sizes: dict[tuple[tuple[int, ...], int, int], tuple[int | None, ...]] = {}
        self.partial_parameters: list[nn.Parameter] = []
        self.module_names: dict[int, str] = {}
        self.guard = SpatialGuard(self, check_ops, op_families)   # op_families: families.OP_FAMILIES
        # BatchNorm statistics: over the tile group, or (sync_batchnorm) a wider group whose
        # members hold ``stats_copies`` equal batches of the same image size
        self.stats_group: Group | None = group
        self.stats_copies = 1
        self._tiled_users: set[int] = set()
        self._serial_users: dict[int, nn.Module] = {}
        self._serial_now: set[int] = set()
        self.plans: dict[Hashable, object] = {}   # per-size plans an op family caches (its own types)
        self._tile_shares: set[int] = set()        # parameters custom forwards use on tiles (shares)
        self._replicated_uses: set[int] = set()    # ... used on replicated values first (full gradients)

    # --------------------------------------------------------- placements
    def note_use(self, module: nn.Module, tiled: bool) -> None:
        """Record that ``module`` ran on tiles or on a replicated tensor (never both)."""
        key = id(module)
        if key in (self._tiled_users if tiled else self._serial_users):
            return
        if key in (self._serial_users if tiled else self._tiled_users):
            name = self.module_names.get(key, type(module).__name__)
            raise ConfigError("model", f"layer {name!r} ({type(module).__name__}) runs both on "
                              f"image tiles and on a replicated (pooled) tensor; its parameter "
                              f"gradients would be a tile's share in one use and the full "
                              f"gradient in the other. Use two separate layers")
        if tiled:
            self._tiled_users.add(key)
        else:
            self._serial_users[key] = module

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters of spatial layers that ran on replicated tensors (full gradient on every tile)."""
        seen: set[int] = set()
        out = []
        for module in self._serial_users.values():
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def claim_tile_share(self, parameter: nn.Parameter) -> bool:
        """Whether ``parameter``, used by a custom forward in an op on tiles, takes this tile's share of
        its gradient (summed over the tiles with the spatial layers': one sum at the end, not one per
        use); False when it was used on replicated values first (then its gradient is full on every
        tile and the guard sums each tile use at once)."""
        key = id(parameter)
        if key in self._replicated_uses:
            return False
        if key not in self._tile_shares:
            self._tile_shares.add(key)
            self.partial_parameters.append(parameter)
        return True

    def takes_tile_share(self, parameter: nn.Parameter) -> bool:
        """Whether ``parameter`` was claimed as a tile share; else note it as used on replicated values."""
        if id(parameter) in self._tile_shares:
            return True
        self._replicated_uses.add(id(parameter))
        return False

    @contextmanager
    def serially(self, layer: nn.Module) -> Iterator[None]:
        """Inside, ``layer`` runs as its serial torch layer (its input is replicated)."""
        self._serial_now.add(id(layer))
        try:
            yield
        finally:
            self._serial_now.discard(id(layer))

    def runs_serially(self, layer: nn.Module) -> bool:
        return id(layer) in self._serial_now

    # --------------------------------------------------------------- root hooks
    def begin_forward(self, module: nn.Module, args: tuple[object, ...]) -> None:
        """Forward pre-hook of the spatialized root: inputs are tiles; learn the global input size."""
        self.guard.begin(args)
        self._calls.clear()
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or x.dim() < self.grid.ndim:
            self.root_size = None
            return
        if self.grid.volumetric:
            self.root_size = self.gather_lengths_all(x)
        elif self.image_size is not None:
            expected = self.grid.tile_of_size(self.tile, *self.image_size)
            if tuple(x.shape[-2:]) != expected:
                raise ValueError(f"spatialized model built for image_size {self.image_size}: "
                                 f"tile {self.tile} expects a {expected} tile, got "
                                 f"{tuple(x.shape[-2:])} (scatter inputs with dl.scatter_tiles)")
            self.root_size = self.image_size
        else:
            self.root_size = self.gather_size(x)

    def end_forward(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        """Forward hook of the root (also called after an exception): leave the guard."""
        self.root_size = None
        self.guard.end()

    # ------------------------------------------------ activation recomputation
    def forward_state(self) -> ForwardState:
        """Where the running forward stands (image size, per-layer call counts), to replay from."""
        return (self.root_size, dict(self._calls))

    @contextmanager
    def replaying(self, state: ForwardState, tiles: tuple[torch.Tensor, ...]) -> Iterator[None]:
        """Run part of a forward again (recomputation during backward) from ``forward_state``:
        same cached sizes and call ordinals, the guard tracking ``tiles`` as tiles."""
        saved = (self.root_size, self._calls, self.guard.combined)
        self.root_size, self._calls = state[0], dict(state[1])
        self.guard.begin(tiles)
        try:
            yield
        finally:
            self.guard.end()
            self.root_size, self._calls, self.guard.combined = saved

    # ----------------------------------------------------------------- sizes
    def gather_size(self, x: torch.Tensor) -> tuple[int, int]:
        """Global (H, W) of a tiled tensor from every tile's local size (one object gather)."""
        return self.gather_lengths((int(x.shape[-2]), int(x.shape[-1])))

    def gather_lengths(self, local: tuple[int, int]) -> tuple[int, int]:
        """Global (rows, cols) of a tiled tensor whose tile here is ``local`` long (one object gather)."""
        rows, cols = self.gather_axes((local[0], local[1]))
        assert rows is not None and cols is not None
        return (rows, cols)

    def gather_axes(self, local: tuple[int | None, int | None]) -> tuple[int | None, int | None]:
        """``gather_lengths`` for the axes given (None: not asked; the same on every tile)."""
        if len(self.ranks) == 1:
            return local
        sizes = self.ctx.all_gather_object(local, group=self.group)
        grid = self.grid
        rows = cols = None
        if local[0] is not None:
            rows = sum(int(sizes[row * grid.cols][0] or 0) for row in range(grid.rows))
        if local[1] is not None:
            cols = sum(int(sizes[col][1] or 0) for col in range(grid.cols))
        for tile, size in enumerate(sizes):
            expected = grid.tile_of_size(tile, rows or 0, cols or 0)
            if any(given is not None and given != want for given, want in zip(size, expected)):
                raise ValueError(f"tile sizes {sizes} do not follow the balanced split of "
                                 f"{rows}x{cols} over {grid}; scatter inputs with "
                                 f"dl.scatter_tiles")
        return (rows, cols)

    def input_size(self, layer: object, x: torch.Tensor) -> tuple[int, int]:
        """Global (H, W) input size of ``layer`` at this call, on an image's grid (cached as ``axis_sizes``)."""
        height, width = self.axis_sizes(layer, x)
        return (height, width)

    def image_size_of(self, owner: object, local: tuple[int, int]) -> tuple[int, int]:
        """Global (rows, cols) of a tiled tensor whose tile here is ``local`` long, for this call of
        ``owner`` (a layer, or a functional op family's key): cached per image size and call order."""
        rows, cols = self.image_axes_of(owner, (local[0], local[1]))
        assert rows is not None and cols is not None
        return (rows, cols)

    def image_axes_of(self, owner: object, local: tuple[int | None, int | None]
                      ) -> tuple[int | None, int | None]:
        """``image_size_of`` for the axes given (None: not asked)."""
        rows, cols = self._cached(owner, lambda: self.gather_axes(local))
        return (rows, cols)

    def _cached(self, owner: object, gather: Callable[[], tuple[int | None, ...]]) -> tuple[int | None, ...]:
        """``gather()`` (global sizes), cached per image size and call order of ``owner`` in this forward."""
        if self.root_size is None:
            return gather()
        ordinal = self._calls.get(id(owner), 0)
        self._calls[id(owner)] = ordinal + 1
        key = (self.root_size, id(owner), ordinal)
        size = self._sizes.get(key)
        if size is None:
            size = self._sizes[key] = gather()
        return size

    def gather_lengths_all(self, x: torch.Tensor) -> tuple[int, ...]:
        """Lengths of every tiled axis of the full tensor whose tile here is ``x`` (one object gather)."""
        local = tuple(int(n) for n in x.shape[-self.grid.ndim:])
        if len(self.ranks) == 1:
            return local
        sizes = [tuple(size) for size in self.ctx.all_gather_object(local, group=self.group)]
        full = self.grid.full_lengths(sizes)
        owned = [tuple(stop - start for start, stop in extent) for extent in self.grid.extents(full)]
        if sizes != owned:
            raise ValueError(f"tile sizes {sizes} do not follow the balanced split of {full} over "
                             f"{self.grid}; scatter inputs with dl.scatter_tiles")
        return full

    def axis_sizes(self, owner: object, x: torch.Tensor) -> tuple[int, ...]:
        """Global lengths of every tiled axis of the tensor whose tile here is ``x`` (``(H, W)``, a volume grid's
        ``(D, H, W)``) for this call of ``owner`` (a layer, or a functional op family's key): cached per image
        size and call order."""
        return tuple(int(n or 0) for n in self._cached(owner, lambda: self.gather_lengths_all(x)))

    def exchange(self, geometry: LayerHalo, pad_value: float) -> HaloExchange:
        """This tile's halo exchange of ``geometry`` (one phase per tiled axis), on the tile group's route."""
        return HaloExchange(geometry, self.tile, self.ranks, self.ctx, pad_value, via=self.group)

    def __deepcopy__(self, memo: dict[int, object]) -> SpatialRuntime:
        return self   # holds the communicator: never copied

    def __repr__(self) -> str:
        return f"SpatialRuntime({self.grid}, tile={self.tile}, ranks={self.ranks})"


class SizeKey:
    """What a functional op family caches image sizes under in the runtime, as a layer caches its own
    (``image_size_of(key, ...)``: one entry per image size and call order)."""

    def __init__(self, family: str) -> None:
        self.family = family

    def __repr__(self) -> str:
        return f"SizeKey({self.family!r})"


def guard_runtime(guard: SpatialGuard, what: str) -> SpatialRuntime:
    """The SpatialRuntime behind ``guard``: what op handlers use (grid, tile, sizes, communicator)."""
    runtime = guard.runtime
    if not isinstance(runtime, SpatialRuntime):
        raise TypeError(f"{what} on tiles needs a SpatialRuntime, got {type(runtime).__name__}")
    return runtime


M = TypeVar("M", bound=nn.Module)


def shallow_copy(module: nn.Module, cls: type[M]) -> M:
    """An instance of ``cls`` (``type(module)`` or a subclass) sharing ``module``'s state.

    Parameters, buffers and children are the same objects; the module's own dicts (of
    children, hooks, ...) are copied, so changes to the new module's dicts (a converted
    child, a new hook) do not touch the original.
    """
    new = cls.__new__(cls)
    new.__dict__.update({k: (type(v)(v) if isinstance(v, (dict, set)) else v)
                         for k, v in module.__dict__.items()})
    return new


_BOUND: dict[tuple[type, type], type] = {}


def spatial_class(cls: type[M], torch_class: type[nn.Module]) -> type[M]:
    """``cls`` (the one spatial implementation of a kind of layer, e.g. ``SpatialConv``) bound to the torch class
    a converted layer was (``nn.Conv2d``): a subclass of both, named after the torch class (``SpatialConv2d``), so
    the converted layer is still an instance of its torch class and runs it on replicated inputs."""
    if issubclass(cls, torch_class):
        return cls
    bound = _BOUND.get((cls, torch_class))
    if bound is None:
        bound = _BOUND[(cls, torch_class)] = type(f"Spatial{torch_class.__name__}", (cls, torch_class), {
            "__module__": cls.__module__, "__doc__": f"{torch_class.__name__} on tiles: {cls.__name__} (one "
                                                     f"implementation for images and volumes)"})
    return cast(type[M], bound)


def adopt(cls: type[M], module: nn.Module, runtime: SpatialRuntime, name: str) -> M:
    """``module`` as the spatial layer ``cls`` (bound to ``module``'s torch class, ``spatial_class``), sharing
    ``module``'s state (``shallow_copy``), bound to ``runtime``."""
    new = shallow_copy(module, spatial_class(cls, type(module)))
    object.__setattr__(new, "runtime", runtime)
    object.__setattr__(new, "layer_name", name or type(module).__name__)
    object.__setattr__(new, "_exchanges", {})
    object.__setattr__(new, "serial_class", type(module))
    return new


class SpatialLayer:
    """Mixin: dispatch between tiles and replicated inputs; cached halo exchange per input size.

    Subclasses implement ``tile_forward``; on a replicated input (during a spatial forward)
    the layer runs ``serial_class.forward``, the torch layer it was made from.
    """

    runtime: SpatialRuntime
    layer_name: str
    serial_class: type[nn.Module]
    _exchanges: dict[Hashable, HaloExchange]
    tiled_output = True    # False for layers whose output is replicated (global pool)

    tile_forward: Callable[..., torch.Tensor]   # the layer on this rank's tile (each subclass's own)

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        guard = self.runtime.guard
        call = super().__call__   # type: ignore[misc]
        if not guard.active:   # called directly, or the root itself (its hook enters the guard)
            with torch._C.DisableTorchFunction():
                return call(*args, **kwargs)
        return guard.call_handled(self, call, args, kwargs, self.tiled_output)  # type: ignore[arg-type]

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        if self.runtime.runs_serially(self):  # type: ignore[arg-type]
            return self.serial_class.forward(self, *args, **kwargs)
        return self.tile_forward(*args, **kwargs)

    def _halo(self, key: Hashable, build: Callable[[], HaloExchange]) -> HaloExchange:
        """The layer's halo exchange for ``key`` (its input size), built once."""
        exchange = self._exchanges.get(key)
        if exchange is None:
            exchange = self._exchanges[key] = build()
        return exchange
