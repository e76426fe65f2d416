"""Recent results of a shape-only probe of a list of layers, kept while the same layer objects stay unchanged.

The pre-flight check, the engine and the planner ask the same questions of one model many times (the
planner's ``suggest`` asks the default cut of every candidate configuration, each probing the layers'
memory and tile fit on ``meta``). A probe's answer depends only on the layers and its key, so the last
few lists of layers keep their answers: held weakly (a model that is dropped frees its entries), and
checked by a brief of each layer (every module's type and settings, the parameters' shapes and dtypes), so a
layer changed in place (a stride set, a weight of another dtype, an activation swapped) is probed afresh.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch
from torch import nn

Value = TypeVar("Value")
ModuleBrief = tuple[type, str]                                  # a module's class and its ``extra_repr``
LayerBrief = tuple[tuple[tuple[ModuleBrief, ...], tuple[tuple[torch.Size, torch.dtype], ...]], ...]


def layer_brief(layers: Sequence[nn.Module]) -> LayerBrief:
    """Per layer: each of its modules' class and settings (``extra_repr``: kernel, stride, features, ...), and
    each parameter's shape and dtype (under a millisecond for a ViT-L's 540 modules)."""
    return tuple((tuple((type(m), m.extra_repr()) for m in layer.modules()),
                  tuple((p.shape, p.dtype) for p in layer.parameters())) for layer in layers)


@dataclass
class _Entry(Generic[Value]):
    """One list of layers (held weakly), its brief, and the answers found for it by key."""

    layers: tuple[weakref.ref[nn.Module], ...]
    brief: LayerBrief
    answers: dict[Hashable, Value] = field(default_factory=dict)

    def holds(self, layers: Sequence[nn.Module], brief: LayerBrief) -> bool:
        return (len(self.layers) == len(layers) and all(ref() is layer for ref, layer in zip(self.layers, layers))
                and self.brief == brief)


class LayerMemo(Generic[Value]):
    """The answers of one probe for the last ``lists`` lists of layers, up to ``answers`` keys each."""

    def __init__(self, lists: int = 4, answers: int = 256) -> None:
        self.lists = lists
        self.answers = answers
        self._entries: list[_Entry[Value]] = []

    def get(self, layers: Sequence[nn.Module], key: Hashable, probe: Callable[[], Value]) -> Value:
        """The answer for ``layers`` and ``key``: kept, or ``probe()`` (then kept)."""
        brief = layer_brief(layers)
        entry = next((e for e in self._entries if e.holds(layers, brief)), None)
        if entry is None:
            entry = _Entry(tuple(weakref.ref(layer) for layer in layers), brief)
        else:
            self._entries.remove(entry)
        self._entries.insert(0, entry)
        del self._entries[self.lists:]
        if key not in entry.answers:
            if len(entry.answers) >= self.answers:
                entry.answers.pop(next(iter(entry.answers)))
            entry.answers[key] = probe()
        return entry.answers[key]

    def clear(self) -> None:
        self._entries.clear()
