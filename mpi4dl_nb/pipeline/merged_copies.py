"""sync_batchnorm on a spatial stage with local-DP copies: the copies' chunks of a micro-batch run as one batch, its
forward at copy 0's forward action and its backward at the last copy's."""

from __future__ import annotations

import torch

from ..comm.messages import as_items, like
from ..comm.protocol import Comm
from ..config import ParallelConfig
from ..spatial.geometry import TileGrid
from .actions import Action
from .precision import autocast
from .schedules import chunk_index
from .stage_instance import StageInstance
from .step_state import Key, StepState, leaf, rows


class MergedCopies:
    """The merged forward and backward of a spatial stage's local-DP copies (``applies``), and the key every
    forward records its BatchNorm terms under (``stats_key``)."""

    def __init__(self, cfg: ParallelConfig, ctx: Comm, grid: TileGrid | None) -> None:
        self.cfg, self.ctx, self.grid = cfg, ctx, grid

    def applies(self, action: Action) -> bool:
        return self.cfg.sync_batchnorm and action.stage < self.cfg.spatial_size and self.cfg.local_dp > 1

    def stats_key(self, action: Action) -> int:
        """The key a forward's BatchNorm terms are recorded under: its chunk, or with sync_batchnorm the first chunk
        of the micro-batch (every synchronised copy records the same statistics under it, so they count once)."""
        if not self.cfg.sync_batchnorm:
            return action.chunk
        return chunk_index(self.cfg, 0, action.replica, action.micro_batch, 0)

    def _copy_keys(self, action: Action) -> list[Key]:
        return [(action.replica, action.stage, action.micro_batch, k) for k in range(self.cfg.local_dp)]

    def forward(self, action: Action, state: StepState, inst: StageInstance) -> None:
        if action.copy != 0:
            return   # copy 0's forward produced every copy's output
        keys = self._copy_keys(action)
        if action.stage == 0:
            x = state.data.images_for(rows(state, action.chunk, len(keys)), action.tile, self.grid, self.ctx.device)
        else:
            parts = [next(iter(state.inbox.pop((True, key)).values())) for key in keys]
            x = leaf(like(parts[0], [torch.cat(items) for items in zip(*map(as_items, parts))]))
        with inst.ledger.chunk(self.stats_key(action)), autocast(self.cfg.precision, self.ctx.device):
            out = inst.module(x)
        state.merged[keys[0][:3]] = (x, out)
        size = state.chunk_size
        for k, key in enumerate(keys):
            state.outputs[key] = like(out, [o[k * size:(k + 1) * size] for o in as_items(out)])

    def backward(self, action: Action, state: StepState, key: Key) -> None:
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
