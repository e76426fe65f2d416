"""HybridEngine: train a layer list with any SP/LP/PP/GEMS/DP mix, exactly like one process."""

from __future__ import annotations

import copy
import sys
import traceback
from typing import Any, Callable, Iterable

import torch
from torch import nn

from .config import ParallelConfig
from .geometry import TileGrid
from .layout import RankRole, layout, stage_holders
from .messages import as_items
from .runtime import PipelineRuntime, StageInstance, StepRun
from .schedules import Action, Schedule, Stepper, build_schedule, stage_ranks
from .stages import Stage, auto_balance, split_layers
from .trace import Event, gather_timeline

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def auto_balanced_config(cfg: ParallelConfig, layers: list[nn.Module], sample: Any,
                         ctx: Any = None, by: str = "time", repeats: int = 3) -> ParallelConfig:
    """``cfg`` with ``balance`` from profiling ``layers`` on ``sample`` by 'time' or 'memory'.

    With a ``ctx`` only rank 0 profiles and broadcasts the result, so every rank agrees
    (timings differ between ranks). See ``stages.auto_balance``.
    """
    balance = None
    if ctx is None or ctx.rank == 0:
        balance = auto_balance(layers, sample, cfg.split_size, by=by, repeats=repeats)
    if ctx is not None:
        balance = ctx.bcast_object(balance, root=0)
    return cfg.with_(balance=tuple(balance))


