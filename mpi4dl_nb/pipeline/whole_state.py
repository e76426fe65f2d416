"""The whole model's state across the ranks holding its stages: gathered to rank 0, scattered back to the holders."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

import torch

from ..comm.protocol import Comm
from ..config import ParallelConfig
from ..layout import RankRole, stage_holders
from ..sharding.seam import Sharding
from .stage_instance import StageInstance
from .stages import Stage

T = TypeVar("T")   # a value of a whole-model key (a tensor, an optimizer state entry)


class WholeState:
    """The state dict of ``nn.Sequential(*layers)`` cut into ``stages`` on ``cfg``'s ranks (``roles``), this rank
    holding ``instances``; ``sharding``: ZeRO's seam (whole weights gathered while read or loaded)."""

    def __init__(self, ctx: Comm, cfg: ParallelConfig, roles: Sequence[RankRole], stages: Sequence[Stage],
                 instances: Mapping[tuple[int, int], StageInstance], sharding: Sharding) -> None:
        self.ctx, self.cfg, self.roles, self.stages = ctx, cfg, roles, stages
        self.instances, self.sharding = instances, sharding

    def owned(self) -> list[StageInstance]:
        """Instances whose stage this rank reports (lowest holder rank, primary first)."""
        return [self.instances.get((0, s)) or self.instances[(1, s)] for s in range(self.cfg.split_size)
                if min(stage_holders(self.cfg, s)) == self.ctx.rank]

    def gathered(self) -> dict[str, torch.Tensor] | None:
        """On rank 0 the whole model's state dict (CPU tensors); None elsewhere. Collective."""
        with self.sharding.whole_weights():
            parts = {inst.stage: inst.canonical.full_state_dict() for inst in self.owned()}
        gathered = self.ctx.gather_object(parts, root=0)
        if gathered is None:
            return None
        merged: dict[int, dict[str, torch.Tensor]] = {}
        for piece in gathered:
            merged.update(piece)
        return {key: value for s in sorted(merged) for key, value in merged[s].items()}

    def load(self, state: dict[str, torch.Tensor] | None) -> None:
        """Inverse of ``gathered``: ``state`` on rank 0; each holder receives only its stages. Collective."""
        missing = None
        if self.ctx.rank == 0:
            if state is None:
                missing = "no state dict on rank 0"
            else:
                lacking = [k for k in self.keys() if k not in state]
                missing = f"the state dict lacks {lacking[:4]}" if lacking else None
        mine = self.scatter(state if missing is None else {}, error=missing)
        with self.sharding.whole_weights():   # ZeRO's shards refreshed from the loaded weights after
            for inst in self.instances.values():
                inst.canonical.load_from_full(mine)

    def keys(self, stages: Iterable[int] | None = None) -> list[str]:
        """Whole-model state-dict keys of ``stages`` (default all), known on every rank."""
        chosen = range(len(self.stages)) if stages is None else stages
        return [self.stages[s].full_key(k) for s in chosen for k in self.stages[s].state_dict()]

    def stage_of(self, key: str) -> int | None:
        """The stage holding whole-model key ``key`` (``'<layer>.<rest>'``); None if no layer has it."""
        head = key.partition(".")[0]
        if not head.isdigit():
            return None
        layer = int(head)
        return next((stage.index for stage in self.stages if stage.offset <= layer < stage.offset + len(stage)), None)

    def scatter(self, entries: Mapping[str, T] | None, error: str | None = None) -> dict[str, T]:
        """Collective: rank 0's ``entries`` (whole-model keys) split so each rank gets its stages' keys. ``error``
        (decided on rank 0) is raised as ValueError on every rank instead."""
        pieces: list[tuple[str | None, dict[str, T]]] | None = None
        if self.ctx.rank == 0:
            holds = [set(role.stages) for role in self.roles]
            pieces = [(error, {}) for _ in holds]
            for key, value in (entries or {}).items() if error is None else ():
                stage = self.stage_of(key)   # keys of no layer are ignored, as by load
                for rank, stages in enumerate(holds):
                    if stage in stages:
                        pieces[rank][1][key] = value
        error, mine = self.ctx.scatter_object(pieces)
        if error is not None:
            raise ValueError(f"load_full_state_dict: {error}")
        return mine
