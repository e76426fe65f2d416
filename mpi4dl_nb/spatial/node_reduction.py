"""Tile gradients summed through the node's shared memory when every tile of the group runs on one node
(``reduce_tile_gradients``'s first choice on CPU ranks of the mpi plane): each gradient copied into this rank's slab
of the window as soon as backward has accumulated it (still in cache), the sums taken when asked. Only what the
other ranks add is copied: the elements of this rank's own share of the sum are added from ``.grad`` itself."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..comm.grad_hooks import hook_arrivals, remove_hooks
from ..comm.handles import Group
from ..comm.node_sum import SUMMED_DTYPES, NodeSum, NodeSums
from ..comm.node_writes import EarlyWrites


class NodeReduction:
    """The ``.grad`` of ``params`` (one dtype) summed over the node's tiles: a post-accumulate hook per parameter
    writes its gradient's elements outside this rank's share into its slab (``comm/node_writes.EarlyWrites``);
    ``finish`` writes whatever changed since (or never arrived: zeros for a missing one), sums, and writes the sums
    into the ``.grad`` tensors in place."""

    def __init__(self, node: NodeSum, params: Sequence[nn.Parameter]) -> None:
        self.node = node
        self.params = list(params)
        self.key = tuple(id(p) for p in self.params)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.count = sum(p.numel() for p in self.params)
        self.dtype = self.params[0].dtype
        self._slab: tuple[int, torch.Tensor] | None = None         # (the window's capacity, this rank's slab in it)
        places, offset = [], 0
        for p in self.params:
            ranges = node.peer_ranges(self.count, offset, offset + p.numel())
            places.append([(low, low - offset, high - offset) for low, high in ranges])
            offset += p.numel()
        self.writes = EarlyWrites(node, places, self.slab)
        self._hooks = hook_arrivals(self, self.params)

    def covers(self, params: Sequence[nn.Parameter]) -> bool:
        return tuple(id(p) for p in params) == self.key

    def slab(self) -> torch.Tensor:
        """This rank's slab as the parameters' elements (made again only when the window grew)."""
        if self._slab is None or self._slab[0] != self.node.capacity:
            self._slab = (self.node.capacity, self.node.slab(self.dtype, self.count))
        return self._slab[1]

    def arrived(self, param: torch.Tensor) -> None:
        """A gradient of ``param`` was accumulated: write it into the slab now, while it is in cache."""
        self.writes.write(self.index[id(param)], param.grad)

    def finish(self) -> None:
        """Write what changed since its hook (or never came), sum over the node, write the sums into ``.grad``."""
        self.writes.refresh([p.grad for p in self.params])
        self.node.reduce_slab([torch.zeros_like(p) if p.grad is None else p.grad for p in self.params])

    def cancel(self) -> None:
        remove_hooks(self._hooks)


def summed_on_node(ctx: object, group: Group | None, params: Sequence[nn.Parameter], net: nn.Module) -> bool:
    """Sum the ``.grad`` of ``params`` over ``group`` through its node's shared memory, if it can: the context can
    (the mpi plane), the members share a node, every parameter is a float32 or float64 CPU tensor and the node has
    room for the window. Each ``.grad`` is replaced by the sum in place, as one all-reduce of it would; a missing one
    counts as zeros and stays missing. Where the parameters have one dtype, a ``NodeReduction`` kept on ``net``
    copies the gradients of later backwards as they arrive. False: nothing was done (the same answer on every
    member)."""
    if not isinstance(ctx, NodeSums):
        return False
    if any(p.device.type != "cpu" or p.dtype not in SUMMED_DTYPES for p in params):
        return False
    node = ctx.node_sum(group)
    if node is None:
        return False
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    largest = max(sum(p.numel() * p.element_size() for p in same) for same in by_dtype.values())
    if not node.reserve(largest):
        return False
    armed = net.__dict__.get("node_reduction")
    if isinstance(armed, NodeReduction) and armed.covers(params):
        armed.finish()
        return True
    if isinstance(armed, NodeReduction):
        armed.cancel()
        del net.__dict__["node_reduction"]
    for dtype in sorted(by_dtype, key=str):
        same = by_dtype[dtype]
        node.all_reduce([torch.zeros_like(p) if p.grad is None else p.grad for p in same])
    if len(by_dtype) == 1:
        net.__dict__["node_reduction"] = NodeReduction(node, params)
    return True
