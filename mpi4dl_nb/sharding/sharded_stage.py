"""One stage's trainable parameters sharded over the ranks holding it, at one ZeRO stage (docs/sharding.md).

Each trainable parameter is flattened and cut over the stage's holders (``plan.py``); this rank keeps its slice as a
parameter of its own (a *shard*: a view of the whole parameter's slice where the whole weights stay, memory of its
own at ZeRO stage 3), which the optimizer steps, so parameter groups, weight decay and layer-decay scales stay those
of the whole parameter, element by element. The holders exchange pieces through one transport (``transports.py``).
Where the weights are sharded, a parameter keeps no memory between uses (its storage resized to 0): gathered unit by
unit (``layer_units.py``), or the whole stage around each action.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch
from torch import nn

from ..comm.handles import Group
from ..comm.protocol import Comm
from ..errors import ConfigError
from .plan import ShardPlan
from .transports import alone, choose_transport
from .zero_stages import ZeroStage, zero_stage

Entries = dict[str, dict[str, object]]   # whole-model parameter key -> its optimizer state (name -> value)
STEP = "step"                             # the optimizer state entry that is a counter, not one value per element


class ShardedStage:
    """One stage's trainable parameters (``named``: whole-model key, parameter) sharded over ``group`` (every rank
    holding the stage) at ZeRO stage ``zero`` (a number or its record); ``silent()``: ids of parameters whose
    gradient this rank does not add (``pipeline/dataparallel.py``'s rule for a spatial stage's tiles)."""

    def __init__(self, ctx: Comm, stage: int, named: Sequence[tuple[str, nn.Parameter]], group: Group,
                 zero: ZeroStage | int, silent: Callable[[], Collection[int]]) -> None:
        self.zero_stage = zero if isinstance(zero, ZeroStage) else zero_stage(zero)
        self.ctx, self.stage, self.group, self.silent = ctx, stage, group, silent
        self.keys = [key for key, _ in named]
        self.params = [param for _, param in named]
        for key, param in named:
            _check_shardable(key, param, self.zero_stage)
        self.plan = ShardPlan(tuple(p.numel() for p in self.params), group.size, group.rank_of(ctx.rank))
        self.counts = self.plan.counts
        self.offsets = self.plan.piece_offsets()
        self.transport = choose_transport(ctx, group, self.params, self.plan, self.zero_stage)
        viewed = not self.zero_stage.shards_weights    # the whole weights stay: a shard is their slice (no copy)
        self.shards = [nn.Parameter(p.data.view(-1)[start:stop] if viewed else p.detach().new_empty(stop - start))
                       for p, (start, stop) in zip(self.params, self.plan.mine())]
        self.layered = False   # weights gathered unit by unit from layer hooks (``layer_units.py``), else per action
        self.present = [True]
        self.set_units([list(range(len(self.params)))])
        self.refresh()
        self.release()
        self.peak_bytes = self.gathered_bytes   # the most bytes of whole weights present at once

    @property
    def owner(self) -> int:
        """The rank reporting the stage (its lowest holder, as the checkpoint's gathers)."""
        return min(self.group.ranks)

    @property
    def common(self) -> object | None:
        """The transport where the holders' whole weights live in one memory they all map, else None."""
        return self.transport if self.transport.common else None

    def named_shards(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's non-empty shards by their parameter's whole-model key (what the optimizer steps)."""
        return [(key, shard) for key, shard in zip(self.keys, self.shards) if shard.numel() > 0]

    def refresh(self) -> None:
        """Copy this rank's slices of the (present) parameters into the shards (where the whole weights stay, the
        shards are those slices: nothing to copy)."""
        if not self.zero_stage.shards_weights:
            return
        with torch.no_grad():
            for param, shard, (start, stop) in zip(self.params, self.shards, self.plan.mine()):
                shard.copy_(param.detach().reshape(-1)[start:stop])

    # ------------------------------------------------------------ gradients
    def take_gradients(self) -> None:
        """ZeRO stage 1: each shard's gradient is its slice of the parameter's summed gradient (a view); holders
        sharing the weights' memory meet first (no step writes it while another holder's backward may still read
        it)."""
        self.transport.meet()
        for param, shard, (start, stop) in zip(self.params, self.shards, self.plan.mine()):
            shard.grad = None if param.grad is None else param.grad.detach().reshape(-1)[start:stop]

    def drop_gradients(self) -> None:
        """After the step at stage 1: the shards' views of the whole gradients go (they would keep them alive)."""
        for shard in self.shards:
            shard.grad = None

    def reduce_gradients(self) -> int:
        """Stages 2-3: the sum over the holders by reduce-scatter into the shards' gradients, each parameter's whole
        gradient freed; the bytes this rank put in."""
        quiet = self.silent()
        grads = [p.grad.detach().reshape(-1) if p.grad is not None and id(p) not in quiet
                 else p.detach().new_zeros(p.numel()) for p in self.params]
        piece = self.transport.reduce_scatter(grads, self.plan)
        for shard, at in zip(self.shards, self.offsets):
            shard.grad = piece[at:at + shard.numel()]
        for param in self.params:
            param.grad = None
        return sum(self.counts) * piece.element_size()

    # -------------------------------------------------------------- weights
    def set_units(self, units: Sequence[Sequence[int]]) -> None:
        """The gathering units (stage 3): lists of parameter indices (each parameter in one), in the order of use;
        the stage's weights must all be present or all freed (they keep that state)."""
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
        """Every holder's shards of parameters ``indices`` (cut as ``plan``) copied into the whole parameters (through
        ``.data``: no version bump, a forward at stage 3 saved the parameter for backward)."""
        self.transport.all_gather([self.shards[i] for i in indices], [self.params[i].data.view(-1) for i in indices],
                                  plan)

    def publish(self) -> None:
        """Every holder's shards into the whole parameters (freed memory taken back); where the holders map one
        memory, every holder's step wrote its slices there already: a meeting."""
        for unit in range(len(self.units)):
            self._take_memory(unit)
        if self.transport.common:
            self.transport.meet()
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
        """Unit ``unit``'s whole weights, before a use (nothing if present). Collective over the holders, who gather
        the same units in the same order."""
        if not self.present[unit]:
            self._take_memory(unit)
            self._all_gather(self.units[unit], self.unit_plans[unit])

    def release_unit(self, unit: int) -> None:
        """Free unit ``unit``'s whole weights where the weights are sharded (shapes kept; the shards stay)."""
        if self.zero_stage.shards_weights and self.present[unit]:
            for i in self.units[unit]:
                self.params[i].untyped_storage().resize_(0)
            self.present[unit] = False
            self.gathered_bytes -= self.unit_bytes[unit]

    def gather(self) -> None:
        """The whole weights, before a use (one collective when every unit is freed)."""
        if self.released:
            self.publish()
        for unit in range(len(self.units)):
            self.gather_unit(unit)

    def release(self) -> None:
        """Free the whole weights where they are sharded (the parameters keep their shapes; the shards stay)."""
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


def _portable(value: object) -> object:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _check_shardable(key: str, param: nn.Parameter, zero: ZeroStage) -> None:
    """A parameter ZeRO can cut: contiguous; where the weights are sharded, alone in its memory (its storage is
    freed between uses)."""
    if not param.is_contiguous():
        raise ConfigError("--zero-stage", f"parameter {key} is not contiguous, so it has no flat slices to shard: "
                                          f"make it contiguous, or --zero-stage 0")
    if zero.shards_weights and not alone(param):
        raise ConfigError("--zero-stage", f"parameter {key} shares its memory with other tensors, so stage "
                                          f"{zero.number} cannot free it between uses: --zero-stage 2")


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
