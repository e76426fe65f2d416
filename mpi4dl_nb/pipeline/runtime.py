"""The one runtime that executes any Schedule (GPipe, 1F1B, GEMS, with spatial and DP)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import NamedTuple

import torch

from ..comm.handles import Group
from ..comm.messages import Mailbox, Payload, as_items, isend_payload, like, payload_bytes
from ..comm.protocol import Comm
from ..loss import TileLoss
from ..sharding.seam import Sharding
from ..spatial.geometry import TileGrid
from ..spatial.reduce import replicated_sum
from .actions import COMPUTE_KINDS, Action, ActionKind
from .dataparallel import sync_running_stats
from .grad_buckets import weight_gradient_passes
from .gradient_sums import gradient_sums
from .handoff import FeatureTiles, TileJoin
from .merged_copies import MergedCopies
from .optimizer_step import OptimizerStep
from .precision import COMPUTE_DTYPES, autocast
from .schedules import Schedule, stage_ranks
from .split_backward import LayerRecorder, input_backward, splits_backward
from .stage_instance import StageInstance
from .step_input import StepInput
from .step_run import StepRun
from .step_state import Key, StepState, leaf, message_key, open_mailboxes, rows

LossFn = Callable[[Payload, Payload], torch.Tensor]   # (last stage's output, labels) -> loss
Run = Callable[[Action, StepState], "int | None"]   # an action kind's execution: the bytes it moved, or None


class StageOutput(NamedTuple):
    """A last-stage output of an evaluation: its rows of the global batch, the output, and its tile (on a
    spatial last stage: this rank's tile of the output; None: the whole output)."""

    rows: slice
    output: Payload
    tile: int | None


class PipelineRuntime:
    """Runs this rank's actions of a Schedule for one training step; ``sharding``: ZeRO's seam (``sharding/``)."""

    def __init__(self, ctx: Comm, schedule: Schedule, instances: dict[tuple[int, int], StageInstance],
                 stage_groups: dict[int, Group | None], loss_fn: LossFn, grid: TileGrid | None,
                 handoff: TileJoin | None, *, sharding: Sharding, optimizer_step: OptimizerStep) -> None:
        self.ctx, self.schedule, self.cfg = ctx, schedule, schedule.cfg
        self.instances, self.stage_groups, self.loss_fn, self.grid = instances, stage_groups, loss_fn, grid
        self.handoff = handoff if handoff is not None or grid is None else FeatureTiles(grid)   # tiles -> a layer stage
        self.holders = stage_ranks(self.cfg)
        self.optimizer_step, self.scaler = optimizer_step, optimizer_step.scaler   # fp16: the loss scaler
        self.autocasts = self.cfg.precision in COMPUTE_DTYPES   # a forward runs under torch.autocast
        self.actions = schedule.actions(ctx.rank)
        self.outbound, self.mailbox, self.forward_mailbox = open_mailboxes(ctx, schedule)
        self.recorders = {key: LayerRecorder(inst.module, persistent=True) for key, inst in instances.items()
                          if self._splits(inst.stage)}
        self.sums, self.reducer = gradient_sums(ctx, self.cfg, stage_groups, self._stage_copies, sharding)
        # worked out once: this rank's actions in the order it runs them, and what each step's buckets expect
        self.order: tuple[Action, ...] = tuple(a for a in schedule.global_order() if a.rank == ctx.rank)
        self.passes = self.weight_gradient_passes() if self.reducer is not None and self.reducer.stages else {}
        self.ledgers = [inst.ledger for inst in instances.values() if inst.ledger]
        self.merged = MergedCopies(self.cfg, ctx, grid)
        self._run: dict[ActionKind, Run] = {
            ActionKind.FORWARD: self._forward, ActionKind.BACKWARD: self._backward,
            ActionKind.BACKWARD_INPUT: self._backward, ActionKind.BACKWARD_WEIGHT: self._backward_weight,
            ActionKind.SEND_ACT: self._send, ActionKind.SEND_GRAD: self._send,
            ActionKind.RECV_ACT: self._recv, ActionKind.RECV_GRAD: self._recv,
            ActionKind.ALLREDUCE: self._allreduce, ActionKind.OPTIM: self._optimize}
        for kind in COMPUTE_KINDS:   # ZeRO 3: the stage's weights gathered around each computation (else as is)
            self._run[kind] = sharding.around(self._run[kind])
        self.weights = sharding.using   # stage -> a context with the stage's whole weights present

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.optimizer_step.optimizer

    def step_optimizer(self) -> None:
        """The optimizer's step (``optimizer_step.OptimizerStep.run``)."""
        self.optimizer_step.run()

    def _stage_copies(self, stage: int) -> list[StageInstance]:
        """This rank's copies of ``stage`` (GEMS directions), in replica order."""
        return [inst for (_, s), inst in sorted(self.instances.items()) if s == stage]

    def weight_gradient_passes(self) -> dict[int, list[int]]:
        """For each stage this rank holds, the backward passes of each of its copies this step."""
        passes: dict[int, list[int]] = {}
        for stage in sorted({s for _, s in self.instances}):
            merged = self.cfg.local_dp if (self.cfg.sync_batchnorm and self._spatial(stage)) else 1
            passes[stage] = [weight_gradient_passes(self.actions, inst.replica, stage, merged)
                             for inst in self._stage_copies(stage)]
        return passes

    # ----------------------------------------------------------------- helpers
    def _instance(self, action: Action) -> StageInstance:
        return self.instances[(action.replica, action.stage)]

    def _spatial(self, stage: int) -> bool:
        return stage < self.cfg.spatial_size

    def _splits(self, stage: int) -> bool:
        """Whether this stage's I and W are computed apart (``split_backward.splits_backward``); else I runs the
        whole backward and W nothing. On spatial stages W runs the halo convolutions' and tile BatchNorms'
        backwards for their parameters only: no halo return, no sum over the tiles."""
        return splits_backward(self.cfg, stage)

    def _last(self, stage: int) -> bool:
        return stage == self.cfg.split_size - 1

    @staticmethod
    def _key(action: Action) -> Key:
        return (action.replica, action.stage, action.micro_batch, action.copy)

    @staticmethod
    def _peer(action: Action) -> int:
        if action.peer is None:
            raise ValueError(f"{action.describe()}: a send/receive without a peer")
        return action.peer

    def _handoff(self) -> TileJoin:
        if self.handoff is None:
            raise ValueError("a spatial hand-off needs the tile grid (cfg.spatial_size > 0)")
        return self.handoff

    def _stage_input(self, action: Action, state: StepState) -> Payload:
        """A forward's input: its rows of the images (stage 0), else the received activation
        (tiles of a spatial stage joined for a layer-parallel one)."""
        key = self._key(action)
        if action.stage == 0:
            return state.data.images_for(rows(state, action.chunk), action.tile, self.grid,
                                         self.ctx.device)
        received = state.inbox.pop((True, key))
        if len(received) > 1 or (self._spatial(action.stage - 1) and not self._spatial(action.stage)):
            tiles = self.holders[(action.dp, action.replica, action.stage - 1)]
            joined = state.boxes[key] = self._handoff().join_payloads([received[r] for r in tiles])
            return joined.payload
        (x,) = received.values()
        return x

    def _forward(self, action: Action, state: StepState) -> None:
        inst = self._instance(action)
        if self.merged.applies(action):
            self.merged.forward(action, state, inst)
            return
        key = self._key(action)
        x = self._stage_input(action, state)
        if action.stage > 0:
            x = leaf(x)
        state.inputs[key] = x
        recorder = self.recorders.get((action.replica, action.stage))
        if not inst.ledger and not self.autocasts and recorder is None:
            out = self._stage_output(action, state, inst, x)   # no context to enter (no ExitStack made)
        else:
            with ExitStack() as scope:   # only the contexts that do something here (each costs per forward)
                if inst.ledger:
                    scope.enter_context(inst.ledger.chunk(self.merged.stats_key(action)))
                if self.autocasts:
                    scope.enter_context(autocast(self.cfg.precision, self.ctx.device))
                if recorder is not None:
                    state.layer_calls[key] = scope.enter_context(recorder.recording())
                out = self._stage_output(action, state, inst, x)
        if self._last(action.stage) and action.tile in (None, 0):   # a spatial last stage's tiles hold one loss
            assert isinstance(out, torch.Tensor)   # the loss
            state.losses.append(out.detach())
        state.outputs[key] = out   # the last stage's loss unscaled: its backward starts from the chunk's share

    def _stage_output(self, action: Action, state: StepState, inst: StageInstance, x: Payload) -> Payload:
        """The stage's output on ``x``; on the last stage the chunk's loss (unscaled)."""
        out = inst.module(x)
        if not self._last(action.stage):
            return out
        target = state.data.labels_for(rows(state, action.chunk), self.ctx.device, action.tile, self.grid)
        return self._loss(inst, out, target)

    def _loss(self, inst: StageInstance, out: Payload, target: Payload) -> torch.Tensor:
        """The chunk's loss: on a spatial last stage from the tiles, its sums all-reduced over the tile group
        (the same value on every tile; backward gives each tile its share)."""
        if inst.tile is None:
            return self.loss_fn(out, target)
        if not isinstance(self.loss_fn, TileLoss):
            raise TypeError("a spatial last stage needs a loss computed on tiles (a TileLoss, e.g. DenseLoss)")
        group = inst.tile_group
        return self.loss_fn.on_tiles(out, target, lambda t: replicated_sum(t, self.ctx, group))

    def _backward(self, action: Action, state: StepState) -> None:
        key = self._key(action)
        if self.merged.applies(action):
            self.merged.backward(action, state, key)
            return
        out = state.outputs.pop(key)
        # the consumer received these activations before sending the gradient back, so
        # the sends are complete: release their buffers now rather than at the step's end
        self.ctx.wait_all(state.act_sends.pop(key, []))
        outputs: list[torch.Tensor]
        grad_outputs: list[torch.Tensor | None]
        if self._last(action.stage):
            assert isinstance(out, torch.Tensor)   # the last stage keeps its loss
            # backward from the chunk's share of the batch's loss: d(loss * share) / d(loss) = share, seeded here
            # rather than a multiplication in forward (the same gradients: 1 * share = share exactly)
            top = self.scaler.scaled(out) if self.scaler is not None else out
            outputs, grad_outputs = [top], [torch.full_like(top, state.chunk_size / state.batch_size)]
        else:
            (grads,) = state.inbox.pop((False, key)).values()
            floats = [o for o in as_items(out) if o.is_floating_point()]
            pairs = [(o, g) for o, g in zip(floats, as_items(grads)) if o.requires_grad]
            outputs, grad_outputs = [o for o, _ in pairs], [g for _, g in pairs]
        x = state.inputs.pop(key)
        calls = state.layer_calls.pop(key, None)
        if calls is None:    # the whole backward (B, or the I of a stage that is not split)
            if outputs:
                torch.autograd.backward(outputs, grad_outputs)
            found = {id(t): t.grad for t in as_items(x) if t.is_floating_point()}
        else:                # I now, W at this micro-batch's W action
            wanted = [t for t in as_items(x) if t.is_floating_point() and t.requires_grad] if action.stage else []
            grads_in, state.weight_work[key] = input_backward(calls, outputs, grad_outputs, wanted)
            found = {id(t): g for t, g in zip(wanted, grads_in)}
        if action.stage > 0:
            state.input_grads[key] = [
                (g if (g := found.get(id(t))) is not None else torch.zeros_like(t)) if t.is_floating_point()
                else None for t in as_items(x)]

    def _backward_weight(self, action: Action, state: StepState) -> None:
        """W: the parameter gradients the micro-batch's I left (nothing when its stage is not split)."""
        work = state.weight_work.pop(self._key(action), None)
        if work is not None:
            work.run()

    def _send(self, action: Action, state: StepState) -> int:
        key = self._key(action)
        peer = self._peer(action)
        if action.kind.carries_activation:
            payload = state.outputs[key]
        else:
            grads = state.input_grads[key]
            boxes = state.boxes.get(key)
            if boxes is not None:
                tiles = self.holders[(action.dp, action.replica, action.stage - 1)]
                grads = boxes.tile_grads(grads, tiles.index(peer))
            float_grads = [g for g in grads if g is not None]
            payload = tuple(float_grads) if len(grads) > 1 else float_grads[0]
            state.sends_left[key] = state.sends_left.get(key, self._grad_sends(action)) - 1
            if state.sends_left[key] == 0:
                state.input_grads.pop(key)
                state.boxes.pop(key, None)
        if peer == self.ctx.rank:   # zbv's turn: the next stage is on this rank, the same tensors detached
            # (no copy: an in-place op on a stage input is refused by autograd - the input is a leaf requiring grad)
            state.loopback[message_key(action)] = like(payload, [t.detach() for t in as_items(payload)])
            return 0
        requests = isend_payload(self.ctx, payload, peer, action.tag, self.outbound[peer])
        if action.kind.carries_activation:
            state.act_sends.setdefault(key, []).extend(requests)
        else:
            state.requests += requests
        return payload_bytes(payload)

    def _grad_sends(self, action: Action) -> int:
        previous = action.stage - 1
        if self._spatial(previous) and not self._spatial(action.stage):
            return len(self.holders[(action.dp, action.replica, previous)])
        return 1

    def _recv(self, action: Action, state: StepState, mailbox: Mailbox | None = None) -> int:
        peer = self._peer(action)
        if peer == self.ctx.rank:
            payload = state.loopback.pop(message_key(action))
        else:
            payload = (mailbox or self.mailbox).take(peer, message_key(action))
        state.inbox.setdefault((action.kind.carries_activation, self._key(action)), {})[peer] = payload
        return payload_bytes(payload)

    def _allreduce(self, action: Action, state: StepState) -> int:
        """The stage's gradients summed over its holders (``gradient_sums``), its BatchNorm terms replayed on all."""
        moved = self.sums[action.stage]()
        sync_running_stats(self.ctx, [i.ledger for i in self._stage_copies(action.stage)],
                           self.stage_groups.get(action.stage))
        return moved

    # --------------------------------------------------------------- evaluation
    def forward_only(self, data: StepInput, chunk_size: int) -> list[StageOutput]:
        """Evaluation with the training layout: this rank's forwards and activation transfers of
        the schedule, without autograd, the BatchNorm ledger, gradients or the optimizer.

        Returns this rank's last-stage outputs, each with its rows of the global batch and its tile (modules
        are run as they are: the caller puts them in eval mode). Dropping the backward, gradient
        and optimizer actions of a deadlock-free schedule keeps it deadlock-free: sends never
        block, and every receive's sender runs a subset of what it ran before.
        """
        state = StepState(data, chunk_size, data.batch_size)
        results: list[StageOutput] = []
        self.forward_mailbox.begin()
        with torch.no_grad():
            for action in self.actions:
                kind = action.kind
                if kind is ActionKind.FORWARD:
                    with self.weights(action.stage):
                        out = self._instance(action).module(self._stage_input(action, state))
                    if self._last(action.stage):
                        results.append(StageOutput(rows(state, action.chunk), out, action.tile))
                    else:
                        state.outputs[self._key(action)] = out
                elif kind.is_p2p and kind.carries_activation and kind.is_send:
                    self._send(action, state)
                elif kind.is_p2p and kind.carries_activation:
                    self._recv(action, state, self.forward_mailbox)
            for pending in state.act_sends.values():
                self.ctx.wait_all(pending)
        self.forward_mailbox.check_drained()
        return results

    # --------------------------------------------------------------------- step
    def steps(self, data: StepInput, chunk_size: int) -> StepRun:
        """A paused step: iterate it to execute this rank's actions one at a time."""
        return StepRun(self, StepState(data, chunk_size, data.batch_size))

    def traced(self, action: Action, state: StepState) -> None:
        """Execute ``action``; with tracing on, one event for it (off: nothing but the check)."""
        tracer = self.ctx.tracer
        if not tracer.enabled:
            self._run[action.kind](action, state)
            return
        start = tracer.stamp()
        moved = self._run[action.kind](action, state)
        tracer.event(action.kind.value, start, tracer.stamp(), action.stage, action.micro_batch, action.replica,
                     action.peer, moved or 0, {"chunk": action.chunk, "copy": action.copy, "tick": action.tick})

    def _optimize(self, action: Action, state: StepState) -> None:
        """OPTIM: every send of the step complete, then the optimizer's step (when its gradients are usable)."""
        self.ctx.wait_all(state.requests)
        state.requests.clear()
        for pending in state.act_sends.values():
            self.ctx.wait_all(pending)
        state.act_sends.clear()
        self.step_optimizer()
