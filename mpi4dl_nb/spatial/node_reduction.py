"""Tile gradients summed through the node's shared memory when every tile of the group runs on one node
(``reduce_tile_gradients``'s first choice on CPU ranks of the mpi plane): each gradient copied into this rank's slab
of the window as soon as backward has accumulated it (still in cache), the sums taken when asked. Only what the
other ranks add is copied: the elements of this rank's own share of the sum are added from ``.grad`` itself."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from ..comm.handles import Group
from ..comm.node_sum import SUMMED_DTYPES, NodeSum
from .grad_hooks import hook_arrivals, remove_hooks


@runtime_checkable
class NodeSums(Protocol):
    """A context that can sum over a group through its node's shared memory (``Context.node_sum``)."""

    def node_sum(self, group: Group | None = None) -> NodeSum | None: ...


class NodeReduction:
    """The ``.grad`` of ``params`` (one dtype) summed over the node's tiles: a post-accumulate hook per parameter
    copies its gradient into its place in this rank's slab; ``finish`` copies whatever changed since (or never
    arrived: zeros for a missing one), sums, and writes the sums into the ``.grad`` tensors in place."""

    def __init__(self, node: NodeSum, params: Sequence[nn.Parameter]) -> None:
        self.node = node
        self.params = list(params)
        self.key = tuple(id(p) for p in self.params)
        self.offsets: dict[int, int] = {}
        offset = 0
        for p in self.params:
            self.offsets[id(p)] = offset
            offset += p.numel()
        self.count = offset
        self.dtype = self.params[0].dtype
        self.copied: dict[int, tuple[torch.Tensor, int]] = {}     # id(param) -> (the .grad copied, its version)
        self._slab: tuple[int, torch.Tensor] | None = None         # (the window's capacity, this rank's slab in it)
        self._hooks = hook_arrivals(self, self.params)

    def covers(self, params: Sequence[nn.Parameter]) -> bool:
        return tuple(id(p) for p in params) == self.key

    def slab(self) -> torch.Tensor:
        """This rank's slab as the parameters' elements (made again only when the window grew)."""
        if self._slab is None or self._slab[0] != self.node.capacity:
            self._slab = (self.node.capacity, self.node.slab(self.dtype, self.count))
        return self._slab[1]

    def _copy(self, slab: torch.Tensor, param: torch.Tensor) -> None:
        """``param``'s gradient (zeros for none) into the slab where the other members add it: the elements
        outside this rank's own share, which it adds from ``.grad`` itself."""
        grad = param.grad
        self.node.write_peer_ranges(slab, self.count, self.offsets[id(param)], param.numel(), grad)
        if grad is None:
            self.copied.pop(id(param), None)
        else:
            self.copied[id(param)] = (grad, grad._version)

    def _claim(self) -> None:
        """The slab holds this reduction's copies only while no other sum used it since (another net on the same
        tiles, the window grown): if one did, every copy is made again."""
        if self.node.holder is not self:
            self.copied.clear()
            self.node.holder = self

    def arrived(self, param: torch.Tensor) -> None:
        """A gradient of ``param`` was accumulated: copy it into the slab now, while it is in cache."""
        self._claim()
        self._copy(self.slab(), param)

    def finish(self) -> None:
        """Copy in what changed since its hook (or never came), sum over the node, write the sums into ``.grad``."""
        self._claim()
        slab = self.slab()
        for p in self.params:
            seen = self.copied.get(id(p))
            if seen is None or p.grad is not seen[0] or p.grad._version != seen[1]:
                self._copy(slab, p)
        self.node.reduce_slab([torch.zeros_like(p) if p.grad is None else p.grad for p in self.params])
        self.copied.clear()      # the sums changed every .grad: the next backward's hooks copy them again

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
