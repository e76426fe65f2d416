"""HybridEngine's construction as named steps: the plan every rank works out alike, then this rank's groups, stage
copies, sharding, optimizer and runtime."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..comm.handles import Group
from ..comm.protocol import Comm
from ..config import ParallelConfig, ScheduleKind
from ..errors import ConfigError
from ..layout import RankRole, layout, stage_holders
from ..loss import joined_on_tiles
from ..sharding.seam import Sharding, shard_stages
from ..sharding.zero_stages import zero_stage
from ..spatial.geometry import TileGrid
from .actions import Action, ActionKind
from .default_cut import default_balance
from .handoff import TileJoin, handoff_of
from .layer_decay import make_optimizer
from .optimizer_step import OptimizerStep
from .precision import LossScaler, check_precision
from .runtime import LossFn, PipelineRuntime
from .schedules import Schedule, build_schedule, stage_ranks
from .split_backward import splits_backward
from .stage_draws import draws_refusal
from .stage_instance import StageInstance
from .stages import Stage, split_layers

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
Named = list[tuple[str, nn.Parameter]]


@dataclass(frozen=True)
class EnginePlan:
    """What every rank works out alike before any model work: the checked configuration, every rank's role, the
    stage cut and its stages, the tile grid, the schedule, and the refusal of random draws in training (if any)."""

    cfg: ParallelConfig
    roles: list[RankRole]
    balance: tuple[int, ...]
    stages: list[Stage]
    grid: TileGrid | None
    schedule: Schedule
    handoff: TileJoin | None
    draws_refusal: ConfigError | None

    @classmethod
    def make(cls, layers: list[nn.Module], cfg: ParallelConfig, world_size: int, schedule: ScheduleKind | str | None,
             image_size: int | tuple[int, int] | None, max_grad_norm: float | None, trains: bool) -> EnginePlan:
        """The plan of ``layers`` on ``cfg``; ConfigError (the same on every rank) for what cannot run, training
        layers that draw random numbers on two stages or replicas refused here when ``trains``."""
        cfg.validate(world_size=world_size, num_layers=len(layers))
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ConfigError("max_grad_norm", f"must be a positive number, got {max_grad_norm}")
        balance = default_balance(layers, cfg, image_size=image_size)   # cfg.balance, or the rule
        # dropout / stochastic depth on two stages or replicas: refused before any work when trained (here with an
        # optimizer, else at the first training step); evaluation never draws
        refusal = draws_refusal(layers, balance, cfg, image_size)
        if refusal is not None and trains:
            raise refusal
        grid = TileGrid.of_shape(cfg.tile_grid_shape) if cfg.spatial_size > 0 else None
        return cls(cfg, layout(cfg), balance, split_layers(layers, cfg.split_size, balance), grid,
                   build_schedule(cfg, schedule), handoff_of(layers[:sum(balance[:cfg.spatial_size])], grid),
                   refusal)

    def loss(self, loss_fn: LossFn) -> LossFn:
        """The loss the last stage computes: on the last stage's tiles where every stage is spatial (a TileLoss, or
        a classifier's on its joined head), else ``loss_fn``."""
        return joined_on_tiles(loss_fn) if self.cfg.all_spatial else loss_fn

    def firsts(self, rank: int) -> list[Action]:
        """``rank``'s forwards of stage 0."""
        return [a for a in self.schedule.actions(rank) if a.kind is ActionKind.FORWARD and a.stage == 0]


