"""A layer's footprints per tile of its stage's role (whole maps, image tiles, token tiles), alike layers once."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import replace

import torch
from torch import nn

from ..comm.handles import Group
from ..comm.protocol import Comm
from ..models.pieces import Piece
from ..spatial.fit import meta_copy
from ..spatial.geometry import TileGrid
from .fake_world import AmbiguousSize, FakeComm, FakeWorld, SizeOracle, run_ranks
from .footprint import LayerFootprint, Loss, Shape, SplitRun, StageRole
from .meta_count import count_module
from .token_tiles import attention_widths, ring_terms, token_shapes, with_device_kernels, with_ring_kernels
from .workspace import Workspace


def structure_key(module: nn.Module) -> Hashable:
    """What decides a layer's footprint besides its input: its modules and plain settings (a cut model's one-step
    ``Piece``: its step's, wherever it sits, so a ViT's blocks are simulated once)."""
    if type(module) is Piece and len(module.paths) == 1:
        module = module.get_submodule(module.paths[0])
    settings = []
    for name, sub in module.named_modules():
        plain = tuple(sorted((k, v) for k, v in vars(sub).items()
                             if not k.startswith("_") and k != "training"
                             and isinstance(v, (bool, int, float, str, tuple))
                             and all(isinstance(x, (bool, int, float, str)) for x in
                                     (v if isinstance(v, tuple) else (v,)))))
        settings.append((name, type(sub).__qualname__, plain))
    return (repr(module), tuple(settings))


def training_meta_copy(module: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """A ``meta`` copy of ``module`` (no memory; the original is untouched), in training mode."""
    return (meta_copy(module) if dtype is None else meta_copy(module).to(dtype=dtype)).train()


def tile_shapes(shapes: Sequence[Shape], grid: TileGrid | None, tile: int) -> list[Shape]:
    """Each item's shape on tile ``tile`` (4-d maps are cut, other tensors stay whole)."""
    return [(*shape[:-2], *grid.tile_of_size(tile, shape[-2], shape[-1])) if grid is not None and len(shape) == 4
            else tuple(shape) for shape in shapes]


class StructureKeys:
    """``structure_key`` of layers, computed once per live layer object (held weakly: a layer
    made later at a freed layer's address is not taken for it)."""

    def __init__(self) -> None:
        self._keys: weakref.WeakKeyDictionary[nn.Module, Hashable] = weakref.WeakKeyDictionary()

    def __call__(self, layer: nn.Module) -> Hashable:
        key = self._keys.get(layer)
        if key is None:
            key = structure_key(layer)
            self._keys[layer] = key
        return key

    def __len__(self) -> int:
        """Live layers with a remembered key."""
        return len(self._keys)


class FootprintCache:
    """Layer footprints by (structure, input shapes, dtype, role, loss): each simulated once,
    for one sample (a chunk's footprint is the sample's times the chunk size)."""

    def __init__(self) -> None:
        self._found: dict[Hashable, list[LayerFootprint]] = {}
        self._structure = StructureKeys()
        self.simulated = 0

    def layer(self, layer: nn.Module, shapes: Sequence[Shape], dtype: torch.dtype, role: StageRole,
              loss: Loss | None = None, loss_key: Hashable = None, elementwise: Sequence[type] = (),
              workspace: Workspace = Workspace.CPU, layouts: Sequence[bool] = (),
              split: SplitRun = SplitRun.NONE) -> list[LayerFootprint]:
        """Footprint of ``layer`` on inputs ``shapes`` (whole maps; channels-last where ``layouts``
        says so), one per tile of ``role``; ``split``: with the split backward's terms."""
        samples = shapes[0][0] if shapes and len(shapes[0]) > 0 else 1
        one = [(1, *s[1:]) if len(s) > 0 and s[0] == samples else tuple(s) for s in shapes]
        key = (self._structure(layer), tuple(tuple(s) for s in one), dtype, role,
               loss_key if loss is not None else None, tuple(elementwise), workspace, min(samples, 2),
               tuple(layouts), split)
        found = self._found.get(key)
        if found is None:
            # the conv scratch of one sample differs from that of a batch (workspace.py)
            found = simulate_layer(layer, one, dtype, role, loss, elementwise, workspace, min(samples, 2),
                                   layouts, split)
            self._found[key] = found
            self.simulated += 1
        return found if samples == 1 else [fp.times(samples) for fp in found]


def map_sizes(layer: nn.Module, shapes: Sequence[Shape], dtype: torch.dtype) -> frozenset[tuple[int, int]]:
    """Every (H, W) of a 4-d tensor going into or out of ``layer``'s modules on whole maps (meta)."""
    found: set[tuple[int, int]] = set()

    def note(value: object) -> None:
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor) and t.dim() == 4:
                found.add((int(t.shape[-2]), int(t.shape[-1])))

    def hook(module: nn.Module, args: tuple[object, ...], out: object) -> None:
        note(args)
        note(out)

    module = training_meta_copy(layer, dtype)
    handles = [m.register_forward_hook(hook) for m in module.modules()]
    inputs = [torch.empty(s, dtype=dtype, device="meta") for s in shapes]
    with torch.no_grad():
        module(tuple(inputs) if len(inputs) > 1 else inputs[0])
    for handle in handles:
        handle.remove()
    return frozenset(found)


