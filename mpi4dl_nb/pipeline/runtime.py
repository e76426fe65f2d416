"""The one runtime that executes any Schedule (GPipe, 1F1B, GEMS, with spatial and DP)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from ..comm.handles import Channel, Group, Request
from ..comm.messages import Mailbox, Payload, as_items, isend_payload, like, payload_bytes
from ..comm.protocol import Comm
from ..layout import stage_holders
from ..loss import TileLoss
from ..spatial.geometry import TileGrid
from ..spatial.reduce import replicated_sum
from .bn_replay import RunningStatsLedger
from .dataparallel import sum_stage_gradients, sync_running_stats
from .grad_buckets import MB, GradientReducer, weight_gradient_passes
from .grad_clip import clip_by_global_norm
from .handoff import FeatureTiles, JoinedTiles, TileJoin
from .precision import COMPUTE_DTYPES, LossScaler, autocast
from .schedules import Action, ActionKind, Schedule, chunk_index, stage_ranks
from .split_backward import LayerCall, LayerRecorder, WeightWork, input_backward, splits_backward
from .stages import Stage
from .step_input import StepInput
from .zero import ZeroState
from .zero_layers import gather_layer_by_layer

Key = tuple[int, int, int, int]   # (replica, stage, micro_batch, copy)
LossFn = Callable[[Payload, Payload], torch.Tensor]   # (last stage's output, labels) -> loss
MessageKey = tuple[bool, int, int, int, int, int]   # (activation?, dp, replica, sender stage, micro-batch, copy)
Run = Callable[[Action, "_StepState"], "int | None"]   # an action kind's execution: the bytes it moved, or None


class StageOutput(NamedTuple):
    """A last-stage output of an evaluation: its rows of the global batch, the output, and its tile (on a
    spatial last stage: this rank's tile of the output; None: the whole output)."""

    rows: slice
    output: Payload
    tile: int | None


@dataclass
class StageInstance:
    """One copy of one stage on this rank, in one GEMS direction.

    ``canonical`` is the plain Stage (whole-model state-dict keys); ``module`` is what runs
    — the same object, or its spatialized twin sharing every parameter and buffer.
    """

    stage: int
    replica: int
    canonical: Stage
    module: nn.Module
    tile: int | None = None
    tile_group: Group | None = None    # a spatial stage's tile group (the sums of a loss on tiles)
    ledger: RunningStatsLedger = field(init=False)

    def __post_init__(self) -> None:
        self.ledger = RunningStatsLedger(self.module)

    def start_training(self) -> None:
        """Set this copy up for a training step (``start_training``)."""
        start_training(self.canonical, self.module)

    def silent_parameters(self) -> set[int]:
        """Parameters whose gradient this copy must not add to the stage sum: on a spatial
        stage's tiles other than 0, those used on replicated tensors (full gradient on each tile)."""
        if self.tile is None or self.tile == 0:
            return set()
        from ..spatial.convert import tile_replicated_parameters

        return {id(p) for p in tile_replicated_parameters(self.module)}


def _silent_of(copies: list[StageInstance]) -> Callable[[], list[set[int]]]:
    """Each copy's silent parameters, asked when needed (spatial layers learn them in forward)."""
    return lambda: [inst.silent_parameters() for inst in copies]


def start_training(canonical: nn.Module, module: nn.Module) -> None:
    """Train mode on a stage and its running twin, gradients dropped. ``train()`` walks and sets
    every submodule (~2 ms for AmoebaNet's 500): it is called only when some module is not in
    train mode already - the same result, without the walk on every step."""
    for root in (canonical,) if module is canonical else (canonical, module):
        if not all(m.training for m in root.modules()):
            root.train()
    canonical.zero_grad(set_to_none=True)


@dataclass
class _StepState:
    data: StepInput
    chunk_size: int
    batch_size: int
    inputs: dict[Key, Payload] = field(default_factory=dict)
    outputs: dict[Key, Payload] = field(default_factory=dict)
    input_grads: dict[Key, list[torch.Tensor | None]] = field(default_factory=dict)
    boxes: dict[Key, JoinedTiles] = field(default_factory=dict)    # a spatial hand-off's joins (gradients split)
    inbox: dict[tuple[bool, Key], dict[int, Payload]] = field(default_factory=dict)   # (activation?, key)
    sends_left: dict[Key, int] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    act_sends: dict[Key, list[Request]] = field(default_factory=dict)
    # the losses of this rank's last-stage chunks, left on the device (no host sync per micro-batch)
    losses: list[torch.Tensor] = field(default_factory=list)
    # sync_batchnorm on a spatial stage with local-DP copies: one forward for all copies
    merged: dict[tuple[int, int, int], tuple[Payload, Payload]] = field(default_factory=dict)
    merged_grads: dict[tuple[int, int, int], dict[int, Payload]] = field(default_factory=dict)
    # split backward (zero-bubble schedules): the layers' calls of a forward, the W an I left
    layer_calls: dict[Key, list[LayerCall]] = field(default_factory=dict)
    weight_work: dict[Key, WeightWork] = field(default_factory=dict)
    # zbv's turn: a payload between two stages of this rank (no wire), from its send to its receive
    loopback: dict[MessageKey, Payload] = field(default_factory=dict)


def message_key(action: Action) -> MessageKey:
    """The payload a send or receive action moves, named the same on both sides."""
    activation = action.kind.carries_activation
    if action.kind.is_send:
        sender = action.stage
    else:
        sender = action.stage - 1 if activation else action.stage + 1
    return (activation, action.dp, action.replica, sender, action.micro_batch, action.copy)


def channel_pairs(schedule: Schedule) -> list[tuple[int, int]]:
    """Every (sender, receiver) pair of the schedule's payloads between two ranks, sorted (the same on
    every rank; a payload a rank sends itself - zbv's turn - stays in its step state)."""
    return sorted({(a.rank, a.peer) for rank in range(schedule.world_size)
                   for a in schedule.actions(rank)
                   if a.kind.is_p2p and a.kind.is_send and a.peer is not None and a.peer != a.rank})


def inbound_order(schedule: Schedule, rank: int,
                  activations_only: bool = False) -> dict[int, list[tuple[MessageKey, int]]]:
    """For each rank sending to ``rank``: its payloads' (key, tag) in the order it sends them
    (``activations_only``: the forward-only round of an evaluation)."""
    order: dict[int, list[tuple[MessageKey, int]]] = {}
    for src in range(schedule.world_size):
        if src == rank:
            continue   # a rank's payloads to itself never touch the wire (``channel_pairs``)
        for a in schedule.actions(src):
            if activations_only and not a.kind.carries_activation:
                continue
            if a.kind.is_p2p and a.kind.is_send and a.peer == rank:
                order.setdefault(src, []).append((message_key(a), a.tag))
    return order


def _leaf(payload: Payload) -> Payload:
    """A detached copy of ``payload`` whose float tensors require grad."""
    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.requires_grad_(True) if t.is_floating_point() else t
    return like(payload, [one(t) for t in as_items(payload)])


class PipelineRuntime:
    """Runs this rank's actions of a Schedule for one training step."""

    def __init__(self, ctx: Comm, schedule: Schedule, instances: dict[tuple[int, int], StageInstance],
                 stage_groups: dict[int, Group | None], loss_fn: LossFn,
                 optimizer: torch.optim.Optimizer | None, grid: TileGrid | None,
                 handoff: TileJoin | None = None, *, zero: ZeroState | None = None,
                 max_grad_norm: float | None = None) -> None:
        self.ctx = ctx
        self.zero = zero                     # ZeRO's shards (pipeline/zero.py; None: every holder keeps all)
        self.max_grad_norm = max_grad_norm   # clip the gradient to this global norm before each step (None: never)
        self.schedule = schedule
        self.cfg = schedule.cfg
        self.instances = instances
        self.stage_groups = stage_groups
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.grid = grid
        self.handoff = handoff if handoff is not None or grid is None else FeatureTiles(grid)   # tiles -> a layer stage
        self.holders = stage_ranks(self.cfg)
        self.scaler = LossScaler() if self.cfg.precision == "fp16" else None
        self.autocasts = self.cfg.precision in COMPUTE_DTYPES   # a forward runs under torch.autocast
        self.actions = schedule.actions(ctx.rank)
        # One-way channels carry the payloads (own process groups on the torch plane; made
        # collectively, same pairs everywhere); receives take each channel in send order.
        channels = ctx.channels(channel_pairs(schedule))
        self.outbound: dict[int, Channel] = {dst: c for (src, dst), c in channels.items() if src == ctx.rank}
        inbound: dict[int, Channel | None] = {src: c for (src, dst), c in channels.items()
                                              if dst == ctx.rank}
        self.mailbox = Mailbox(ctx, ctx.device, inbound_order(schedule, ctx.rank), inbound)
        # an evaluation's round carries the activations only: its own send order per channel
        self.forward_mailbox = Mailbox(ctx, ctx.device, inbound_order(schedule, ctx.rank, True), inbound)
        self.recorders = {key: LayerRecorder(inst.module, persistent=True) for key, inst in instances.items()
                          if self._splits(inst.stage)}
        self.reducer = self._gradient_reducer()
        # worked out once: this rank's actions in the order it runs them, and what each step's buckets expect
        self.order: tuple[Action, ...] = tuple(a for a in schedule.global_order() if a.rank == ctx.rank)
        self.passes = self.weight_gradient_passes() if self.reducer is not None and self.reducer.stages else {}
        self.ledgers = [inst.ledger for inst in instances.values() if inst.ledger]
        self._run: dict[ActionKind, Run] = {
            ActionKind.FORWARD: self._forward, ActionKind.BACKWARD: self._backward,
            ActionKind.BACKWARD_INPUT: self._backward, ActionKind.BACKWARD_WEIGHT: self._backward_weight,
            ActionKind.SEND_ACT: self._send, ActionKind.SEND_GRAD: self._send,
            ActionKind.RECV_ACT: self._recv, ActionKind.RECV_GRAD: self._recv,
            ActionKind.ALLREDUCE: self._allreduce_in, ActionKind.OPTIM: self._optimize}
        if zero is not None and zero.level >= 3:   # weights gathered layer by layer (hooks), or per action
            for kind in (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT,
                         ActionKind.BACKWARD_WEIGHT):
                self._run[kind] = self._with_weights(self._run[kind])
            self.zero_hooks = [handle for (_, stage), inst in sorted(instances.items())   # not where I and W split
                               if zero.covers(stage) and not self._splits(stage)
                               for handle in gather_layer_by_layer(zero.stages[stage], inst.module)]

    def _stage_copies(self, stage: int) -> list[StageInstance]:
        """This rank's copies of ``stage`` (GEMS directions), in replica order."""
        return [inst for (_, s), inst in sorted(self.instances.items()) if s == stage]

    def _gradient_reducer(self) -> GradientReducer | None:
        """``grad_bucket_mb``: buckets whose all-reduce starts during backward, on every stage this rank
        shares with other holders (None: one all-reduce per stage at its ALLREDUCE action)."""
        if self.cfg.grad_bucket_mb is None:
            return None
        reducer = GradientReducer(self.ctx, self.cfg.grad_bucket_mb * MB)
        for stage, group in sorted(self.stage_groups.items()):
            if group is not None and group.size > 1 and not (self.zero is not None and self.zero.reduces(stage)):
                copies = self._stage_copies(stage)
                reducer.add_stage(stage, [i.module for i in copies], group, _silent_of(copies))
        return reducer   # with no stage shared it holds no buckets: its per-step work is an empty loop

    def weight_gradient_passes(self) -> dict[int, list[int]]:
        """For each stage this rank holds, the backward passes of each of its copies this step."""
        passes: dict[int, list[int]] = {}
        for stage in sorted({s for _, s in self.instances}):
            merged = self.cfg.local_dp if (self.cfg.sync_batchnorm and self._spatial(stage)) else 1
            passes[stage] = [weight_gradient_passes(self.actions, inst.replica, stage, merged)
                             for inst in self._stage_copies(stage)]
        return passes

    # ----------------------------------------------------------------- helpers
    def _weights(self, stage: int) -> AbstractContextManager[None]:
        """ZeRO level 3: ``stage``'s whole weights for one computation, freed after (else nothing to do)."""
        return self.zero.using(stage) if self.zero is not None else nullcontext()

    def _with_weights(self, run: Run) -> Run:
        def with_weights(action: Action, state: _StepState) -> int | None:
            with self._weights(action.stage):
                return run(action, state)
        return with_weights

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

    @staticmethod
    def _rows(state: _StepState, chunk: int, count: int = 1) -> slice:
        return slice(chunk * state.chunk_size, (chunk + count) * state.chunk_size)

    def _merged(self, action: Action) -> bool:
        """sync_batchnorm on a spatial stage with local-DP copies: the copies' chunks of a
        micro-batch run as one batch (at copy 0's forward; backward at the last copy's)."""
        return self.cfg.sync_batchnorm and self._spatial(action.stage) and self.cfg.local_dp > 1

    def _stats_key(self, action: Action) -> int:
        """The key a forward's BatchNorm terms are recorded under: its chunk, or with
        sync_batchnorm the first chunk of the micro-batch (every synchronised copy records
        the same statistics under it, so they count once)."""
        if not self.cfg.sync_batchnorm:
            return action.chunk
        return chunk_index(self.cfg, 0, action.replica, action.micro_batch, 0)

    def _copy_keys(self, action: Action) -> list[Key]:
        return [(action.replica, action.stage, action.micro_batch, k) for k in range(self.cfg.local_dp)]

    # ------------------------------------------------------------------ actions
    def _forward_merged(self, action: Action, state: _StepState) -> None:
        if action.copy != 0:
            return   # copy 0's forward produced every copy's output
        inst = self._instance(action)
        keys = self._copy_keys(action)
        if action.stage == 0:
            x = state.data.images_for(self._rows(state, action.chunk, len(keys)), action.tile,
                                      self.grid, self.ctx.device)
        else:
            parts = [next(iter(state.inbox.pop((True, key)).values())) for key in keys]
            x = _leaf(like(parts[0], [torch.cat(items) for items in zip(*map(as_items, parts))]))
        with inst.ledger.chunk(self._stats_key(action)), autocast(self.cfg.precision, self.ctx.device):
            out = inst.module(x)
        state.merged[keys[0][:3]] = (x, out)
        size = state.chunk_size
        for k, key in enumerate(keys):
            state.outputs[key] = like(out, [o[k * size:(k + 1) * size] for o in as_items(out)])

    def _backward_merged(self, action: Action, state: _StepState) -> None:
        key = self._key(action)
        state.outputs.pop(key)
        self.ctx.wait_all(state.act_sends.pop(key, []))
        (grads,) = state.inbox.pop((False, key)).values()
        bucket = state.merged_grads.setdefault(key[:3], {})
        bucket[action.copy] = grads
        if len(bucket) < self.cfg.local_dp:
            return
        x, out = state.merged.pop(key[:3])
        state.merged_grads.pop(key[:3])
        joined = [torch.cat(items) for items in zip(*(as_items(bucket[k]) for k in sorted(bucket)))]
        pairs = [(o, g) for o, g in zip([o for o in as_items(out) if o.is_floating_point()], joined)
                 if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if action.stage == 0:
            return
        size = state.chunk_size
        for k, copy_key in enumerate(self._copy_keys(action)):
            state.input_grads[copy_key] = [
                ((t.grad if t.grad is not None else torch.zeros_like(t))[k * size:(k + 1) * size]
                 if t.is_floating_point() else None) for t in as_items(x)]

    def _stage_input(self, action: Action, state: _StepState) -> Payload:
        """A forward's input: its rows of the images (stage 0), else the received activation
        (tiles of a spatial stage joined for a layer-parallel one)."""
        key = self._key(action)
        if action.stage == 0:
            return state.data.images_for(self._rows(state, action.chunk), action.tile, self.grid,
                                         self.ctx.device)
        received = state.inbox.pop((True, key))
        if len(received) > 1 or (self._spatial(action.stage - 1) and not self._spatial(action.stage)):
            tiles = self.holders[(action.dp, action.replica, action.stage - 1)]
            joined = state.boxes[key] = self._handoff().join_payloads([received[r] for r in tiles])
            return joined.payload
        (x,) = received.values()
        return x

    def _forward(self, action: Action, state: _StepState) -> None:
        if self._merged(action):
            self._forward_merged(action, state)
            return
        key = self._key(action)
        inst = self._instance(action)
        x = self._stage_input(action, state)
        if action.stage > 0:
            x = _leaf(x)
        state.inputs[key] = x
        recorder = self.recorders.get((action.replica, action.stage))
        if not inst.ledger and not self.autocasts and recorder is None:
            out = self._stage_output(action, state, inst, x)   # no context to enter (no ExitStack made)
        else:
            with ExitStack() as scope:   # only the contexts that do something here (each costs per forward)
                if inst.ledger:
                    scope.enter_context(inst.ledger.chunk(self._stats_key(action)))
                if self.autocasts:
                    scope.enter_context(autocast(self.cfg.precision, self.ctx.device))
                if recorder is not None:
                    state.layer_calls[key] = scope.enter_context(recorder.recording())
                out = self._stage_output(action, state, inst, x)
        if self._last(action.stage) and action.tile in (None, 0):   # a spatial last stage's tiles hold one loss
            assert isinstance(out, torch.Tensor)   # the loss
            state.losses.append(out.detach())
        state.outputs[key] = out   # the last stage's loss unscaled: its backward starts from the chunk's share

    def _stage_output(self, action: Action, state: _StepState, inst: StageInstance, x: Payload) -> Payload:
        """The stage's output on ``x``; on the last stage the chunk's loss (unscaled)."""
        out = inst.module(x)
        if not self._last(action.stage):
            return out
        target = state.data.labels_for(self._rows(state, action.chunk), self.ctx.device, action.tile, self.grid)
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

    def _backward(self, action: Action, state: _StepState) -> None:
        if self._merged(action):
            self._backward_merged(action, state)
            return
        key = self._key(action)
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

    def _backward_weight(self, action: Action, state: _StepState) -> None:
        """W: the parameter gradients the micro-batch's I left (nothing when its stage is not split)."""
        work = state.weight_work.pop(self._key(action), None)
        if work is not None:
            work.run()

    def _send(self, action: Action, state: _StepState) -> int:
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

    def _recv(self, action: Action, state: _StepState, mailbox: Mailbox | None = None) -> int:
        peer = self._peer(action)
        if peer == self.ctx.rank:
            payload = state.loopback.pop(message_key(action))
        else:
            payload = (mailbox or self.mailbox).take(peer, message_key(action))
        state.inbox.setdefault((action.kind.carries_activation, self._key(action)), {})[peer] = payload
        return payload_bytes(payload)

    def _allreduce(self, action: Action) -> int:
        mine = self._stage_copies(action.stage)
        group = self.stage_groups.get(action.stage)
        if self.zero is not None and self.zero.reduces(action.stage):
            moved = self.zero.stages[action.stage].reduce_gradients()   # reduce-scatter into the shards
        elif self.reducer is not None and self.reducer.covers(action.stage):
            moved = self.reducer.finish(action.stage)   # buckets posted during backward: the rest, then wait
        else:
            moved = sum_stage_gradients(self.ctx, [i.module for i in mine], group,
                                        [i.silent_parameters() for i in mine])
        sync_running_stats(self.ctx, [i.ledger for i in mine], group)
        return moved

    def gradients_usable(self) -> bool:
        """fp16: unscale the gradients; False (step skipped on every rank) when any is not finite."""
        if self.scaler is None or self.optimizer is None:
            return True
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return self.scaler.unscale(self.ctx, params, self.ctx.device)

    def step_optimizer(self) -> None:
        """The optimizer's step when its gradients are usable, clipped first to ``max_grad_norm``; with ZeRO on the
        shards (level 1 takes their gradients from the summed whole ones), the weights gathered after (levels 1-2)."""
        if self.optimizer is None:
            return
        if self.zero is not None:
            self.zero.before_step()
        if self.gradients_usable():
            if self.max_grad_norm is not None:
                self.clip_gradients(self.max_grad_norm)
            self.optimizer.step()
        if self.zero is not None:
            self.zero.after_step()

    def clip_gradients(self, max_norm: float) -> float:
        """Scale the stepped gradients to global norm ``max_norm`` at most; every element counted once: a shard on
        its holder, a stage held whole on its lowest holder (one copy). Collective over the world; the norm."""
        assert self.optimizer is not None
        counted: list[torch.Tensor] = []
        for stage in sorted({s for _, s in self.instances}):
            if self.zero is not None and self.zero.covers(stage):
                counted += [p.grad for _, p in self.zero.stages[stage].named_shards() if p.grad is not None]
            elif self.ctx.rank == min(stage_holders(self.cfg, stage)):
                counted += [p.grad for p in self._stage_copies(stage)[0].canonical.parameters()
                            if p.requires_grad and p.grad is not None]
        scaled = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        return clip_by_global_norm(self.ctx, counted, scaled, max_norm)

    # --------------------------------------------------------------- evaluation
    def forward_only(self, data: StepInput, chunk_size: int) -> list[StageOutput]:
        """Evaluation with the training layout: this rank's forwards and activation transfers of
        the schedule, without autograd, the BatchNorm ledger, gradients or the optimizer.

        Returns this rank's last-stage outputs, each with its rows of the global batch and its tile (modules
        are run as they are: the caller puts them in eval mode). Dropping the backward, gradient
        and optimizer actions of a deadlock-free schedule keeps it deadlock-free: sends never
        block, and every receive's sender runs a subset of what it ran before.
        """
        state = _StepState(data, chunk_size, data.batch_size)
        results: list[StageOutput] = []
        self.forward_mailbox.begin()
        with torch.no_grad():
            for action in self.actions:
                kind = action.kind
                if kind is ActionKind.FORWARD:
                    with self._weights(action.stage):
                        out = self._instance(action).module(self._stage_input(action, state))
                    if self._last(action.stage):
                        results.append(StageOutput(self._rows(state, action.chunk), out, action.tile))
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
        return StepRun(self, _StepState(data, chunk_size, data.batch_size))

    def _traced(self, action: Action, state: _StepState) -> None:
        """Execute ``action``; with tracing on, one event for it (off: nothing but the check)."""
        tracer = self.ctx.tracer
        if not tracer.enabled:
            self._run[action.kind](action, state)
            return
        start = tracer.stamp()
        moved = self._run[action.kind](action, state)
        tracer.event(action.kind.value, start, tracer.stamp(), action.stage, action.micro_batch, action.replica,
                     action.peer, moved or 0, {"chunk": action.chunk, "copy": action.copy, "tick": action.tick})

    def _execute(self, action: Action, state: _StepState) -> int:
        """Run one action; the bytes it moved (sends, receives, all-reduces), else 0."""
        return self._run[action.kind](action, state) or 0

    def _allreduce_in(self, action: Action, state: _StepState) -> int:
        return self._allreduce(action)

    def _optimize(self, action: Action, state: _StepState) -> None:
        """OPTIM: every send of the step complete, then the optimizer's step (when its gradients are usable)."""
        self.ctx.wait_all(state.requests)
        state.requests.clear()
        for pending in state.act_sends.values():
            self.ctx.wait_all(pending)
        state.act_sends.clear()
        self.step_optimizer()


class StepRun:
    """One training step of one rank, executed action by action as it is iterated.

    ``next_action`` is the action the next iteration will execute (None when done);
    iterating executes it and yields it; ``loss_sum`` is this rank's loss share once done.
    """

    def __init__(self, runtime: PipelineRuntime, state: _StepState) -> None:
        self.runtime = runtime
        self.state = state
        self.order = runtime.order
        self.position = 0
        self.finished = False
        runtime.ctx.tracer.begin_step()
        runtime.mailbox.begin()
        for ledger in runtime.ledgers:
            ledger.begin_step()
        if runtime.reducer is not None:
            runtime.reducer.begin_step(runtime.passes)

    @property
    def next_action(self) -> Action | None:
        return self.order[self.position] if self.position < len(self.order) else None

    @property
    def loss_sum(self) -> float:
        return float(self.loss_share().item())

    def loss_share(self) -> torch.Tensor:
        """This rank's share of the step's loss so far (its chunks' losses times their share of the batch, summed
        in float64): a one-element tensor on the rank's device, made with no host sync."""
        state = self.state
        if not state.losses:
            return torch.zeros(1, dtype=torch.float64, device=self.runtime.ctx.device)
        shares = torch.stack(state.losses) * (state.chunk_size / state.batch_size)
        return shares.to(torch.float64).sum().reshape(1)

    def __iter__(self) -> StepRun:
        return self

    def __next__(self) -> Action:
        if self.position >= len(self.order):
            self._finish()
            raise StopIteration
        action = self.order[self.position]
        self.runtime._traced(action, self.state)
        self.position += 1
        return action

    def _finish(self) -> None:
        """The step's end (once): every send complete, every received payload used, the trace's step closed."""
        if self.finished:
            return
        runtime, state = self.runtime, self.state
        runtime.ctx.wait_all(state.requests)
        for pending in state.act_sends.values():
            runtime.ctx.wait_all(pending)
        runtime.mailbox.check_drained()
        runtime.ctx.tracer.end_step()
        self.finished = True