class HeldStages:
    """This rank's part of a plan: the process groups (made on every rank in the same order), its copies of the
    stages it holds (on its device, spatialized where spatial), every other stage's layers released to ``meta``."""

    def __init__(self, plan: EnginePlan, ctx: Comm, elementwise: Iterable[type]) -> None:
        self.plan, self.ctx, self.cfg = plan, ctx, plan.cfg
        self.stage_groups, self.spatial_groups = self._groups()
        self.sync_groups = self._sync_groups()
        self.instances = self._instances(tuple(elementwise))
        check_precision(self.cfg.precision, ctx.device,
                        next((p.dtype for i in self.instances.values() for p in i.canonical.parameters()
                              if p.is_floating_point()), None))
        self.released = release_other_stages(plan.stages, {stage for _, stage in self.instances}, ctx.rank)

    def _groups(self) -> tuple[dict[int, Group | None], dict[tuple[int, ...], Group]]:
        """Every group the layout needs: each stage's holders (this rank's stages kept), each spatial stage's tiles."""
        stage_groups: dict[int, Group | None] = {}
        for s in range(self.cfg.split_size):
            ranks = stage_holders(self.cfg, s)
            group = self.ctx.new_group(ranks) if len(ranks) > 1 else None
            if self.ctx.rank in ranks:
                stage_groups[s] = group
        spatial: dict[tuple[int, ...], Group] = {}
        for (_d, _r, s), tiles in sorted(stage_ranks(self.cfg, self.plan.roles).items()):
            if s < self.cfg.spatial_size and tiles not in spatial:
                spatial[tiles] = self.ctx.new_group(tiles)
        return stage_groups, spatial

    def _sync_groups(self) -> dict[tuple[int, int], tuple[Group, int]]:
        """sync_batchnorm: per (GEMS direction, stage) this rank holds, the group of every copy's ranks running it
        together, and how many equal batches they hold."""
        groups: dict[tuple[int, int], tuple[Group, int]] = {}
        if not self.cfg.sync_batchnorm:
            return groups
        holders = stage_ranks(self.cfg, self.plan.roles)
        for r in ((0, 1) if self.cfg.gems else (0,)):
            for s in range(self.cfg.split_size):
                ranks = sorted({rank for d in range(self.cfg.data_parallel) for rank in holders[(d, r, s)]})
                copies = self.cfg.data_parallel * (1 if s < self.cfg.spatial_size else self.cfg.local_dp)
                if copies > 1:
                    group = self.ctx.new_group(ranks)
                    if self.ctx.rank in ranks:
                        groups[(r, s)] = (group, copies)
        return groups

    def _instances(self, elementwise: tuple[type, ...]) -> dict[tuple[int, int], StageInstance]:
        instances: dict[tuple[int, int], StageInstance] = {}
        used: set[int] = set()
        for replica, slot in self.plan.roles[self.ctx.rank].slots():
            stage = self.plan.stages[slot.stage]
            if slot.stage in used:
                stage = copy.deepcopy(stage)
            used.add(slot.stage)
            stage.to(self.ctx.device)
            tiles = self.spatial_groups[slot.stage_ranks] if slot.spatial else None
            module = self._running_module(stage, tiles, self.sync_groups.get((replica, slot.stage)), elementwise)
            instances[(replica, slot.stage)] = StageInstance(slot.stage, replica, stage, module, slot.tile, tiles)
        return instances

    def _running_module(self, stage: Stage, tiles: Group | None, sync: tuple[Group, int] | None,
                        elementwise: tuple[type, ...]) -> nn.Module:
        """What runs ``stage``: spatialized over ``tiles`` (its BatchNorm over every replica's tiles with ``sync``),
        or its BatchNorm synchronised over the copies, then recomputed in segments where asked."""
        module: nn.Module = stage
        spatial_runtime = None
        if tiles is not None:
            from ..spatial.convert import runtime_of, spatialize

            assert self.plan.grid is not None   # a spatial slot exists only with spatial_size > 0
            module = spatialize(stage, self.plan.grid, self.ctx, tiles, halo_d2=self.cfg.halo_d2,
                                fused_layers=self.cfg.fused_layers, elementwise=elementwise,
                                check_ops=self.cfg.check_ops)
            spatial_runtime = runtime_of(module)
            if sync is not None:
                spatial_runtime.stats_group, spatial_runtime.stats_copies = sync
        elif sync is not None:
            from .syncbn import synchronize_batchnorm

            module = synchronize_batchnorm(stage, self.ctx, *sync)
        if self.cfg.checkpoint_activations is not None:
            from .recompute import checkpointed

            module = checkpointed(module, self.cfg.checkpoint_activations, spatial_runtime)
        return module

    def trained(self) -> Named:
        """This rank's trained parameters, each once, with its whole-model key."""
        seen: set[int] = set()
        params = []
        for inst in self.instances.values():
            for name, p in inst.canonical.named_parameters():
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    params.append((inst.canonical.full_key(name), p))
        return params

    def sharding(self, trains: bool) -> Sharding:
        """ZeRO's seam over the stages this rank holds with others (``cfg.zero_stage``; nothing sharded without an
        optimizer), ZeRO stage 3's stages hooked to gather layer by layer where their backward is not split."""
        trained = {id(p) for _, p in self.trained()} if trains else set()
        held = [(stage, [(inst.canonical.full_key(name), p) for name, p in inst.canonical.named_parameters()],
                 self.stage_groups.get(stage), inst) for (_, stage), inst in sorted(self.instances.items())]
        sharding = shard_stages(self.ctx, zero_stage(self.cfg.zero_stage), held, trained)
        sharding.gather_layer_by_layer({stage: inst.module for (_, stage), inst in sorted(self.instances.items())
                                        if not splits_backward(self.cfg, stage)})
        return sharding

    def runtime(self, loss_fn: LossFn, sharding: Sharding, optimizer: torch.optim.Optimizer | None,
                max_grad_norm: float | None) -> PipelineRuntime:
        """The runtime of this rank's actions, with the optimizer's step (loss scaling under fp16, clipping)."""
        scaler = LossScaler() if self.cfg.precision == "fp16" else None
        step = OptimizerStep(self.ctx, optimizer, sharding, scaler, max_grad_norm,
                             sorted({s for _, s in self.instances}), self._whole_gradients)
        return PipelineRuntime(self.ctx, self.plan.schedule, self.instances, self.stage_groups, loss_fn,
                               self.plan.grid, self.plan.handoff, sharding=sharding, optimizer_step=step)

    def _whole_gradients(self, stage: int) -> list[torch.Tensor]:
        """The gradients this rank counts in the global norm of ``stage`` held whole: on its lowest holder, all."""
        if self.ctx.rank != min(stage_holders(self.cfg, stage)):
            return []
        canonical = next(inst.canonical for (_, s), inst in sorted(self.instances.items()) if s == stage)
        return [p.grad for p in canonical.parameters() if p.requires_grad and p.grad is not None]