def tile_classes(grid: TileGrid, shapes: Sequence[Shape]) -> dict[int, int]:
    """tile -> the first tile with the same input shapes and as many neighbours along each
    axis (such tiles allocate the same bytes: one of them is simulated)."""
    first: dict[tuple[tuple[Shape, ...], tuple[int, int]], int] = {}
    out = {}
    for tile in range(grid.num_tiles):
        sides = grid.neighbors(tile)
        counts = (sum(s in sides for s in ("top", "bottom")), sum(s in sides for s in ("left", "right")))
        key = (tuple(tile_shapes(shapes, grid, tile)), counts)
        out[tile] = first.setdefault(key, tile)
    return out


def spatial_module(layer: nn.Module, grid: TileGrid, comm: Comm, role: StageRole, full: Shape,
                   dtype: torch.dtype | None, elementwise: Sequence[type] = (), device: str = "meta") -> nn.Module:
    """``layer`` (copied to ``device``) spatialized for ``comm``'s tile of ``grid``."""
    from ..spatial.convert import spatialize

    copied = training_meta_copy(layer, dtype) if device == "meta" else \
        copy.deepcopy(layer).to(device=device, dtype=dtype).train()
    return spatialize(nn.Sequential(copied), grid, comm, Group(tuple(range(grid.num_tiles))),
                      image_size=(full[-2], full[-1]), halo_d2=role.halo_d2,
                      fused_layers=role.fused_layers, elementwise=tuple(elementwise))


def simulate_layer(layer: nn.Module, shapes: Sequence[Shape], dtype: torch.dtype, role: StageRole,
                   loss: Loss | None = None, elementwise: Sequence[type] = (),
                   workspace: Workspace = Workspace.CPU, samples: int = 2,
                   layouts: Sequence[bool] = (), split: SplitRun = SplitRun.NONE) -> list[LayerFootprint]:
    """Footprint of ``layer`` per tile of ``role`` (one for whole maps); inputs are whole maps
    (channels-last where ``layouts`` says so); ``samples``: the chunk size the conv scratch is
    chosen for (``workspace.conv_workspace``); ``split``: with the terms of the engine's split
    backward (``SplitTerms``, a second forward).

    Tiles run alone, answered by a ``SizeOracle`` (one per class of alike tiles); when the
    oracle cannot tell sizes apart, all tiles run together on a threaded ``FakeWorld``.
    """
    if role.grid is None:
        copied = training_meta_copy(with_device_kernels(layer, workspace == Workspace.CPU), dtype)
        return [count_module(copied, shapes, dtype, None, loss, workspace, samples, layouts, split)]
    if role.tokens is not None:
        return simulate_token_layer(layer, shapes, dtype, role, loss, workspace, samples, split)
    grid = TileGrid(*role.grid)
    full = next((s for s in shapes if len(s) == 4), None)
    if full is None:
        raise ValueError(f"{type(layer).__name__}: a spatial stage needs 4-d (N, C, H, W) inputs")
    oracle = SizeOracle(grid.rows, grid.cols, map_sizes(layer, shapes, dtype))

    def tile_run(tile: int, comm: FakeComm) -> LayerFootprint:
        module = spatial_module(layer, grid, comm, role, full, dtype, elementwise)
        return count_module(module, tile_shapes(shapes, grid, tile), dtype, comm, loss, workspace, samples, layouts,
                            split)

    try:
        classes = tile_classes(grid, shapes)
        found = {tile: tile_run(tile, FakeComm(tile, None, torch.device("meta"), world_size=grid.num_tiles,
                                               sizes=oracle)) for tile in sorted(set(classes.values()))}
        return [found[classes[tile]] for tile in range(grid.num_tiles)]
    except AmbiguousSize:
        pass
    world = FakeWorld(grid.num_tiles)
    return run_ranks(world, lambda rank: tile_run(rank, world.comm(rank)))


def simulate_token_layer(layer: nn.Module, shapes: Sequence[Shape], dtype: torch.dtype, role: StageRole,
                         loss: Loss | None = None, workspace: Workspace = Workspace.CPU, samples: int = 2,
                         split: SplitRun = SplitRun.NONE) -> list[LayerFootprint]:
    """Footprint of a ViT's ``layer`` per tile of ``role`` (its ``tokens`` set): a layer on tokens run alone on
    each tile's tokens (everything but attention acts per token), its rings' blocks in flight and messages
    added (token_tiles.py); the patch embedding (images in) as the whole image's, scaled to the tile's tokens."""
    if role.grid is None or role.tokens is None:
        raise ValueError("simulate_token_layer needs a role with a tile grid and a token grid")
    tokens = role.tokens.member_tokens(TileGrid(*role.grid))
    total = role.tokens.total
    if any(len(s) == 4 for s in shapes):
        (whole,) = simulate_layer(layer, shapes, dtype, StageRole(), loss, (), workspace, samples, (), split)
        return [whole.times(count / total) for count in tokens]
    widths = attention_widths(layer)
    member_layer = with_ring_kernels(layer)   # saves what a ring member saves (no attention weights)
    chunk = shapes[0][0] if shapes and shapes[0] else 1
    found: dict[int, LayerFootprint] = {}
    out = []
    for member, count in enumerate(tokens):
        if count not in found:
            found[count] = simulate_layer(member_layer, token_shapes(shapes, total, count), dtype, StageRole(), loss,
                                          (), workspace, samples, (), split)[0]
        terms = ring_terms(widths, tokens, member, chunk, dtype.itemsize)
        out.append(replace(found[count], forward_peak=found[count].forward_peak + terms.forward_bytes,
                           backward_peak=found[count].backward_peak + terms.backward_bytes,
                           forward_traffic=terms.forward_traffic, backward_traffic=terms.backward_traffic))
    return out
