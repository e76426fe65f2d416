"""Post-accumulate-grad hooks that tell an owner each parameter whose gradient backward accumulated, held by a weak
reference (a dropped owner's hooks do nothing and are removed with it)."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Protocol

import torch
from torch.utils.hooks import RemovableHandle


class Arrivals(Protocol):
    """What the hooks call: ``arrived(param)`` once backward has accumulated ``param.grad``."""

    def arrived(self, param: torch.Tensor) -> None: ...


def hook_arrivals(owner: Arrivals, params: Sequence[torch.Tensor]) -> list[RemovableHandle]:
    """One hook per parameter calling ``owner.arrived``; removed when ``owner`` is collected."""
    me = weakref.ref(owner)
    hooks = [p.register_post_accumulate_grad_hook(functools.partial(_arrival, me)) for p in params]
    weakref.finalize(owner, remove_hooks, list(hooks))
    return hooks


def _arrival(owner: weakref.ref[Arrivals], param: torch.Tensor) -> None:
    found = owner()
    if found is not None:
        found.arrived(param)


def remove_hooks(hooks: Sequence[RemovableHandle]) -> None:
    for hook in hooks:
        hook.remove()
