"""Reduce-scatter and all-gather of sharded state (ZeRO) through a node's shared window, no message copies between
(docs/sharding.md, "The seam"; BENCHMARKS.md §19).

A member's slab is laid out as the *member-order flat* of the pieces (member 0's piece, then member 1's, ...). A
reduce-scatter writes the others' pieces of its tensors into its own slab, meets the others, and sums its piece from
theirs (its own terms read from its tensors); an all-gather writes its piece at its place, meets, and copies theirs.
Every operation meets the others again at its end, so no member writes a slab another still reads. ``common``: one
memory every member maps, for tensors the members hold alike (each writes its own slices; a meeting publishes them).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

from .node_sum import SUMMED_DTYPES, NodeSum


def _starts(counts: Sequence[int]) -> list[int]:
    return [0, *accumulate(counts)]


class NodeShards:
    """Pieces of ``dtype`` CPU tensors exchanged over ``node``'s members (ZeRO's collectives on one node)."""

    def __init__(self, node: NodeSum, dtype: torch.dtype) -> None:
        if dtype not in SUMMED_DTYPES:
            raise ValueError(f"NodeShards sums {SUMMED_DTYPES}, not {dtype}")
        self.node, self.dtype = node, dtype

    @property
    def index(self) -> int:
        return self.node.index

    @classmethod
    def reserved(cls, node: NodeSum | None, dtype: torch.dtype, count: int) -> NodeShards | None:
        """Shards over ``node`` for flats of ``count`` elements of ``dtype``, if the node has room for the window
        (None on every member otherwise, or without a node). Collective over the node's members."""
        if node is None or dtype not in SUMMED_DTYPES:
            return None
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return cls(node, dtype) if node.reserve(count * itemsize) else None

    def _slabs(self, total: int) -> list[torch.Tensor]:
        self.node.slab(self.dtype, total)       # checks the window's room
        return [self.node.view(member, self.dtype, total) for member in range(self.node.size)]

    def common(self, tensors: Sequence[torch.Tensor], mine: Sequence[tuple[int, int]]) -> list[torch.Tensor] | None:
        """Views of one memory every member maps, in the shapes of ``tensors`` (alike on every member), holding
        their values: each member writes its own flat slices ``mine`` (start, stop per tensor; together they cover
        every element once), so their pages lie near the member that updates them. None on every member where the
        node has no room. Collective."""
        memory = self.node.common(self.dtype, sum(t.numel() for t in tensors))
        if memory is None:
            return None
        views, at = [], 0
        for tensor, (start, stop) in zip(tensors, mine):
            flat = memory[at:at + tensor.numel()]
            flat[start:stop].copy_(tensor.detach().reshape(-1)[start:stop])
            views.append(flat.view(tensor.shape))
            at += tensor.numel()
        self.meet()
        return views

    def meet(self) -> None:
        """Meet the other members: every write to the window and the common memory before visible after."""
        self.node.barrier()

    def slab(self, total: int) -> torch.Tensor:
        """This member's slab as a member-order flat of ``total`` elements (for ``EarlyWrites``)."""
        return self._slabs(total)[self.index]

    def reduce_scatter(self, pieces: Sequence[Sequence[torch.Tensor]], counts: Sequence[int],
                       written: bool = False) -> torch.Tensor:
        """This member's piece of the sum over the members: ``pieces[m]`` are this member's flat tensors that make
        member ``m``'s piece (``counts[m]`` elements) of its member-order flat; ``written``: the others' pieces are in
        this member's slab already (``comm/node_writes.EarlyWrites``). A new tensor. Collective: every member passes
        tensors of the same sizes."""
        starts, me = _starts(counts), self.index
        slabs = self._slabs(starts[-1])
        for member, tensors in enumerate(pieces):
            if member != me and not written:
                _write(slabs[me], starts[member], tensors)
        self.node.barrier()
        out = torch.empty(counts[me], dtype=self.dtype)
        at = 0
        for tensor in pieces[me]:
            size, low = tensor.numel(), starts[me] + at
            own = tensor.detach().reshape(-1)
            terms = [own if member == me else slabs[member][low:low + size] for member in range(self.node.size)]
            target = out[at:at + size]
            torch.add(terms[0], terms[1], out=target)
            for term in terms[2:]:
                target.add_(term)
            at += size
        self.node.barrier()
        return out

    def all_gather(self, mine: Sequence[torch.Tensor], outs: Sequence[Sequence[torch.Tensor]],
                   counts: Sequence[int]) -> None:
        """Every member's piece into ``outs``: member ``m``'s piece (``counts[m]`` elements, in order) into the
        views ``outs[m]``; this member's own from ``mine`` (``mine[k]`` into ``outs[me][k]``). Collective."""
        starts, me = _starts(counts), self.index
        slabs = self._slabs(starts[-1])
        _write(slabs[me], starts[me], mine)
        self.node.barrier()
        for member, views in enumerate(outs):
            at = starts[member]
            for k, view in enumerate(views):
                size = view.numel()
                source = mine[k] if member == me else slabs[member][at:at + size]
                if source.data_ptr() != view.data_ptr():     # a shard that is its slice of the whole stays put
                    view.copy_(source.detach().view(view.shape))
                at += size
        self.node.barrier()


def _write(slab: torch.Tensor, start: int, tensors: Sequence[torch.Tensor]) -> None:
    """Flat ``tensors`` one after another into ``slab`` from element ``start``."""
    at = start
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        slab[at:at + flat.numel()].copy_(flat)
        at += flat.numel()
