"""spatialize: turn an ordinary CNN module tree into one that runs on image tiles, exactly.

Leaves are converted in a copy of the tree (containers are shallow copies, parameters and buffers are the same
objects). Which module becomes what is the list of conversion families (``families.FAMILIES``, asked in order;
``families.add_family`` adds one at run time), each a record its own module declares: torch layers with a spatial
version (registry.py, their 3-D twins on a volume's grid), element-wise layers as they are, timm's transformers and
attention blocks as their tile versions. This module names no family. Custom containers keep their own ``forward``:
residual adds, gates, channel concatenation and element-wise ops work tile by tile because ownership depends only on
a tensor's size (see geometry.py); the op guard (guard.py) checks every such operation during the forward and
refuses the ones that are not exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ..comm.handles import Group
from ..comm.protocol import Comm
from ..config import ConfigError
from .families import OP_FAMILIES, Family, active_families
from .geometry import Box, TileGrid
from .layer import SpatialRuntime, shallow_copy
from .node_reduction import NodeReduction, summed_on_node
from .registry import converted_on
from .tile_reduction import PrivateGroups, TileReduction


class _Converter:
    """One conversion: memoised (a module reachable twice becomes one converted module)."""

    def __init__(self, runtime: SpatialRuntime, registered: tuple[type, ...], families: Sequence[Family]) -> None:
        self.runtime = runtime
        self.registered = registered
        self.families = tuple(families)
        self.done: dict[int, nn.Module] = {}

    def __call__(self, module: nn.Module, name: str) -> nn.Module:
        converted = self.done.get(id(module))
        if converted is None:
            converted = self._convert(module, name)
            self.done[id(module)] = converted
            self.runtime.module_names.setdefault(id(converted), name)
        return converted

    def _convert(self, module: nn.Module, name: str) -> nn.Module:
        kind, runtime = type(module), self.runtime
        for family in self.families:
            if family.matches(module):
                converted = family.convert(module, name, runtime, self)
                if converted is not None:
                    return converted
        if isinstance(module, self.registered):   # exact as it is: runs unchecked, share summed
            new = shallow_copy(module, kind)
            new.register_forward_pre_hook(runtime.guard.suspend)
            new.register_forward_hook(runtime.guard.resume, always_call=True)
            runtime.partial_parameters.extend(p for p in module.parameters())
            return new
        children = list(module.named_children())
        if not children and type(module).__module__.startswith("torch.") and kind is not nn.Sequential:
            # (an empty nn.Sequential is the identity: ShuffleNetV2's and GhostNet's shortcuts)
            supported = ", ".join(t.__name__ for t in converted_on(runtime.grid.ndim))
            raise ConfigError("model", f"layer {name or '<root>'!r} ({kind.__name__}) is not "
                              f"supported by spatial parallelism; supported: {supported}, "
                              f"element-wise layers, and containers of them. If it is exact on "
                              f"tiles (acts on each pixel independently), pass "
                              f"elementwise=({kind.__name__},); otherwise put it after the "
                              f"spatial stage")
        # a custom module (leaf or container) keeps its forward: the op guard checks it
        new = shallow_copy(module, kind)
        for child_name, child in children:
            full = f"{name}.{child_name}" if name else child_name
            new._modules[child_name] = self(child, full)
        return new


def spatialize(module: nn.Module, grid: TileGrid, ctx: Comm, group: Group | None = None, *,
               image_size: Sequence[int] | None = None, halo_d2: bool = False,
               fused_layers: int = 1, elementwise: Iterable[type] = (),
               check_ops: bool = True, families: Sequence[Family] | None = None) -> nn.Module:
    """A copy of ``module`` that computes on this rank's tile exactly what ``module`` computes
    on the whole image (same Parameter objects, so optimizer and state dict are shared).

    Input: this rank's tile ``(N, C, h, w)``, on a volume's grid ``(N, C, d, h, w)``
    (``dl.scatter_tiles``); output: the owned tile
    of the output (``grid.tile_box`` of the output size), or the replicated result after a
    global average pool (a timm ViT's: its logits or pooled features, the same on every rank).
    ``group``: the tile ranks (``group.ranks[t]`` holds tile ``t``); None means the world. Only tile
    neighbours and ``group`` collectives communicate.
    ``image_size`` (H, W), when given, spares one small all-gather per forward.
    ``halo_d2``/``fused_layers``: one wider halo exchange per run of ``fused_layers``
    windowed layers inside each nn.Sequential (see fused.py). ``elementwise``: your module
    classes that are exact on tiles as they are (per pixel / per channel); they run unchecked
    and their parameters' gradients are summed over tiles like a spatial layer's.

    ``check_ops`` (default True): every torch operation a custom ``forward`` applies to a
    tile is checked, and one that is not exact on tiles (a functional pool, padding,
    slicing the spatial dims, ...) raises ConfigError naming the module and the op. False
    skips the checks once a model has passed (placement tracking, which SE gates need,
    stays on).

    ``families``: the conversion table to ask, in order (default ``families.active_families()``: the run-time
    additions of ``families.add_family``, then ``families.FAMILIES``); e.g. ``(my_family, *FAMILIES)``.

    Parameter gradients of spatial layers are partial (this tile's share): sum them over
    the tile group (``reduce_tile_gradients``) or let the engine's gradient sum do it.
    Parameters used on replicated data (a classifier after the global pool, an SE gate's
    layers) get the full gradient on every tile (``tile_replicated_parameters``).
    """
    if grid.volumetric and image_size:
        raise ConfigError("image_size", f"{grid}: a volume's tiles take no image_size; leave it out (the sizes are "
                          f"learnt at the first forward)")
    runtime = SpatialRuntime(grid, ctx, group, (image_size[0], image_size[1]) if image_size else None,
                             check_ops=check_ops, op_families=OP_FAMILIES)
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise ConfigError("model", "spatialize a module with a forward (e.g. nn.Sequential), "
                          "not a ModuleList/ModuleDict")
    table = active_families() if families is None else families
    root = _Converter(runtime, tuple(elementwise), table)(module, "")
    if halo_d2:
        from .fused import fuse_sequentials

        fuse_sequentials(root, runtime, fused_layers)
    if root is module:   # an element-wise root: give it its own hooks
        root = shallow_copy(module, type(module))
        runtime.module_names[id(root)] = ""
    root.register_forward_pre_hook(runtime.begin_forward)
    root.register_forward_hook(runtime.end_forward, always_call=True)
    object.__setattr__(root, "spatial_runtime", runtime)
    return root


def runtime_of(net: nn.Module) -> SpatialRuntime:
    """The SpatialRuntime of a module returned by ``spatialize``."""
    runtime = getattr(net, "spatial_runtime", None)
    if not isinstance(runtime, SpatialRuntime):
        raise ValueError("not a spatialized module: build it with dl.spatialize(module, grid, ctx)")
    return runtime


def tile_partial_parameters(net: nn.Module) -> list[nn.Parameter]:
    """Parameters whose gradient on each tile is that tile's share (to be summed over tiles)."""
    runtime = runtime_of(net)
    seen = {id(p) for p in runtime.replicated_parameters()}
    result: list[nn.Parameter] = []
    for p in runtime.partial_parameters:
        if id(p) not in seen:
            seen.add(id(p))
            result.append(p)
    return result


def tile_replicated_parameters(net: nn.Module) -> list[nn.Parameter]:
    """Parameters whose gradient is already the full gradient on every tile (used on
    replicated tensors: classifier, gate layers): sum them over tiles and it is counted
    once per tile."""
    partial = {id(p) for p in tile_partial_parameters(net)}
    return [p for p in net.parameters() if id(p) not in partial]


def reduce_tile_gradients(net: nn.Module, *, overlap: bool = True, shared_memory: bool = True) -> None:
    """Sum the partial gradients of spatial layers over the tile group.

    ``shared_memory`` (default): where the tile group's ranks share one node, the mpi plane runs and every parameter
    is a float32 or float64 CPU tensor, the sum goes through the node's shared memory (``node_reduction``: each tile
    writes its gradients once into its slab of a shared window, from the second call on as backward accumulates
    them, then sums its share of everyone's: one copy fewer than an all-reduce's messages); the sums are written
    into the ``.grad`` tensors in place, as the single all-reduce does.

    Otherwise the first call sums them in one all-reduce; with ``overlap`` (default) it also arms ``TileReduction``:
    from then on, every backward after a forward of ``net`` posts each bucket's all-reduce as soon as its gradients
    are accumulated (on a communicator of its own), and this call only posts what is left, waits, and hands the
    sums back as the parameters' ``.grad``. Any gradient changed after its bucket was posted (another backward, a
    ``zero_grad``) is summed again here, so the result is always the sum of the ``.grad`` this call finds: the
    same per element as the single all-reduce. ``overlap=False``: the single all-reduce (and no hooks). Where the
    context cannot make a private communicator (the torch plane) the single all-reduce is used."""
    runtime = runtime_of(net)
    params = [p for p in tile_partial_parameters(net) if p.requires_grad]     # a frozen trunk sends nothing
    if len(runtime.ranks) == 1 or not params:
        return
    armed = net.__dict__.get("tile_reduction")
    if shared_memory and summed_on_node(runtime.ctx, runtime.group, params, net):
        if isinstance(armed, TileReduction):
            armed.cancel()
            del net.__dict__["tile_reduction"]
        return
    on_node = net.__dict__.pop("node_reduction", None)
    if isinstance(on_node, NodeReduction):
        on_node.cancel()
    if isinstance(armed, TileReduction):
        if overlap and armed.covers(params):
            armed.finish()
            return
        armed.cancel()
        del net.__dict__["tile_reduction"]
    _reduce_at_once(runtime.ctx, runtime.group, params)
    if overlap and isinstance(runtime.ctx, PrivateGroups):
        group = runtime.ctx.private_group(runtime.group)
        if group is not None:
            net.__dict__["tile_reduction"] = TileReduction(runtime.ctx, group, params, net)


def _reduce_at_once(ctx: Comm, group: Group | None, params: Sequence[nn.Parameter]) -> None:
    """One all-reduce of every gradient ``params`` hold (the same on every tile), written back in place."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    ctx.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def output_boxes(grid: TileGrid, out_height: int, out_width: int) -> list[Box]:
    """Box each tile owns of a spatial stage's ``out_height x out_width`` output.

    Ownership depends only on the size (balanced split), so this is ``grid.tile_boxes``;
    it is what a non-spatial rank uses to assemble tiles and split the gradient back.
    """
    return grid.tile_boxes(out_height, out_width)
