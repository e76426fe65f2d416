"""One training step's state on this rank, and how its payloads between ranks are named, paired and ordered."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..comm.handles import Channel, Request
from ..comm.messages import Mailbox, Payload, as_items, like
from ..comm.protocol import Comm
from .actions import Action
from .handoff import JoinedTiles
from .schedules import Schedule
from .split_backward import LayerCall, WeightWork
from .step_input import StepInput

Key = tuple[int, int, int, int]   # (replica, stage, micro_batch, copy)
MessageKey = tuple[bool, int, int, int, int, int]   # (activation?, dp, replica, sender stage, micro-batch, copy)


@dataclass
class StepState:
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


def leaf(payload: Payload) -> Payload:
    """A detached copy of ``payload`` whose float tensors require grad."""
    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.requires_grad_(True) if t.is_floating_point() else t
    return like(payload, [one(t) for t in as_items(payload)])


def rows(state: StepState, chunk: int, count: int = 1) -> slice:
    """The rows of the global batch of ``count`` chunks from chunk ``chunk``."""
    return slice(chunk * state.chunk_size, (chunk + count) * state.chunk_size)


def open_mailboxes(ctx: Comm, schedule: Schedule) -> tuple[dict[int, Channel], Mailbox, Mailbox]:
    """This rank's outbound channels by receiver, and its mailboxes for a step and for an evaluation's round (the
    activations only). One-way channels carry the payloads (own process groups on the torch plane; made
    collectively, the same pairs everywhere); receives take each channel in send order."""
    channels = ctx.channels(channel_pairs(schedule))
    me = ctx.rank
    outbound = {dst: c for (src, dst), c in channels.items() if src == me}
    inbound: dict[int, Channel | None] = {src: c for (src, dst), c in channels.items() if dst == me}
    return (outbound, Mailbox(ctx, ctx.device, inbound_order(schedule, me), inbound),
            Mailbox(ctx, ctx.device, inbound_order(schedule, me, True), inbound))
