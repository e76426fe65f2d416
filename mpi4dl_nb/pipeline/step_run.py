"""One training step of one rank, executed action by action as it is iterated (what the stepper drives)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from ..comm.messages import Mailbox
from ..comm.protocol import Comm
from .actions import Action
from .bn_replay import RunningStatsLedger
from .grad_buckets import GradientReducer
from .step_state import StepState


class StepDriver(Protocol):
    """What a step asks of the runtime executing it (``runtime.PipelineRuntime``)."""

    ctx: Comm
    mailbox: Mailbox
    reducer: GradientReducer | None
    order: tuple[Action, ...]

    @property
    def ledgers(self) -> Sequence[RunningStatsLedger]: ...

    @property
    def passes(self) -> Mapping[int, Sequence[int]]: ...

    def traced(self, action: Action, state: StepState) -> None: ...


class StepRun:
    """One training step of one rank, executed action by action as it is iterated.

    ``next_action`` is the action the next iteration will execute (None when done);
    iterating executes it and yields it; ``loss_sum`` is this rank's loss share once done.
    """

    def __init__(self, runtime: StepDriver, state: StepState) -> None:
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
        self.runtime.traced(action, self.state)
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
