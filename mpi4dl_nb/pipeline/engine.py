"""HybridEngine: train a layer list with any SP/LP/PP/GEMS/DP mix, exactly like one process."""

from __future__ import annotations

import copy
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TypeVar

import torch
from torch import nn

from ..comm.allocator import RELEASE_EVERY_STEPS, HeapRelease
from ..comm.handles import Group
from ..comm.messages import Payload
from ..comm.protocol import Comm
from ..comm.timeline import gather_timeline
from ..comm.trace import Event
from ..config import ParallelConfig, ScheduleKind
from ..errors import ConfigError
from ..layout import RankRole, layout, stage_holders
from ..loss import joined_on_tiles
from ..spatial.geometry import TileGrid
from .accumulate import GradientSum
from .default_cut import auto_balance, default_balance
from .handoff import handoff_of
from .layer_decay import make_optimizer
from .precision import check_precision
from .runtime import LossFn, PipelineRuntime, StageInstance, StageOutput, StepRun
from .schedules import Action, ActionKind, Schedule, Stepper, build_schedule, stage_ranks
from .stage_draws import draws_refusal
from .stages import Stage, split_layers
from .step_input import Images, Labels, StepInput, resolve_batch_size, resolve_image_size
from .zero import ShardedStage, ZeroState

T = TypeVar("T")   # a value of a whole-model key (a tensor, an optimizer state entry)
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def auto_balanced_config(cfg: ParallelConfig, layers: list[nn.Module], sample: Payload,
                         ctx: Comm | None = None, by: str = "time", repeats: int = 3) -> ParallelConfig:
    """``cfg`` with ``balance`` from profiling ``layers`` on ``sample`` by 'time' or 'memory'.

    With a ``ctx`` only rank 0 profiles and broadcasts the result, so every rank agrees
    (timings differ between ranks). See ``default_cut.auto_balance``.
    """
    balance: tuple[int, ...] | None = None
    if ctx is None or ctx.rank == 0:
        balance = auto_balance(layers, sample, cfg.split_size, by=by, repeats=repeats)
    if ctx is not None:
        balance = ctx.bcast_object(balance, root=0)
    assert balance is not None
    return cfg.with_(balance=tuple(balance))


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False)]


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [t for _, t in _named_tensors(module)]


def _released_hook(layer: int, stage: int, rank: int) -> Callable[..., None]:
    """A forward pre-hook refusing to run a layer whose weights the engine released."""
    def refuse(module: nn.Module, inputs: tuple[object, ...]) -> None:
        raise RuntimeError(f"layer {layer} (stage {stage}) was released on rank {rank} by "
                           f"HybridEngine, which owns the layers passed to it: its parameters "
                           f"are on the meta device. Use engine.full_state_dict() (rank 0) to "
                           f"get the trained model and load it into a fresh copy")
    return refuse