class HybridEngine:
    """Trains ``nn.Sequential(*layers)`` on ``cfg``'s ranks; every rank calls the same methods.

    ``loss_fn(output, labels)`` must be mean-reduced over the samples (e.g.
    ``nn.CrossEntropyLoss()``); each chunk's loss is scaled by ``chunk / global batch`` so
    the summed gradients are those of the mean loss over the global batch.
    ``optimizer(params)`` returns a torch optimizer for this rank's parameters (None: no
    step; gradients stay in the parameters). ``schedule``: 'gpipe' or '1f1b' (default
    ``cfg.schedule``). ``abort_on_error``: an exception on one rank prints its traceback
    and aborts the whole MPI job instead of leaving the other ranks waiting forever.
    """

    def __init__(self, layers: list[nn.Module], cfg: ParallelConfig, ctx: Any, *,
                 loss_fn: Callable[[Any, Any], torch.Tensor],
                 optimizer: OptimizerFactory | None = None, schedule: str | None = None,
                 abort_on_error: bool = True, elementwise: Iterable[type] = ()) -> None:
        layers = list(layers)
        cfg.validate(world_size=ctx.world_size, num_layers=len(layers))
        self.cfg = cfg
        self.ctx = ctx
        self.loss_fn = loss_fn
        self.abort_on_error = abort_on_error
        self.roles: list[RankRole] = layout(cfg)
        self.role = self.roles[ctx.rank]
        self.stages: list[Stage] = split_layers(layers, cfg.split_size, cfg.balance)
        self.grid = TileGrid(*cfg.grid_shape) if cfg.spatial_size > 0 else None
        self.schedule: Schedule = build_schedule(cfg, schedule)   # pure: same error everywhere
        self.stage_groups, spatial_groups = self._make_groups()
        try:   # a rank-local failure (e.g. an unsupported spatial layer) must not hang others
            self.instances = self._make_instances(spatial_groups, tuple(elementwise))
            params = self._unique_parameters()
            self.optimizer = optimizer(params) if optimizer is not None else None
        except Exception:
            self._fail()
            raise
        self.runtime = PipelineRuntime(ctx, self.schedule, self.instances, self.stage_groups,
                                       loss_fn, self.optimizer, self.grid)
        self._step: StepRun | None = None

    # ------------------------------------------------------------------ set-up
    def _make_groups(self) -> tuple[dict[int, Any], dict[tuple[int, ...], Any]]:
        """Every group the layout needs, created on all ranks in the same order."""
        stage_groups: dict[int, Any] = {}
        for s in range(self.cfg.split_size):
            ranks = stage_holders(self.cfg, s)
            group = self.ctx.new_group(ranks) if len(ranks) > 1 else None
            if self.ctx.rank in ranks:
                stage_groups[s] = group
        spatial: dict[tuple[int, ...], Any] = {}
        for (d, r, s), ranks in sorted(stage_ranks(self.cfg, self.roles).items()):
            if s < self.cfg.spatial_size and ranks not in spatial:
                spatial[ranks] = self.ctx.new_group(ranks)
        return stage_groups, spatial

    def _make_instances(self, spatial_groups: dict[tuple[int, ...], Any],
                        elementwise: tuple[type, ...]) -> dict[tuple[int, int], StageInstance]:
        instances: dict[tuple[int, int], StageInstance] = {}
        used: set[int] = set()
        slots = [(0, self.role.primary)]
        if self.role.mirror is not None:
            slots.append((1, self.role.mirror))
        for replica, slot in slots:
            stage = self.stages[slot.stage]
            if slot.stage in used:
                stage = copy.deepcopy(stage)
            used.add(slot.stage)
            stage.to(self.ctx.device)
            module: nn.Module = stage
            if slot.spatial:
                from .spatialize import spatialize

                module = spatialize(stage, self.grid, self.ctx, spatial_groups[slot.stage_ranks],
                                    halo_d2=self.cfg.halo_d2, fused_layers=self.cfg.fused_layers,
                                    elementwise=elementwise)
            instances[(replica, slot.stage)] = StageInstance(slot.stage, replica, stage, module,
                                                             slot.tile)
        return instances

    def _unique_parameters(self) -> list[nn.Parameter]:
        seen: set[int] = set()
        params = []
        for inst in self.instances.values():
            for p in inst.canonical.parameters():
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    params.append(p)
        return params

    # ---------------------------------------------------------------- training
    def batch_size_of(self, images: Any) -> int:
        return int(as_items(images)[0].shape[0])

    def train_step(self, images: Any, labels: Any,
                   on_action: Callable[[Action], None] | None = None) -> float:
        """One optimizer step on the global batch; returns its loss on every rank.

        Every rank passes the same global ``images``/``labels``; each uses only its chunks.
        ``on_action`` is called before each of this rank's actions (step-through hooks).
        """
        self.start_step(images, labels)
        try:
            step = self._step
            while True:
                action = step.next_action
                if action is None:
                    break
                if on_action is not None:
                    on_action(action)
                next(step)
        except Exception:
            self._fail()
            raise
        return self.finish_step()

    def start_step(self, images: Any, labels: Any) -> None:
        """Begin a step without running it: ``advance()`` then runs one action at a time.

        Driving several ranks by hand, advance them in ``schedule.global_order()`` and run
        the ranks of one spatial op (same tick, stage, micro-batch; tiles) concurrently.
        """
        batch = self.batch_size_of(images)
        self.cfg.validate(batch_size=batch)
        if self.batch_size_of(labels) != batch:
            raise ValueError(f"labels hold {self.batch_size_of(labels)} samples but images "
                             f"hold {batch}; pass one label per image")
        chunk = batch // self.cfg.batch_divisor
        for inst in self.instances.values():
            inst.canonical.train()
            inst.module.train()
            inst.canonical.zero_grad(set_to_none=True)
        self._step = self.runtime.steps(images, labels, chunk, batch)

    def next_action(self) -> Action | None:
        """This rank's next action of the started step (None: all done)."""
        return self._step.next_action if self._step is not None else None

    def advance(self) -> Action | None:
        """Execute this rank's next action of the started step; returns it (None: done)."""
        if self._step is None:
            raise RuntimeError("call start_step(images, labels) first")
        try:
            return next(self._step, None)
        except Exception:
            self._fail()
            raise

    def finish_step(self) -> float:
        """Run the rest of the started step; return the global-batch loss on every rank."""
        if self._step is None:
            raise RuntimeError("call start_step(images, labels) first")
        try:
            for _ in self._step:
                pass
            total = torch.tensor([self._step.loss_sum], dtype=torch.float64,
                                 device=self.ctx.device)
            self.ctx.all_reduce(total)
        except Exception:
            self._fail()
            raise
        finally:
            self._step = None
        return float(total.item())

    def _fail(self) -> None:
        if self.abort_on_error and self.ctx.world_size > 1:
            sys.stderr.write(f"[rank {self.ctx.rank}] HybridEngine failed; aborting the job:\n"
                             f"{traceback.format_exc()}")
            sys.stderr.flush()
            self.ctx.abort(1)

    # ------------------------------------------------------------------- state
    def _owned_stages(self) -> list[StageInstance]:
        """Instances whose stage this rank reports (lowest holder rank, primary first)."""
        out = []
        for s in range(self.cfg.split_size):
            if min(stage_holders(self.cfg, s)) != self.ctx.rank:
                continue
            inst = self.instances.get((0, s)) or self.instances.get((1, s))
            out.append(inst)
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """On rank 0 the state dict of ``nn.Sequential(*layers)`` (CPU tensors); None elsewhere."""
        parts = {inst.stage: inst.canonical.full_state_dict() for inst in self._owned_stages()}
        gathered = self.ctx.gather_object(parts, root=0)
        if gathered is None:
            return None
        merged: dict[int, dict[str, torch.Tensor]] = {}
        for piece in gathered:
            merged.update(piece)
        state: dict[str, torch.Tensor] = {}
        for s in sorted(merged):
            state.update(merged[s])
        return state

    def load_full_state_dict(self, state: dict[str, torch.Tensor] | None) -> None:
        """Inverse of ``full_state_dict``: ``state`` on rank 0 is loaded into every holder."""
        state = self.ctx.bcast_object(state if self.ctx.rank == 0 else None, root=0)
        if state is None:
            raise ValueError("load_full_state_dict needs the state dict on rank 0")
        for inst in self.instances.values():
            inst.canonical.load_from_full(state)

    # ------------------------------------------------------------ inspection
    def stepper(self) -> Stepper:
        """A Stepper over all ranks' actions of one step (what the runtime executes)."""
        return self.schedule.stepper()

    def timeline(self, clear: bool = False) -> list[Event] | None:
        """Every rank's trace events as one timeline on rank 0 (collective)."""
        return gather_timeline(self.ctx, root=0, clear=clear)

    def local_modules(self) -> dict[tuple[int, int], nn.Module]:
        """(replica, stage) -> the module this rank runs for it."""
        return {key: inst.module for key, inst in self.instances.items()}
