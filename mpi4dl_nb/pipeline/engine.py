"""HybridEngine: train a layer list with any SP/LP/PP/GEMS/DP mix, exactly like one process."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

import torch
from torch import nn

from ..comm.allocator import RELEASE_EVERY_STEPS, HeapRelease
from ..comm.messages import Payload
from ..comm.protocol import Comm
from ..comm.timeline import gather_timeline
from ..comm.trace import Event
from ..config import ParallelConfig, ScheduleKind
from .accumulate import GradientSum
from .actions import Action
from .default_cut import auto_balance
from .engine_setup import EnginePlan, HeldStages, OptimizerFactory, stepped_optimizer
from .runtime import LossFn, StageOutput
from .schedules import Stepper
from .stage_instance import StageInstance
from .step_input import Images, Labels, StepInput, resolve_batch_size, resolve_image_size
from .step_run import StepRun
from .whole_state import WholeState

T = TypeVar("T")   # a value of a whole-model key (a tensor, an optimizer state entry)


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
    ranks holding the same stage (``sharding/``; docs/sharding.md); ``max_grad_norm``: clip the gradient to
    this global norm before each optimizer step (None: never), as ``torch.nn.utils.clip_grad_norm_``.
    Training layers that draw random numbers (dropout, stochastic depth) on two stages or on replicas is refused
    (``stage_draws.draws_refusal``): here with an ``optimizer``, else at the first training step.
    """

    def __init__(self, layers: list[nn.Module], cfg: ParallelConfig, ctx: Comm, *, loss_fn: LossFn,
                 optimizer: OptimizerFactory | None = None, schedule: ScheduleKind | str | None = None,
                 abort_on_error: bool = True, elementwise: Iterable[type] = (),
                 image_size: int | tuple[int, int] | None = None,
                 release_heap_every: int | None = RELEASE_EVERY_STEPS, max_grad_norm: float | None = None) -> None:
        self.cfg, self.ctx, self.abort_on_error = cfg, ctx, abort_on_error
        self.heap = HeapRelease(every=release_heap_every)   # free heap pages back to the kernel now and then
        plan = EnginePlan.make(list(layers), cfg, ctx.world_size, schedule, image_size, max_grad_norm,
                               trains=optimizer is not None)   # the same on every rank, before any model work
        self.loss_fn, self._draws_refusal, self._firsts = plan.loss(loss_fn), plan.draws_refusal, plan.firsts(ctx.rank)
        self.roles, self.role, self.balance, self.stages = plan.roles, plan.roles[ctx.rank], plan.balance, plan.stages
        self.grid, self.schedule = plan.grid, plan.schedule
        try:   # a rank-local failure (e.g. an unsupported spatial layer) must not hang others
            self.held = held = HeldStages(plan, ctx, elementwise)   # groups; this rank's copies; the rest released
            self.stage_groups, self.sync_groups, self.instances = held.stage_groups, held.sync_groups, held.instances
            self.released_stages = held.released
            self.zero = held.sharding(trains=optimizer is not None)   # ZeRO's seam (nothing sharded at stage 0)
            self.optimizer = stepped_optimizer(optimizer, self.zero.stepped(held.trained()))
        except Exception:
            self._fail()
            raise
        self.runtime = held.runtime(self.loss_fn, self.zero, self.optimizer, max_grad_norm)
        self.whole = WholeState(ctx, cfg, self.roles, self.stages, self.instances, self.zero)
        self._step: StepRun | None = None

    # ------------------------------------------------------------------ held
    def trained_tensors(self) -> list[torch.Tensor]:
        """The parameters this rank keeps between steps, each once: its stages' (with ZeRO stage 3 holding no memory
        between uses) and ZeRO's shards; their gradients and the optimizer's state are theirs."""
        seen = {id(p): p for inst in self.instances.values() for p in inst.canonical.parameters()}
        return [*seen.values(), *self.zero.shards()]

    def named_shards(self) -> list[tuple[str, nn.Parameter]]:
        """ZeRO's shards this rank steps, by their parameter's whole-model key (none at ZeRO stage 0)."""
        return self.zero.named_shards()

    def held_stages(self) -> list[int]:
        """Stages this rank holds (primary and GEMS mirror slots), ascending."""
        return sorted({stage for _, stage in self.instances})

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
        sums = GradientSum(self.zero.gradient_holders([p for _, p in self.held.trained()]))
        losses = []
        with self.runtime.optimizer_step.paused():
            for images, labels in batches:
                losses.append(self.train_step(images, labels, on_action, batch_size=batch_size,
                                              image_size=image_size))
                if not self._agreed(sums.add()):
                    sums.drop()
                    return sum(losses) / len(losses)
        sums.apply()
        self.runtime.step_optimizer()
        return sum(losses) / len(losses)

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
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """On rank 0 the state dict of ``nn.Sequential(*layers)`` (CPU tensors); None elsewhere."""
        return self.whole.gathered()

    def load_full_state_dict(self, state: dict[str, torch.Tensor] | None) -> None:
        """Inverse of ``full_state_dict``: ``state`` on rank 0; each holder receives only its stages."""
        self.whole.load(state)

    def stage_keys(self, stages: Iterable[int] | None = None) -> list[str]:
        """Whole-model state-dict keys of ``stages`` (default all), known on every rank."""
        return self.whole.keys(stages)

    def stage_of_key(self, key: str) -> int | None:
        """The stage holding whole-model key ``key`` (``'<layer>.<rest>'``); None if no layer has it."""
        return self.whole.stage_of(key)

    def scatter_to_holders(self, entries: Mapping[str, T] | None, error: str | None = None) -> dict[str, T]:
        """Collective: rank 0's ``entries`` (whole-model keys) split so each rank gets its stages' keys.

        ``error`` (decided on rank 0) is raised as ValueError on every rank instead.
        """
        return self.whole.scatter(entries, error)

    def owned_stages(self) -> list[StageInstance]:
        """Instances whose stage this rank reports (lowest holder rank, primary first)."""
        return self.whole.owned()

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