class HybridEngine:
    """Trains ``nn.Sequential(*layers)`` on ``cfg``'s ranks; every rank calls the same methods.

    The engine takes ownership of ``layers`` (no copy): each rank trains the layer objects
    of the stages it holds in place (on ``ctx.device``) and moves every other layer's
    parameters and buffers to the ``meta`` device, which frees their memory; calling such a
    released layer raises a RuntimeError. Use ``full_state_dict()`` to get the whole model
    (on rank 0) and ``held_parameter_bytes()`` for what this rank keeps.

    ``loss_fn(output, labels)`` must be mean-reduced over the samples (e.g.
    ``nn.CrossEntropyLoss()``); each chunk's loss is scaled by ``chunk / global batch`` so
    the summed gradients are those of the mean loss over the global batch. With every stage
    spatial (``cfg.all_spatial``) the loss runs on the last stage's tiles: a ``TileLoss``
    (``loss.DenseLoss``: labels are per-pixel masks), or a classifier's loss on the joined logits every
    tile holds after its head's global pool (``loss.JoinedLoss``; refused at the first forward when the
    output there is still tiles).
    ``optimizer(params)`` returns a torch optimizer for this rank's parameters (None: no
    step; gradients stay in the parameters; none either when every parameter is frozen); a
    factory with ``by_name`` gets them with their whole-model keys (``ScaledOptimizer``).
    ``schedule``: 'gpipe' or '1f1b' (default ``cfg.schedule``). ``abort_on_error``: an
    exception on one rank prints its traceback and aborts the whole MPI job instead of leaving
    the other ranks waiting forever.
    ``image_size`` (int or (height, width)): the images' size, so that the default stage cut
    keeps every layer whose halo is wider than a tile off the spatial stages (None: not checked).
    ``release_heap_every``: every that many steps the rank hands its heap's free pages back to the
    kernel, so a long run's RSS stays flat (``comm.allocator.HeapRelease``; None or 0: never).
    ``cfg.zero_stage`` 1-3 shards the optimizer state (1), the gradients (2) and the weights (3) over each group of
    ranks holding the same stage (``pipeline/zero.py``; docs/sharding.md); ``max_grad_norm``: clip the gradient to
    this global norm before each optimizer step (None: never), as ``torch.nn.utils.clip_grad_norm_``.
    Training layers that draw random numbers (dropout, stochastic depth) on two stages or on replicas is refused
    (``stage_draws.draws_refusal``): here with an ``optimizer``, else at the first training step.
    """

    def __init__(self, layers: list[nn.Module], cfg: ParallelConfig, ctx: Comm, *,
                 loss_fn: LossFn,
                 optimizer: OptimizerFactory | None = None, schedule: ScheduleKind | str | None = None,
                 abort_on_error: bool = True, elementwise: Iterable[type] = (),
                 image_size: int | tuple[int, int] | None = None,
                 release_heap_every: int | None = RELEASE_EVERY_STEPS, max_grad_norm: float | None = None) -> None:
        layers = list(layers)
        self.heap = HeapRelease(every=release_heap_every)   # free heap pages back to the kernel now and then
        cfg.validate(world_size=ctx.world_size, num_layers=len(layers))
        if cfg.all_spatial:   # the loss on the last stage's tiles: a TileLoss, or a classifier's on its joined head
            loss_fn = joined_on_tiles(loss_fn)
        if cfg.zero_stage and cfg.gems:
            raise ConfigError("--zero-stage", "shards a stage over the ranks holding it, and GEMS (--times) holds two "
                                              "copies of a stage on one rank: --zero-stage 0 with --times, or drop "
                                              "--times")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ConfigError("max_grad_norm", f"must be a positive number, got {max_grad_norm}")
        self.cfg = cfg
        self.ctx = ctx
        self.loss_fn = loss_fn
        self.abort_on_error = abort_on_error
        self.roles: list[RankRole] = layout(cfg)
        self.role = self.roles[ctx.rank]
        self.balance = default_balance(layers, cfg, image_size=image_size)   # cfg.balance, or the rule
        self.stages: list[Stage] = split_layers(layers, cfg.split_size, self.balance)
        # dropout / stochastic depth on two stages or replicas: refused on every rank alike before any work when
        # trained (here with an optimizer, else at the first training step); evaluation never draws
        self._draws_refusal = draws_refusal(layers, self.balance, cfg, image_size)
        if self._draws_refusal is not None and optimizer is not None:
            raise self._draws_refusal
        self.grid = TileGrid.of_shape(cfg.tile_grid_shape) if cfg.spatial_size > 0 else None
        self.schedule: Schedule = build_schedule(cfg, schedule)   # pure: same error everywhere
        self._firsts = [a for a in self.schedule.actions(ctx.rank)   # this rank's forwards of stage 0
                        if a.kind is ActionKind.FORWARD and a.stage == 0]
        self.stage_groups, spatial_groups = self._make_groups()
        self.sync_groups = self._make_sync_groups()
        try:   # a rank-local failure (e.g. an unsupported spatial layer) must not hang others
            self.instances = self._make_instances(spatial_groups, tuple(elementwise))
            check_precision(cfg.precision, ctx.device,
                            next((p.dtype for i in self.instances.values() for p in i.canonical.parameters()
                                  if p.is_floating_point()), None))
            self.released_stages = self._release_other_stages()
            named = self._unique_named_parameters()     # by name: --layer-decay's groups (layer_decay.py)
            self.zero = self._make_zero(named) if cfg.zero_stage and optimizer is not None and named else None
            if self.zero is not None:   # the optimizer steps the shards in place of the parameters they cut
                sharded = self.zero.sharded_ids()
                named = [(k, p) for k, p in named if id(p) not in sharded] + self.named_shards()
            self.optimizer = make_optimizer(optimizer, named) if optimizer is not None and named else None
        except Exception:
            self._fail()
            raise
        self.runtime = PipelineRuntime(ctx, self.schedule, self.instances, self.stage_groups, loss_fn, self.optimizer,
                                       self.grid, handoff_of(layers[:sum(self.balance[:cfg.spatial_size])], self.grid),
                                       zero=self.zero, max_grad_norm=max_grad_norm)
        self._step: StepRun | None = None

    # ------------------------------------------------------------------ set-up
    def _make_groups(self) -> tuple[dict[int, Group | None], dict[tuple[int, ...], Group]]:
        """Every group the layout needs, created on all ranks in the same order."""
        stage_groups: dict[int, Group | None] = {}
        for s in range(self.cfg.split_size):
            ranks = stage_holders(self.cfg, s)
            group = self.ctx.new_group(ranks) if len(ranks) > 1 else None
            if self.ctx.rank in ranks:
                stage_groups[s] = group
        spatial: dict[tuple[int, ...], Group] = {}
        for (_d, _r, s), tiles in sorted(stage_ranks(self.cfg, self.roles).items()):
            if s < self.cfg.spatial_size and tiles not in spatial:
                spatial[tiles] = self.ctx.new_group(tiles)
        return stage_groups, spatial

    def _make_sync_groups(self) -> dict[tuple[int, int], tuple[Group, int]]:
        """sync_batchnorm: per (GEMS direction, stage) this rank holds, the group of every
        copy's ranks running it together, and how many equal batches they hold."""
        groups: dict[tuple[int, int], tuple[Group, int]] = {}
        if not self.cfg.sync_batchnorm:
            return groups
        holders = stage_ranks(self.cfg, self.roles)
        for r in ((0, 1) if self.cfg.gems else (0,)):
            for s in range(self.cfg.split_size):
                ranks = sorted({rank for d in range(self.cfg.data_parallel) for rank in holders[(d, r, s)]})
                spatial = s < self.cfg.spatial_size
                copies = self.cfg.data_parallel * (1 if spatial else self.cfg.local_dp)
                if copies > 1:
                    group = self.ctx.new_group(ranks)
                    if self.ctx.rank in ranks:
                        groups[(r, s)] = (group, copies)
        return groups

    def _make_instances(self, spatial_groups: dict[tuple[int, ...], Group],
                        elementwise: tuple[type, ...]) -> dict[tuple[int, int], StageInstance]:
        instances: dict[tuple[int, int], StageInstance] = {}
        used: set[int] = set()
        for replica, slot in self.role.slots():
            stage = self.stages[slot.stage]
            if slot.stage in used:
                stage = copy.deepcopy(stage)
            used.add(slot.stage)
            stage.to(self.ctx.device)
            module: nn.Module = stage
            spatial_runtime = None
            sync = self.sync_groups.get((replica, slot.stage))
            if slot.spatial:
                from ..spatial.convert import runtime_of, spatialize

                assert self.grid is not None   # a spatial slot exists only with spatial_size > 0
                module = spatialize(stage, self.grid, self.ctx, spatial_groups[slot.stage_ranks],
                                    halo_d2=self.cfg.halo_d2, fused_layers=self.cfg.fused_layers,
                                    elementwise=elementwise, check_ops=self.cfg.check_ops)
                spatial_runtime = runtime_of(module)
                if sync is not None:   # BatchNorm over every replica's tiles
                    runtime_of(module).stats_group, runtime_of(module).stats_copies = sync
            elif sync is not None:
                from .syncbn import synchronize_batchnorm

                module = synchronize_batchnorm(stage, self.ctx, *sync)
            if self.cfg.checkpoint_activations is not None:
                from .recompute import checkpointed

                module = checkpointed(module, self.cfg.checkpoint_activations, spatial_runtime)
            instances[(replica, slot.stage)] = StageInstance(
                slot.stage, replica, stage, module, slot.tile,
                spatial_groups[slot.stage_ranks] if slot.spatial else None)
        return instances

    def _make_zero(self, named: Sequence[tuple[str, nn.Parameter]]) -> ZeroState:
        """ZeRO's shards of every stage this rank shares with other holders (``cfg.zero_stage``)."""
        trained = {id(p) for _, p in named}
        stages: dict[int, ShardedStage] = {}
        for (_, stage), inst in sorted(self.instances.items()):
            group = self.stage_groups.get(stage)
            params = [(inst.canonical.full_key(name), p) for name, p in inst.canonical.named_parameters()
                      if id(p) in trained]
            if group is not None and group.size > 1 and params:
                stages[stage] = ShardedStage(self.ctx, stage, params, group, self.cfg.zero_stage,
                                             inst.silent_parameters)
        return ZeroState(self.cfg.zero_stage, stages)

    def _whole_weights(self) -> AbstractContextManager[None]:
        """ZeRO level 3: every held stage's whole weights for a while (collective over each stage's holders)."""
        return self.zero.whole_weights() if self.zero is not None else nullcontext()

    def trained_tensors(self) -> list[torch.Tensor]:
        """The parameters this rank keeps between steps, each once: its stages' (with ZeRO level 3 holding no memory
        between uses) and ZeRO's shards; their gradients and the optimizer's state are theirs."""
        seen = {id(p): p for inst in self.instances.values() for p in inst.canonical.parameters()}
        return [*seen.values(), *(self.zero.shards() if self.zero is not None else [])]

    def named_shards(self) -> list[tuple[str, nn.Parameter]]:
        """ZeRO's shards this rank steps, by their parameter's whole-model key (none at level 0)."""
        return [] if self.zero is None else [pair for s in self.zero.stages.values() for pair in s.named_shards()]

    def held_stages(self) -> list[int]:
        """Stages this rank holds (primary and GEMS mirror slots), ascending."""
        return sorted({stage for _, stage in self.instances})

    def _release_other_stages(self) -> list[int]:
        """Move the layers of stages this rank does not hold to ``meta``; return those stages."""
        held = set(self.held_stages())
        kept = {id(t) for s in held for t in _tensors(self.stages[s])}
        released = [s for s in range(len(self.stages)) if s not in held]
        for s in released:
            stage = self.stages[s]
            shared = [name for name, t in _named_tensors(stage) if id(t) in kept]
            if shared:
                raise ValueError(f"layer {stage.full_key(shared[0])} of stage {s} shares a tensor "
                                 f"with a layer of stage(s) {sorted(held)}; stages must not share "
                                 f"parameters (tie weights within one stage via balance)")
        for s in released:
            stage = self.stages[s]
            stage.to("meta")
            for position, layer in enumerate(stage):
                layer.register_forward_pre_hook(_released_hook(stage.offset + position, s,
                                                               self.ctx.rank))
        return released

    def held_parameter_bytes(self, include_buffers: bool = False) -> int:
        """Bytes of the parameters (and buffers) this rank keeps, each tensor counted once.

        Counts every stage copy this rank holds (a GEMS mirror copy of the same stage too);
        released layers (on ``meta``) hold no memory and are not counted.
        """
        seen: dict[int, int] = {}
        for inst in self.instances.values():
            tensors: list[torch.Tensor] = list(inst.canonical.parameters())
            if include_buffers:
                tensors += list(inst.canonical.buffers())
            for t in tensors:
                if t.device.type != "meta":
                    seen[id(t)] = t.numel() * t.element_size()
        return sum(seen.values())

    def _unique_parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self._unique_named_parameters()]

    def _unique_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's trained parameters, each once, with its whole-model key."""
        seen: set[int] = set()
        params = []
        for inst in self.instances.values():
            for name, p in inst.canonical.named_parameters():
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    params.append((inst.canonical.full_key(name), p))
        return params

    # ---------------------------------------------------------------- training
    def train_step(self, images: Images, labels: Labels,
                   on_action: Callable[[Action], None] | None = None, *,
                   batch_size: int | None = None,
                   image_size: int | tuple[int, int] | None = None) -> float:
        """One optimizer step on the global batch; returns its loss on every rank.

        ``images``: the global batch (every rank the same; each uses only its chunks), or a
        callable ``images(sample_slice, box)`` giving rows ``sample_slice`` of the global
        batch cut to this rank's tile ``box`` (None: whole images), or None on ranks not
        running stage 0. ``labels``: the global labels, a callable ``labels(sample_slice)``,
        or None on ranks not running the last stage. ``batch_size`` (global) is needed when
        neither argument tells it; ``image_size`` when a spatial stage-0 rank gets a
        callable (a ``step_input.ShardedImages`` carries both). See ``step_input``.
        ``on_action`` is called before each of this rank's actions (step-through hooks).
        """
        self.start_step(images, labels, batch_size=batch_size, image_size=image_size)
        try:
            step = self._started()
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

    def train_accumulated(self, batches: Sequence[tuple[Images, Labels]],
                          on_action: Callable[[Action], None] | None = None, *, batch_size: int | None = None,
                          image_size: int | tuple[int, int] | None = None) -> float:
        """One optimizer step over ``len(batches)`` micro-steps (gradient accumulation); their mean loss.

        Each ``(images, labels)`` pair is a step's global batch as ``train_step`` takes it, run as one whole
        schedule without the optimizer (BatchNorm in training mode normalises each micro-step's batch by its
        own statistics and updates the running statistics once per micro-step, as ``serial_reference`` with
        ``accumulate`` does); the optimizer then steps once on the mean of their gradients: with equal
        micro-batches, the gradient of the mean loss over all of them. A micro-step whose update the
        non-finite guard dropped (every gradient gone, on every rank) ends the step there without an update.
        """
        if len(batches) == 1:
            ((images, labels),) = batches
            return self.train_step(images, labels, on_action, batch_size=batch_size, image_size=image_size)
        optimizer, self.runtime.optimizer = self.runtime.optimizer, None
        sums = GradientSum(self._gradient_holders())
        losses = []
        try:
            for images, labels in batches:
                losses.append(self.train_step(images, labels, on_action, batch_size=batch_size,
                                              image_size=image_size))
                if not self._agreed(sums.add()):
                    sums.drop()
                    return sum(losses) / len(losses)
        finally:
            self.runtime.optimizer = optimizer
        sums.apply()
        self.runtime.step_optimizer()
        return sum(losses) / len(losses)

    def _gradient_holders(self) -> list[nn.Parameter]:
        """The tensors a step's summed gradients end in: the parameters, or ZeRO's shards where levels 2-3 sum the
        gradients into them."""
        params = self._unique_parameters()
        if self.zero is None or self.zero.level < 2:
            return params
        sharded = self.zero.sharded_ids()
        return [p for p in params if id(p) not in sharded] + self.zero.shards()

    def _agreed(self, kept: bool) -> bool:
        """Whether every rank kept its micro-step's gradients (one small all-reduce)."""
        dropped = torch.tensor([0.0 if kept else 1.0], dtype=torch.float64, device=self.ctx.device)
        return float(self.ctx.all_reduce(dropped).item()) == 0.0

    def start_step(self, images: Images, labels: Labels, *, batch_size: int | None = None,
                   image_size: int | tuple[int, int] | None = None) -> None:
        """Begin a step without running it: ``advance()`` then runs one action at a time.

        Arguments as for ``train_step``. Driving several ranks by hand, advance them in
        ``schedule.global_order()`` and run the ranks of one spatial op (same tick, stage,
        micro-batch; tiles) concurrently.
        """
        if self._draws_refusal is not None:   # an engine built without an optimizer, trained after all
            raise self._draws_refusal
        batch = resolve_batch_size(images, labels, batch_size)
        self.cfg.validate(batch_size=batch)
        data = StepInput(images, labels, batch, resolve_image_size(images, image_size))
        firsts = self._firsts
        try:   # what is missing differs between ranks: fail loudly instead of hanging others
            data.check(self.ctx.rank, runs_first=bool(firsts),
                       runs_spatial_first=any(a.tile is not None for a in firsts),
                       runs_last=self.cfg.split_size - 1 in self.held_stages())
        except (ValueError, TypeError):
            self._fail()
            raise
        chunk = batch // self.cfg.batch_divisor
        for inst in self.instances.values():
            inst.start_training()
        self._step = self.runtime.steps(data, chunk)

    def next_action(self) -> Action | None:
        """This rank's next action of the started step (None: all done)."""
        return self._step.next_action if self._step is not None else None

    def _started(self) -> StepRun:
        if self._step is None:
            raise RuntimeError("call start_step(images, labels) first")
        return self._step

    def advance(self) -> Action | None:
        """Execute this rank's next action of the started step; returns it (None: done)."""
        step = self._started()
        try:
            return next(step, None)
        except Exception:
            self._fail()
            raise

    def finish_step(self) -> float:
        """Run the rest of the started step; return the global-batch loss on every rank."""
        step = self._started()
        try:
            for _ in step:
                pass
            total = self.ctx.all_reduce(step.loss_share())
        except Exception:
            self._fail()
            raise
        finally:
            self._step = None
        self.heap.step_done()
        return float(total.item())

    def evaluate_batch(self, images: Images, labels: Labels = None, *, batch_size: int | None = None,
                       image_size: int | tuple[int, int] | None = None) -> list[tuple[slice, Payload]]:
        """Forward only, with this layout, in eval mode: this rank's last-stage outputs as ``(rows of the
        global batch, output)`` pairs (on a spatial last stage, its tiles: see ``evaluate_tiles``)."""
        return [(out.rows, out.output) for out in self.evaluate_tiles(images, labels, batch_size=batch_size,
                                                                      image_size=image_size)]

    def evaluate_tiles(self, images: Images, labels: Labels = None, *, batch_size: int | None = None,
                       image_size: int | tuple[int, int] | None = None) -> list[StageOutput]:
        """Forward only, with this layout (spatial ranks run the spatial forward), in eval mode.

        Arguments as for ``train_step`` (labels are not needed). Every module this rank runs is
        put in eval mode (BatchNorm uses its running statistics, dropout is off) and back in
        its previous mode afterwards; no gradient, buffer or optimizer state is touched.
        Returns this rank's last-stage outputs, each with its rows of the global batch and its tile
        (a spatial last stage's tile of the output; None: the whole output), empty on ranks without a
        last-stage forward; collective over every rank.
        """
        batch = resolve_batch_size(images, labels, batch_size)
        self.cfg.validate(batch_size=batch)
        data = StepInput(images, labels, batch, resolve_image_size(images, image_size))
        firsts = self._firsts
        modes = {m: m.training for inst in self.instances.values()
                 for root in (inst.canonical, inst.module) for m in root.modules()}
        try:
            data.check(self.ctx.rank, runs_first=bool(firsts),
                       runs_spatial_first=any(a.tile is not None for a in firsts), runs_last=False)
            for module in modes:
                module.training = False
            return self.runtime.forward_only(data, batch // self.cfg.batch_divisor)
        except Exception:
            self._fail()
            raise
        finally:
            for module, training in modes.items():
                module.training = training

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
            out.append(self.instances.get((0, s)) or self.instances[(1, s)])
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """On rank 0 the state dict of ``nn.Sequential(*layers)`` (CPU tensors); None elsewhere."""
        with self._whole_weights():
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
        """Inverse of ``full_state_dict``: ``state`` on rank 0; each holder receives only its stages."""
        missing = None
        if self.ctx.rank == 0:
            if state is None:
                missing = "no state dict on rank 0"
            else:
                lacking = [k for k in self.stage_keys() if k not in state]
                missing = f"the state dict lacks {lacking[:4]}" if lacking else None
        mine = self.scatter_to_holders(state if missing is None else {}, error=missing)
        with self._whole_weights():   # ZeRO's shards refreshed from the loaded weights after
            for inst in self.instances.values():
                inst.canonical.load_from_full(mine)

    def stage_keys(self, stages: Iterable[int] | None = None) -> list[str]:
        """Whole-model state-dict keys of ``stages`` (default all), known on every rank."""
        chosen = range(len(self.stages)) if stages is None else stages
        return [self.stages[s].full_key(k) for s in chosen for k in self.stages[s].state_dict()]

    def stage_of_key(self, key: str) -> int | None:
        """The stage holding whole-model key ``key`` (``'<layer>.<rest>'``); None if no layer has it."""
        head = key.partition(".")[0]
        if not head.isdigit():
            return None
        layer = int(head)
        for stage in self.stages:
            if stage.offset <= layer < stage.offset + len(stage):
                return stage.index
        return None

    def scatter_to_holders(self, entries: Mapping[str, T] | None,
                           error: str | None = None) -> dict[str, T]:
        """Collective: rank 0's ``entries`` (whole-model keys) split so each rank gets its stages' keys.

        ``error`` (decided on rank 0) is raised as ValueError on every rank instead.
        """
        pieces: list[tuple[str | None, dict[str, T]]] | None = None
        if self.ctx.rank == 0:
            holds = [set(role.stages) for role in self.roles]
            pieces = [(error, {}) for _ in holds]
            for key, value in (entries or {}).items() if error is None else ():
                stage = self.stage_of_key(key)   # keys of no layer are ignored, as by load
                for rank, stages in enumerate(holds):
                    if stage in stages:
                        pieces[rank][1][key] = value
        error, mine = self.ctx.scatter_object(pieces)
        if error is not None:
            raise ValueError(f"load_full_state_dict: {error}")
        return mine

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
