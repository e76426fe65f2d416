"""The one seam between ZeRO and the engine, its runtime and checkpoints: ``Sharding`` answers every question they
ask of the training state, the same calls whatever the ZeRO stage (stage 0, or no stage held with another rank:
no sharded stage, and every call leaves things as they are)."""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..comm.handles import Group
from ..comm.protocol import Comm
from .layer_units import gather_layer_by_layer
from .sharded_stage import Entries, ShardedStage
from .zero_stages import ZeroStage

Named = list[tuple[str, nn.Parameter]]


class OnStage(Protocol):
    """An action of one stage (the runtime's ``Action``)."""

    @property
    def stage(self) -> int: ...


A = TypeVar("A", bound=OnStage)
S = TypeVar("S")
Run = Callable[[A, S], "int | None"]


class Sharding:
    """This rank's stages sharded at ZeRO stage ``zero`` (``stages``: stage -> its shards; empty: nothing
    sharded) and what the engine, the runtime and the checkpoint ask of them."""

    def __init__(self, zero: ZeroStage, stages: dict[int, ShardedStage]) -> None:
        self.zero_stage = zero
        self.stages = stages
        self.hooks: list[RemovableHandle] = []

    def sums_gradients(self, stage: int) -> bool:
        """Whether ``stage``'s gradients are summed here (reduce-scatter into the shards) instead of the all-reduce."""
        return self.zero_stage.shards_gradients and stage in self.stages

    def reduce_gradients(self, stage: int) -> int:
        """The sum of ``stage``'s gradients over its holders into this rank's shards; the bytes put in."""
        return self.stages[stage].reduce_gradients()

    # -------------------------------------------------------- the optimizer
    def sharded_ids(self) -> set[int]:
        """Ids of the whole parameters the shards stand for (the optimizer holds their shards instead)."""
        return {id(p) for s in self.stages.values() for p in s.params}

    def named_shards(self) -> Named:
        """This rank's shards by their parameter's whole-model key (none where nothing is sharded)."""
        return [pair for stage in self.stages.values() for pair in stage.named_shards()]

    def shards(self) -> list[nn.Parameter]:
        return [shard for _, shard in self.named_shards()]

    def stepped(self, named: Named) -> Named:
        """What the optimizer steps in place of this rank's trained parameters ``named``: the shards of sharded ones."""
        sharded = self.sharded_ids()
        return [(k, p) for k, p in named if id(p) not in sharded] + self.named_shards()

    def gradient_holders(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """The tensors a step's summed gradients end in: ``params``, or the shards where the gradients are sharded."""
        if not self.zero_stage.shards_gradients:
            return list(params)
        sharded = self.sharded_ids()
        return [p for p in params if id(p) not in sharded] + self.shards()

    def before_step(self) -> None:
        """The shards' gradients from the summed whole ones (ZeRO stage 1)."""
        if self.zero_stage.takes_whole_gradients:
            for stage in self.stages.values():
                stage.take_gradients()

    def after_step(self) -> None:
        """The updated shards into the whole parameters where those stay (stages 1-2; stage 3 gathers on use)."""
        if self.zero_stage.gathers_after_step:
            for stage in self.stages.values():
                if self.zero_stage.takes_whole_gradients:
                    stage.drop_gradients()
                stage.publish()

    def counted_gradients(self, stage: int, whole: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        """The gradients of ``stage`` this rank counts in a global norm, each element once over the world: its shards'
        where the stage is sharded, else ``whole()`` (the caller's rule for a stage held whole)."""
        if stage not in self.stages:
            return whole()
        return [p.grad for _, p in self.stages[stage].named_shards() if p.grad is not None]

    # ------------------------------------------------------------- weights
    def around(self, run: Run[A, S]) -> Run[A, S]:
        """``run`` (an action's execution) with its stage's whole weights present where they are sharded, freed
        after (a stage gathered layer by layer: whatever its hooks left gathered freed after); ``run`` itself where
        no weights are sharded."""
        if not self.zero_stage.shards_weights or not self.stages:
            return run

        def with_weights(action: A, state: S) -> int | None:
            with self.using(action.stage):
                return run(action, state)
        return with_weights

    @contextmanager
    def using(self, stage: int) -> Iterator[None]:
        """``stage``'s whole weights present for one computation where they are sharded, freed after."""
        sharded = self.stages.get(stage) if self.zero_stage.shards_weights else None
        if sharded is None:
            yield
            return
        if not sharded.layered:
            sharded.gather()
        try:
            yield
        finally:
            sharded.release()

    def gather_layer_by_layer(self, modules: dict[int, nn.Module]) -> None:
        """Hook each sharded stage's module as it runs (``modules``: stage -> module; a stage left out is gathered
        whole per action) so its weights are gathered one layer at a time (``layer_units.py``)."""
        for stage, module in sorted(modules.items()):
            if stage in self.stages:
                self.hooks += gather_layer_by_layer(self.stages[stage], module)

    @contextmanager
    def whole_weights(self) -> Iterator[None]:
        """Every sharded stage's whole weights present (state dicts, loading), the shards refreshed from them after
        and freed again where sharded. Collective over each stage's holders."""
        for stage in self.stages.values():
            stage.gather()
        try:
            yield
        finally:
            for stage in self.stages.values():
                stage.refresh()
                stage.release()

    # ------------------------------------------------------ optimizer state
    def full_optimizer_entries(self, optimizer: torch.optim.Optimizer | None) -> Entries:
        """Every sharded stage's whole optimizer state on its owner (collective over each stage's holders)."""
        entries: Entries = {}
        for stage in self.stages.values():
            if optimizer is not None:
                entries.update(stage.full_optimizer_entries(optimizer))
        return entries

    def load_optimizer_entries(self, optimizer: torch.optim.Optimizer, entries: Entries) -> None:
        for stage in self.stages.values():
            stage.load_optimizer_entries(optimizer, entries)


class HeldStage(Protocol):
    """One copy of a stage on this rank as sharding sees it (``pipeline/stage_instance.StageInstance``)."""

    def silent_parameters(self) -> set[int]: ...


def shard_stages(ctx: Comm, zero: ZeroStage, held: Sequence[tuple[int, Named, Group | None, HeldStage]],
                 trained: Collection[int]) -> Sharding:
    """``Sharding`` of this rank's ``held`` stages (stage, its named parameters, its holders' group, its copy), each
    stage once: those held with other ranks, their ``trained`` parameters (ids) sharded at ZeRO stage ``zero``
    (nothing where ``zero`` shards nothing). Collective over each stage's holders."""
    stages: dict[int, ShardedStage] = {}
    for stage, named, group, copy in held if zero.shards else ():
        params = [(key, p) for key, p in named if id(p) in trained]
        if stage not in stages and group is not None and group.size > 1 and params:
            stages[stage] = ShardedStage(ctx, stage, params, group, zero, copy.silent_parameters)
    return Sharding(zero, stages)
