"""One copy of one stage on this rank: the plain stage, the module that runs it, its tile and BatchNorm ledger."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from ..comm.handles import Group
from .bn_replay import RunningStatsLedger
from .stages import Stage


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


def silent_of(copies: list[StageInstance]) -> Callable[[], list[set[int]]]:
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
