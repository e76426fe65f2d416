"""What one rank does at one tick of a schedule: the action kinds and the ``Action`` record (plain data)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Choice


class ActionKind(Choice):
    """What an Action does. Values are the short names tables and traces show (``F``, ``B`` ...)."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"       # split backward: the stage input's gradient only (zero-bubble schedules)
    BACKWARD_WEIGHT = "W"      # split backward: the parameter gradients, deferred (zero-bubble schedules)
    SEND_ACT = "SEND_ACT"      # send a stage output to the next stage
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"    # send an input gradient back to the previous stage
    RECV_GRAD = "RECV_GRAD"
    ALLREDUCE = "ALLREDUCE"    # sum a stage's gradients (and BatchNorm terms) over its holders
    OPTIM = "OPTIM"            # optimizer step

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS

    @property
    def is_p2p(self) -> bool:
        return self in P2P_KINDS

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)

    @property
    def carries_activation(self) -> bool:
        """Whether a send/receive moves an activation (else a gradient)."""
        return self in (ActionKind.SEND_ACT, ActionKind.RECV_ACT)


COMPUTE_KINDS = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
GRADIENT_KINDS = (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)   # the backwards that send an input gradient
P2P_KINDS = (ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD, ActionKind.RECV_GRAD)
KINDS = tuple(ActionKind)


@dataclass(frozen=True)
class Action:
    """One thing one rank does at one tick.

    ``kind``: an ActionKind (F, B, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD, ALLREDUCE, OPTIM).
    ``replica``: GEMS direction (0 primary, 1 mirror); ``dp``: full data-parallel replica;
    ``copy``: local-DP copy (which chunk of the micro-batch); ``chunk``: global chunk index
    (see ``schedules``' module docstring); ``peer``: the other rank of a send/receive; ``group``: the
    ranks of a collective; ``tile``: this rank's tile for a spatial stage, else None.
    """

    kind: ActionKind
    rank: int
    tick: int
    stage: int = -1
    micro_batch: int = -1
    replica: int = 0
    copy: int = 0
    dp: int = 0
    chunk: int = -1
    peer: int | None = None
    tag: int = 0
    group: tuple[int, ...] = ()
    tile: int | None = None

    def label(self, local_dp: int = 1, show_stage: bool = False) -> str:
        """Short text for tables: ``F2``, ``B0.1'``, ``F1@s3`` (``show_stage``), ``AR``, ``OPT``, ``>3 act``."""
        if self.kind.is_compute:
            text = f"{self.kind}{self.micro_batch}"
            if local_dp > 1:
                text += f".{self.copy}"
            return text + ("'" if self.replica else "") + (f"@s{self.stage}" if show_stage else "")
        if self.kind is ActionKind.ALLREDUCE:
            return "AR"
        if self.kind is ActionKind.OPTIM:
            return "OPT"
        arrow = ">" if self.kind.is_send else "<"
        what = "act" if self.kind.carries_activation else "grad"
        return f"{arrow}{self.peer} {what} {self.micro_batch}" + ("'" if self.replica else "")

    def describe(self) -> str:
        """One readable sentence (for the step-through widget and logs)."""
        who = f"rank {self.rank} tick {self.tick}: "
        mirror = " (mirror)" if self.replica else ""
        if self.kind.is_compute:
            verb = VERBS[self.kind]
            return (who + f"{verb} stage {self.stage}{mirror} micro-batch {self.micro_batch}"
                    f" copy {self.copy} (chunk {self.chunk})")
        if self.kind.is_p2p:
            verb, direction = ("send", "to") if self.kind.is_send else ("recv", "from")
            noun = "activation" if self.kind.carries_activation else "gradient"
            return (who + f"{verb} {noun} of stage {self.stage}{mirror} micro-batch "
                    f"{self.micro_batch} copy {self.copy} {direction} rank {self.peer}")
        if self.kind is ActionKind.ALLREDUCE:
            return who + f"all-reduce stage {self.stage} gradients over ranks {list(self.group)}"
        return who + "optimizer step"


VERBS = {ActionKind.FORWARD: "forward", ActionKind.BACKWARD: "backward",
         ActionKind.BACKWARD_INPUT: "input-gradient backward", ActionKind.BACKWARD_WEIGHT: "weight-gradient backward"}
