"""ZeRO stages 1-3 over each group of ranks holding the same weights: sharded optimizer state, gradients, weights.

Each trainable parameter of a shared stage is flattened and cut over the stage's holders (``zero_layout.py``); this
rank keeps its slice as a parameter of its own (a *shard*: at levels 1-2 a view of the whole parameter's slice, at
level 3 memory of its own), which the optimizer steps, so parameter groups, weight decay and layer-decay scales stay
those of the whole parameter, element by element. Holders on one node (mpi plane, CPU, levels 1-2) keep the whole
weights in one memory they all map and exchange gradients' pieces through the node's shared window
(``comm/node_shards.py``), others by MPI's or torch's collectives. Level 1:
gradients are summed whole as at level 0, each rank steps its shards, the all-gather rebuilds the parameters. Level
2: the gradients are summed by a reduce-scatter straight into the shards (the whole gradient freed). Level 3:
between uses a parameter keeps no memory (its storage resized to 0); hooks gather each layer's weights before its
forward and its backward and free them after (``zero_layers.py``), or the runtime a whole stage's around each
action. docs/sharding.md.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from ..comm.handles import Group
from ..comm.node_shards import NodeShards
from ..comm.protocol import Comm
from ..errors import ConfigError
from ..spatial.grad_hooks import hook_arrivals
from ..spatial.node_reduction import NodeSums
from .zero_layout import ShardPlan

Entries = dict[str, dict[str, object]]   # whole-model parameter key -> its optimizer state (name -> value)
STEP = "step"                             # the optimizer state entry that is a counter, not one value per element


def _portable(value: object) -> object:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


class ShardedStage:
    """One stage's trainable parameters (``named``: whole-model key, parameter) sharded over ``group`` (every rank
    holding the stage) at ZeRO ``level``; ``silent()``: ids of parameters whose gradient this rank does not add
    (``dataparallel.py``'s rule for a spatial stage's tiles)."""

    def __init__(self, ctx: Comm, stage: int, named: Sequence[tuple[str, nn.Parameter]], group: Group,
                 level: int, silent: Callable[[], Collection[int]]) -> None:
        self.ctx, self.stage, self.group, self.level, self.silent = ctx, stage, group, level, silent
        self.keys = [key for key, _ in named]
        self.params = [param for _, param in named]
        for key, param in named:
            _check_shardable(key, param, level)
        self.plan = ShardPlan(tuple(p.numel() for p in self.params), group.size, group.rank_of(ctx.rank))
        self.counts = self.plan.counts
        self.offsets = self.plan.piece_offsets()
        self.node = _node_route(ctx, group, self.params, level)
        # levels 1-2 on the node: the holders' whole weights in one memory they all map (the all-gather a barrier)
        self.common = self.node if self.node is not None and _into_common(self.node, self.params, self.plan) else None
        # levels 1-2 keep the whole parameters: a shard is its slice of them (the step writes it in place, no copy)
        self.viewed = level < 3
        self.shards = [nn.Parameter(p.data.view(-1)[start:stop] if self.viewed else p.detach().new_empty(stop - start))
                       for p, (start, stop) in zip(self.params, self.plan.mine())]
        # level 2 on the node: each gradient's slices for the others written into the slab as backward accumulates it
        self.copied: dict[int, tuple[torch.Tensor, int]] = {}    # parameter index -> (its .grad written, version)
        self.early = self._early_places() if self.node is not None and level == 2 else []
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        if self.early:
            self._hooks = hook_arrivals(self, self.params)
        self.layered = False   # level 3 gathers unit by unit from layer hooks (``zero_layers.py``), else per action
        self.present = [True]
        self.set_units([list(range(len(self.params)))])
        self.refresh()
        if level >= 3:
            self.release()
        self.peak_bytes = self.gathered_bytes   # level 3: the most bytes of whole weights present at once

    @property
    def owner(self) -> int:
        """The rank reporting the stage (its lowest holder, as the checkpoint's gathers)."""
        return min(self.group.ranks)

    def named_shards(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's non-empty shards by their parameter's whole-model key (what the optimizer steps)."""
        return [(key, shard) for key, shard in zip(self.keys, self.shards) if shard.numel() > 0]

    def refresh(self) -> None:
        """Copy this rank's slices of the (present) parameters into the shards (levels 1-2: they are those slices)."""
        if self.viewed:
            return
        with torch.no_grad():
            for param, shard, (start, stop) in zip(self.params, self.shards, self.plan.mine()):
                shard.copy_(param.detach().reshape(-1)[start:stop])

    # ------------------------------------------------------------ gradients
    def take_gradients(self) -> None:
        """Level 1: each shard's gradient is its slice of the parameter's summed gradient (a view); holders sharing
        the weights' memory meet first (no step writes it while another holder's backward may still read it)."""
        if self.common is not None:
            self.common.meet()
        for param, shard, (start, stop) in zip(self.params, self.shards, self.plan.mine()):
            shard.grad = None if param.grad is None else param.grad.detach().reshape(-1)[start:stop]

    def reduce_gradients(self) -> int:
        """Levels 2-3: the sum over the holders by reduce-scatter into the shards' gradients, each parameter's whole
        gradient freed; the bytes this rank put in."""
        quiet = self.silent()
        grads = [p.grad.detach().reshape(-1) if p.grad is not None and id(p) not in quiet
                 else p.detach().new_zeros(p.numel()) for p in self.params]
        if self.node is not None:
            piece = self.node.reduce_scatter(self._by_member(grads, self.plan), self.counts, self._written(quiet))
        else:
            flat = torch.cat([grads[index][start:stop] for index, start, stop in self.plan.places()])
            piece = self.ctx.reduce_scatter(flat, self.counts, self.group)
        for shard, at in zip(self.shards, self.offsets):
            shard.grad = piece[at:at + shard.numel()]
        for param in self.params:
            param.grad = None
        return sum(self.counts) * piece.element_size()

    def _early_places(self) -> list[list[tuple[int, int, int]]]:
        """Per parameter, where its slices for the other holders lie in this rank's slab: (at, start, stop)."""
        starts = [0]
        for count in self.counts:
            starts.append(starts[-1] + count)
        places: list[list[tuple[int, int, int]]] = [[] for _ in self.params]
        for member in range(self.plan.members):
            at = starts[member]
            for index in range(len(self.params)):
                start, stop = self.plan.bounds(index, member)
                if member != self.plan.index and stop > start:
                    places[index].append((at, start, stop))
                at += stop - start
        return places

    def _written(self, quiet: Collection[int]) -> set[int]:
        """The parameters whose slices ``arrived`` wrote and that are still their gradient's (the claim on the slab
        held since, the same ``.grad`` unchanged, not one whose gradient this rank leaves out); claims the slab."""
        kept = self.node is not None and self.node.claim(self)
        copied, self.copied = self.copied, {}
        return {i for i, (grad, version) in copied.items() if kept and self.params[i].grad is grad
                and grad._version == version and id(self.params[i]) not in quiet}

    def arrived(self, param: torch.Tensor) -> None:
        """Backward accumulated ``param``'s gradient: its slices for the others into the slab now, while in cache
        (level 2 on the node; kept only while this stage's claim on the slab holds)."""
        index, grad = self.index_of[id(param)], param.grad
        assert self.node is not None and grad is not None
        if self.node.write_early(self, grad.detach().reshape(-1), self.early[index], sum(self.counts)):
            self.copied[index] = (grad, grad._version)

    @staticmethod
    def _by_member(flats: Sequence[torch.Tensor], plan: ShardPlan) -> list[list[torch.Tensor]]:
        """Each member's slices of the flat tensors ``flats`` (cut as ``plan``): the member-order flat, uncopied."""
        return [[flat[start:stop] for flat, (start, stop) in zip(flats, (plan.bounds(p, m) for p in range(len(flats))))]
                for m in range(plan.members)]

    def square_sum(self) -> torch.Tensor:
        """The sum of this rank's shard gradients squared (float64; each element of the stage on one holder)."""
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for shard in self.shards:
            if shard.grad is not None:
                total += shard.grad.detach().to(torch.float64).square().sum()
        return total

    # -------------------------------------------------------------- weights
    def set_units(self, units: Sequence[Sequence[int]]) -> None:
        """Level 3's gathering units: lists of parameter indices (each parameter in one), in the order of use; the
        stage's weights must all be present or all freed (they keep that state)."""
        present = all(self.present)
        if present != any(self.present):
            raise ValueError(f"stage {self.stage}: its units change while some of its weights are gathered")
        self.units = [list(unit) for unit in units]
        self.unit_plans = [ShardPlan(tuple(self.params[i].numel() for i in unit), self.group.size, self.plan.index)
                           for unit in self.units]
        self.unit_bytes = [sum(self.params[i].numel() * self.params[i].element_size() for i in unit)
                           for unit in self.units]
        self.present = [present] * len(self.units)
        self.gathered_bytes = sum(self.unit_bytes) if present else 0   # bytes of whole weights present now

    @property
    def released(self) -> bool:
        """Whether no unit's whole weights are present."""
        return not any(self.present)

    def _all_gather(self, indices: Sequence[int], plan: ShardPlan) -> None:
        """Every holder's shards of parameters ``indices`` (cut as ``plan``) copied into the whole parameters."""
        if self.node is not None:   # through .data: no version bump, as below
            flats = [self.params[i].data.view(-1) for i in indices]
            self.node.all_gather([self.shards[i].detach() for i in indices], self._by_member(flats, plan), plan.counts)
            return
        piece = torch.cat([self.shards[i].detach() for i in indices])
        whole = self.ctx.all_gather(piece, plan.counts, self.group)
        at = 0
        with torch.no_grad():   # through .data: no version bump (a forward of level 3 saved the parameter for backward)
            for index, start, stop in plan.places():
                self.params[indices[index]].data.view(-1)[start:stop].copy_(whole[at:at + stop - start])
                at += stop - start

    def publish(self) -> None:
        """All-gather every holder's shards into the whole parameters (one collective; freed memory taken back)."""
        for unit in range(len(self.units)):
            self._take_memory(unit)
        if self.common is not None:   # every holder's step wrote its slices into the memory they all map
            self.common.meet()
        else:
            self._all_gather(range(len(self.params)), self.plan)

    def _take_memory(self, unit: int) -> None:
        if not self.present[unit]:
            for i in self.units[unit]:
                self.params[i].untyped_storage().resize_(self.params[i].numel() * self.params[i].element_size())
            self.present[unit] = True
            self.gathered_bytes += self.unit_bytes[unit]
            self.peak_bytes = max(self.peak_bytes, self.gathered_bytes)

    def gather_unit(self, unit: int) -> None:
        """Level 3: unit ``unit``'s whole weights, before a use (nothing if present). Collective over the holders,
        who gather the same units in the same order."""
        if not self.present[unit]:
            self._take_memory(unit)
            self._all_gather(self.units[unit], self.unit_plans[unit])

    def release_unit(self, unit: int) -> None:
        """Level 3: free unit ``unit``'s whole weights (shapes kept; the shards stay)."""
        if self.level >= 3 and self.present[unit]:
            for i in self.units[unit]:
                self.params[i].untyped_storage().resize_(0)
            self.present[unit] = False
            self.gathered_bytes -= self.unit_bytes[unit]

    def gather(self) -> None:
        """Level 3: the whole weights, before a use (one collective when every unit is freed)."""
        if self.released:
            self.publish()
        for unit in range(len(self.units)):
            self.gather_unit(unit)

    def release(self) -> None:
        """Level 3: free the whole weights (the parameters keep their shapes; the shards stay)."""
        for unit in range(len(self.units)):
            self.release_unit(unit)

    # ------------------------------------------------------ optimizer state
    def full_optimizer_entries(self, optimizer: torch.optim.Optimizer) -> Entries:
        """Collective over the holders: each parameter's optimizer state whole, on the owner ({} elsewhere)."""
        mine: Entries = {key: {name: _portable(value) for name, value in optimizer.state[shard].items()}
                         for key, shard in self.named_shards() if optimizer.state.get(shard)}
        everyone = self.ctx.all_gather_object(mine, group=self.group)
        if self.ctx.rank != self.owner:
            return {}
        whole: Entries = {}
        for key, param in zip(self.keys, self.params):
            pieces = [part[key] for part in everyone if key in part]
            if pieces:
                whole[key] = {name: _joined(name, [piece[name] for piece in pieces], param) for name in pieces[0]}
        return whole

    def load_optimizer_entries(self, optimizer: torch.optim.Optimizer, entries: Entries) -> None:
        """Each shard's slice of its parameter's whole optimizer state in ``entries`` (absent keys left alone)."""
        for (key, shard), (start, stop) in zip(zip(self.keys, self.shards), self.plan.mine()):
            entry = entries.get(key)
            if entry is None or shard.numel() == 0:
                continue
            optimizer.state[shard] = {name: _sliced(name, value, shard, start, stop) for name, value in entry.items()}


def _node_route(ctx: Comm, group: Group, params: Sequence[nn.Parameter], level: int) -> NodeShards | None:
    """The node's window for this stage's reduce-scatter and all-gather (``comm/node_shards.py``) where it serves:
    the mpi plane, every holder on one node, CPU parameters of one summable dtype, room in the node's shared memory;
    levels 1-2 only (level 3's window would hold the whole stage, the memory it frees). None: MPI's collectives.
    Collective over ``group`` (the same answer on every holder)."""
    dtypes = {p.dtype for p in params}
    if level >= 3 or not isinstance(ctx, NodeSums) or len(dtypes) != 1 or any(p.device.type != "cpu" for p in params):
        return None
    return NodeShards.reserved(ctx.node_sum(group), dtypes.pop(), sum(p.numel() for p in params))


def _into_common(node: NodeShards, params: Sequence[nn.Parameter], plan: ShardPlan) -> bool:
    """Move ``params`` (alike on every holder) into one memory the holders on ``node`` all map, each holder
    writing its own slices; False (on every holder: the parameters are alike) where a parameter shares its memory
    with another tensor (moving it would part them) or the node has no room. Collective."""
    if not all(_alone(p) for p in params):
        return False
    views = node.common(params, plan.mine())
    if views is None:
        return False
    for param, view in zip(params, views):
        param.data = view
    return True


def _alone(param: nn.Parameter) -> bool:
    """Whether ``param`` is alone in its memory (no other tensor's elements beside its own)."""
    whole = param.numel() * param.element_size()
    return bool(param.storage_offset() == 0 and param.untyped_storage().nbytes() == whole)


def _check_shardable(key: str, param: nn.Parameter, level: int) -> None:
    """A parameter ZeRO can cut: contiguous; at level 3 alone in its memory (its storage is freed between uses)."""
    if not param.is_contiguous():
        raise ConfigError("--zero-stage", f"parameter {key} is not contiguous, so it has no flat slices to shard: "
                                          f"make it contiguous, or --zero-stage 0")
    if level >= 3 and not _alone(param):
        raise ConfigError("--zero-stage", f"parameter {key} shares its memory with other tensors, so level 3 cannot "
                                          f"free it between uses: --zero-stage 2")


def _joined(name: str, values: list[object], param: nn.Parameter) -> object:
    """One optimizer state entry whole from the holders' shards of it (a counter: the first holder's)."""
    first = values[0]
    if name == STEP or not isinstance(first, torch.Tensor) or first.dim() != 1:
        return first
    return torch.cat([v for v in values if isinstance(v, torch.Tensor)]).view(param.shape)


def _sliced(name: str, value: object, shard: torch.Tensor, start: int, stop: int) -> object:
    """This shard's slice of a whole optimizer state entry, on the shard's device and dtype (counters as saved)."""
    if not isinstance(value, torch.Tensor):
        return value
    if name == STEP:
        return value.clone()
    return value.detach().reshape(-1)[start:stop].to(shard.device, shard.dtype).clone()


class ZeroState:
    """This rank's sharded stages at ZeRO ``level`` (1-3) and what the runtime and the checkpoint ask of them."""

    def __init__(self, level: int, stages: dict[int, ShardedStage]) -> None:
        self.level = level
        self.stages = stages

    def covers(self, stage: int) -> bool:
        return stage in self.stages

    def reduces(self, stage: int) -> bool:
        """Whether ``stage``'s gradients are summed by reduce-scatter (levels 2-3) instead of the all-reduce."""
        return self.level >= 2 and stage in self.stages

    def sharded_ids(self) -> set[int]:
        """Ids of the whole parameters the shards stand for (the optimizer holds their shards instead)."""
        return {id(p) for s in self.stages.values() for p in s.params}

    def before_step(self) -> None:
        """Level 1: the shards' gradients from the summed whole ones."""
        if self.level == 1:
            for stage in self.stages.values():
                stage.take_gradients()

    def after_step(self) -> None:
        """Levels 1-2: the updated shards gathered into the whole parameters (level 3 gathers them on use)."""
        for stage in self.stages.values():
            if self.level == 1:   # the views of the whole gradients go: they would keep them alive into the next step
                for shard in stage.shards:
                    shard.grad = None
            if self.level < 3:
                stage.publish()

    def peak_gathered_bytes(self) -> int:
        """Level 3: the most bytes of whole weights any one stage had gathered at once since the last reset."""
        return max((stage.peak_bytes for stage in self.stages.values()), default=0)

    def reset_peaks(self) -> None:
        for stage in self.stages.values():
            stage.peak_bytes = stage.gathered_bytes

    def shards(self) -> list[nn.Parameter]:
        return [shard for stage in self.stages.values() for _, shard in stage.named_shards()]

    @contextmanager
    def using(self, stage: int) -> Iterator[None]:
        """Level 3: ``stage``'s whole weights present for one action, freed after (other levels: nothing); a stage
        gathered layer by layer (``zero_layers.py``) only has whatever its hooks left gathered freed after."""
        sharded = self.stages.get(stage) if self.level >= 3 else None
        if sharded is None:
            yield
            return
        if not sharded.layered:
            sharded.gather()
        try:
            yield
        finally:
            sharded.release()

    @contextmanager
    def whole_weights(self) -> Iterator[None]:
        """Every sharded stage's whole weights present (state dicts, loading), the shards refreshed from them after
        and level 3's weights freed again. Collective over each stage's holders."""
        for stage in self.stages.values():
            stage.gather()
        try:
            yield
        finally:
            for stage in self.stages.values():
                stage.refresh()
                stage.release()

    def full_optimizer_entries(self, optimizer: torch.optim.Optimizer) -> Entries:
        """Every sharded stage's whole optimizer state on its owner (collective over each stage's holders)."""
        entries: Entries = {}
        for stage in self.stages.values():
            entries.update(stage.full_optimizer_entries(optimizer))
        return entries

    def load_optimizer_entries(self, optimizer: torch.optim.Optimizer, entries: Entries) -> None:
        for stage in self.stages.values():
            stage.load_optimizer_entries(optimizer, entries)
