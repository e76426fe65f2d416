"""How the holders of a sharded stage exchange its pieces: the planes' collectives, or the node's shared window."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from ..comm.grad_hooks import hook_arrivals
from ..comm.handles import Group
from ..comm.node_shards import NodeShards
from ..comm.node_sum import NodeSums
from ..comm.node_writes import EarlyWrites, Place
from ..comm.protocol import Comm
from .plan import ShardPlan
from .zero_stages import ZeroStage


class ShardTransport(Protocol):
    """What a sharded stage asks of its holders' exchange, whichever way it moves the pieces."""

    common: bool   # the holders' whole weights live in one memory they all map (each step writes its slices there)

    def reduce_scatter(self, grads: Sequence[torch.Tensor], plan: ShardPlan) -> torch.Tensor:
        """This holder's piece (member order, ``plan``) of the sum over the holders of the flat ``grads``."""
        ...

    def all_gather(self, shards: Sequence[torch.Tensor], wholes: Sequence[torch.Tensor], plan: ShardPlan) -> None:
        """Every holder's ``shards`` (cut as ``plan``) copied into the flat whole tensors ``wholes``."""
        ...

    def meet(self) -> None:
        """Where ``common``: meet the other holders, every holder's writes to the common memory visible after."""
        ...


def by_member(flats: Sequence[torch.Tensor], plan: ShardPlan) -> list[list[torch.Tensor]]:
    """Each member's slices of the flat tensors ``flats`` (cut as ``plan``): the member-order flat, uncopied."""
    return [[flat[slice(*plan.bounds(p, m))] for p, flat in enumerate(flats)] for m in range(plan.members)]


class Messages:
    """The plane's reduce-scatter and all-gather(v) over ``group`` on one flat tensor in member order."""

    common = False

    def __init__(self, ctx: Comm, group: Group) -> None:
        self.ctx, self.group = ctx, group

    def reduce_scatter(self, grads: Sequence[torch.Tensor], plan: ShardPlan) -> torch.Tensor:
        flat = torch.cat([grads[index][start:stop] for index, start, stop in plan.places()])
        return self.ctx.reduce_scatter(flat, plan.counts, self.group)

    def all_gather(self, shards: Sequence[torch.Tensor], wholes: Sequence[torch.Tensor], plan: ShardPlan) -> None:
        whole = self.ctx.all_gather(torch.cat([shard.detach() for shard in shards]), plan.counts, self.group)
        at = 0
        with torch.no_grad():
            for index, start, stop in plan.places():
                wholes[index][start:stop].copy_(whole[at:at + stop - start])
                at += stop - start

    def meet(self) -> None:
        return None


class NodeWindow:
    """Holders on one node exchange through its shared window (``comm/node_shards.py``): at ZeRO stage 2 each
    gradient's slices for the others written into the slab as backward accumulates it (``EarlyWrites``); where
    ``common``, the whole weights in one memory every holder maps, so an all-gather after a step is a meeting."""

    def __init__(self, node: NodeShards, params: Sequence[nn.Parameter], plan: ShardPlan, early: bool,
                 common: bool) -> None:
        self.node, self.common = node, common
        self.index_of = {id(p): i for i, p in enumerate(params)}
        total = sum(plan.counts)
        self.writes = EarlyWrites(node.node, early_places(plan), lambda: node.slab(total)) if early else None
        if self.writes is not None:
            self._hooks = hook_arrivals(self, params)

    def arrived(self, param: torch.Tensor) -> None:
        """Backward accumulated ``param``'s gradient: its slices for the others into the slab now, while in cache."""
        assert self.writes is not None
        self.writes.write(self.index_of[id(param)], param.grad)

    def reduce_scatter(self, grads: Sequence[torch.Tensor], plan: ShardPlan) -> torch.Tensor:
        if self.writes is not None:
            self.writes.refresh(grads)
        return self.node.reduce_scatter(by_member(grads, plan), plan.counts, written=self.writes is not None)

    def all_gather(self, shards: Sequence[torch.Tensor], wholes: Sequence[torch.Tensor], plan: ShardPlan) -> None:
        self.node.all_gather([shard.detach() for shard in shards], by_member(wholes, plan), plan.counts)

    def meet(self) -> None:
        if self.common:
            self.node.meet()


def early_places(plan: ShardPlan) -> list[list[Place]]:
    """Per parameter, where its slices for the other holders lie in this holder's slab: (at, start, stop)."""
    starts = [0]
    for count in plan.counts:
        starts.append(starts[-1] + count)
    places: list[list[Place]] = [[] for _ in plan.numels]
    for member in range(plan.members):
        at = starts[member]
        for index in range(len(plan.numels)):
            start, stop = plan.bounds(index, member)
            if member != plan.index and stop > start:
                places[index].append((at, start, stop))
            at += stop - start
    return places


def choose_transport(ctx: Comm, group: Group, params: Sequence[nn.Parameter], plan: ShardPlan,
                     zero: ZeroStage) -> ShardTransport:
    """The node's window where it serves (the mpi plane, every holder on one node, CPU parameters of one summable
    dtype, room in the node's shared memory; not at stage 3, whose window would hold the whole stage it frees),
    its common memory for the whole weights where every parameter is alone in its memory; else the collectives.
    Collective over ``group`` (the same answer on every holder); may move ``params`` into the common memory."""
    dtypes = {p.dtype for p in params}
    if zero.shards_weights or not isinstance(ctx, NodeSums) or len(dtypes) != 1 or \
            any(p.device.type != "cpu" for p in params):
        return Messages(ctx, group)
    node = NodeShards.reserved(ctx.node_sum(group), dtypes.pop(), sum(p.numel() for p in params))
    if node is None:
        return Messages(ctx, group)
    return NodeWindow(node, params, plan, early=zero.shards_gradients, common=_into_common(node, params, plan))


def _into_common(node: NodeShards, params: Sequence[nn.Parameter], plan: ShardPlan) -> bool:
    """Move ``params`` (alike on every holder) into one memory the holders on ``node`` all map, each holder
    writing its own slices; False (on every holder: the parameters are alike) where a parameter shares its memory
    with another tensor (moving it would part them) or the node has no room. Collective."""
    if not all(alone(p) for p in params):
        return False
    views = node.common(params, plan.mine())
    if views is None:
        return False
    for param, view in zip(params, views):
        param.data = view
    return True


def alone(param: torch.Tensor) -> bool:
    """Whether ``param`` is alone in its memory (no other tensor's elements beside its own)."""
    whole = param.numel() * param.element_size()
    return bool(param.storage_offset() == 0 and param.untyped_storage().nbytes() == whole)