def stepped_optimizer(factory: OptimizerFactory | None, named: Named) -> torch.optim.Optimizer | None:
    """The optimizer ``factory`` builds over ``named`` (by name where it takes names); None without a factory or
    with nothing to train."""
    return make_optimizer(factory, named) if factory is not None and named else None


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def release_other_stages(stages: Sequence[Stage], held: set[int], rank: int) -> list[int]:
    """Move the layers of stages this rank does not hold (``held``) to ``meta``; return those stages."""
    kept = {id(t) for s in held for _, t in _named_tensors(stages[s])}
    released = [s for s in range(len(stages)) if s not in held]
    for s in released:
        stage = stages[s]
        shared = [name for name, t in _named_tensors(stage) if id(t) in kept]
        if shared:
            raise ValueError(f"layer {stage.full_key(shared[0])} of stage {s} shares a tensor "
                             f"with a layer of stage(s) {sorted(held)}; stages must not share "
                             f"parameters (tie weights within one stage via balance)")
    for s in released:
        stage = stages[s]
        stage.to("meta")
        for position, layer in enumerate(stage):
            layer.register_forward_pre_hook(_released_hook(stage.offset + position, s, rank))
    return released


def _released_hook(layer: int, stage: int, rank: int) -> Callable[..., None]:
    """A forward pre-hook refusing to run a layer whose weights the engine released."""
    def refuse(module: nn.Module, inputs: tuple[object, ...]) -> None:
        raise RuntimeError(f"layer {layer} (stage {stage}) was released on rank {rank} by "
                           f"HybridEngine, which owns the layers passed to it: its parameters "
                           f"are on the meta device. Use engine.full_state_dict() (rank 0) to "
                           f"get the trained model and load it into a fresh copy")
    return refuse
