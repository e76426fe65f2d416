"""Optimizer state in a checkpoint: gathered by whole-model parameter name to rank 0, and scattered back to the
holders of each stage on load, so a run may resume on another layout (ZeRO's shards joined whole and cut again)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .record import OptimizerState

if TYPE_CHECKING:
    from ..comm.protocol import Comm
    from ..pipeline.engine import HybridEngine


def _portable(value: object) -> object:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def gather_optimizer_state(engine: HybridEngine, ctx: Comm) -> OptimizerState | None:
    """Per-parameter optimizer state keyed by whole-model parameter name, on rank 0 (collective).

    Names make it independent of the parallel layout: a run may resume on another one. ZeRO's shards of a parameter's
    state are joined whole on the stage's lowest holder first (``sharding/sharded_stage.py``): the same format.
    """
    optimizer = engine.optimizer
    mine: OptimizerState = engine.zero.full_optimizer_entries(optimizer)
    if optimizer is not None:
        for inst in engine.owned_stages():
            for name, param in inst.canonical.named_parameters():
                state = optimizer.state.get(param)
                if state:
                    mine[inst.canonical.full_key(name)] = {k: _portable(v) for k, v in state.items()}
    gathered = ctx.gather_object(mine, root=0)
    if gathered is None:
        return None
    merged: OptimizerState = {}
    for part in gathered:
        merged.update(part)
    return merged


def load_optimizer_state(engine: HybridEngine, ctx: Comm, state: OptimizerState | None) -> None:
    """Inverse of :func:`gather_optimizer_state`: each holder receives its stages' entries of rank 0's ``state``."""
    state = engine.scatter_to_holders(state if ctx.rank == 0 else None)
    optimizer = engine.optimizer
    if optimizer is None or not state:
        return
    engine.zero.load_optimizer_entries(optimizer, state)
    sharded = engine.zero.sharded_ids()
    for inst in engine.instances.values():
        for name, param in inst.canonical.named_parameters():
            entry = state.get(inst.canonical.full_key(name))
            if entry is not None and id(param) not in sharded:
                optimizer.state[param] = {k: _placed(k, v, param) for k, v in entry.items()}


def _placed(key: str, value: object, param: torch.Tensor) -> object:
    """An optimizer state entry on its parameter's device and dtype (step counters stay as saved)."""
    if not isinstance(value, torch.Tensor) or key == "step":
        return value.clone() if isinstance(value, torch.Tensor) else value
    return value.to(param.device, param.dtype)
