"""ZeRO stage 3 layer by layer: hooks gather a layer's weights before its forward and backward, free them after."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .sharded_stage import ShardedStage


class _LayerUnit:
    """The hooks of unit ``index`` of ``stage`` (one layer: a child of the stage's module).

    Forward: gathered by a forward pre-hook, the next unit prefetched (gathered right after, before this one
    computes), freed by the forward hook, which hooks the outputs' gradients. Backward: the first output gradient
    gathers it again (and prefetches the unit before); it is freed once each of its trained parameters' gradient has
    been accumulated (``register_post_accumulate_grad_hook``). A recomputed forward (``recompute.py``, inside the
    backward) gathers without prefetching and leaves the layer gathered for its backward, so a segment's layers are
    present together until each one's backward; whatever a hook left gathered is freed at the end of the runtime's
    action."""

    def __init__(self, stage: ShardedStage, index: int) -> None:
        self.stage, self.index = stage, index
        self.trained = {id(stage.params[i]) for i in stage.units[index] if stage.params[i].requires_grad}
        self.pending: set[int] = set()

    def before_forward(self, module: nn.Module, args: object) -> None:
        self.stage.gather_unit(self.index)
        if self.index + 1 < len(self.stage.units) and not _in_backward():
            self.stage.gather_unit(self.index + 1)

    def after_forward(self, module: nn.Module, args: object, output: object) -> None:
        items = output if isinstance(output, (tuple, list)) else (output,)
        for item in items:
            if isinstance(item, torch.Tensor) and item.requires_grad:
                item.register_hook(self.before_backward)
        if not _in_backward():   # a recomputed forward's layer stays gathered for its backward, which follows
            self.stage.release_unit(self.index)

    def before_backward(self, grad: torch.Tensor) -> None:
        if not self.pending or not self.stage.present[self.index]:   # not for each output of one backward
            self.pending = set(self.trained)
        self.stage.gather_unit(self.index)
        if self.index > 0:
            self.stage.gather_unit(self.index - 1)

    def after_accumulate(self, param: torch.Tensor) -> None:
        if id(param) in self.pending:
            self.pending.discard(id(param))
            if not self.pending:
                self.stage.release_unit(self.index)


def _in_backward() -> bool:
    """Whether autograd's backward is running on this thread (a recomputed forward, ``recompute.py``)."""
    return torch._C._current_graph_task_id() != -1


def layer_units(stage: ShardedStage, module: nn.Module) -> list[tuple[nn.Module, list[int]]] | None:
    """``module``'s children that hold ``stage``'s parameters, each with their indices, in order; None when they do
    not split the stage cleanly (not an ``nn.Sequential``, a parameter in two children or in none)."""
    if not isinstance(module, nn.Sequential):
        return None
    where = {id(p): i for i, p in enumerate(stage.params)}
    units: list[tuple[nn.Module, list[int]]] = []
    seen: set[int] = set()
    for child in module.children():
        indices = sorted({where[id(p)] for p in child.parameters() if id(p) in where})
        if seen.intersection(indices):
            return None
        seen.update(indices)
        if indices:
            units.append((child, indices))
    return units if len(seen) == len(stage.params) else None


def gather_layer_by_layer(stage: ShardedStage, module: nn.Module) -> list[RemovableHandle]:
    """ZeRO stage 3: hook ``module`` (the stage's module as it runs: tiles, recomputation) so that ``stage``'s weights
    are gathered one layer at a time; the handles (none when the layers do not split the stage, which then stays
    gathered whole per action). Call while the stage's weights are freed."""
    units = layer_units(stage, module)
    if units is None or not stage.zero_stage.shards_weights:
        return []
    stage.set_units([indices for _, indices in units])
    stage.layered = True
    handles: list[RemovableHandle] = []
    for index, (child, indices) in enumerate(units):
        unit = _LayerUnit(stage, index)
        handles += [child.register_forward_pre_hook(unit.before_forward),
                    child.register_forward_hook(unit.after_forward)]
        handles += _accumulate_hooks(unit, [stage.params[i] for i in indices])
    return handles


def _accumulate_hooks(unit: _LayerUnit, params: Sequence[nn.Parameter]) -> list[RemovableHandle]:
    return [p.register_post_accumulate_grad_hook(unit.after_accumulate) for p in params if p.requires_grad]
