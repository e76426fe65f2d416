"""Allocations: a dispatch mode recording the element count of every tensor an op returns (forward and backward),
to check that attention never makes a tensor as large as its full score matrix; ``ActivationProfile``: the live
bytes of a forward and backward (``planner.live_bytes``), what stays held after the forward per module, and the
largest matrix any op made."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mpi4dl_nb.planner.live_bytes import LiveBytes


class Allocations(TorchDispatchMode):
    """The element counts of every tensor an op returns while active (the first use imports torch._dynamo)."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(value, torch.Tensor):
                self.numels.append(value.numel())
        return result

    @property
    def largest(self) -> int:
        return max(self.numels, default=0)


def matrix_of(shape: Sequence[int]) -> tuple[int, int]:
    """The trailing matrix of a shape (rows, columns): a score tensor (B, H, n_q, n_k)'s ``(n_q, n_k)``."""
    return (int(shape[-2]), int(shape[-1])) if len(shape) >= 2 else (1, int(shape[0]) if shape else 1)


class _MatrixRecorder(LiveBytes):
    """LiveBytes that also keeps the largest trailing matrix of any op's output."""

    def __init__(self) -> None:
        super().__init__()
        self.largest_matrix = (0, 0)
        self.largest_square = 0
        self.largest_numel = 0

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: Collection[type],
                           args: Sequence[object] = (), kwargs: Mapping[str, object] | None = None) -> object:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                rows, cols = matrix_of(t.shape)
                if rows * cols > self.largest_matrix[0] * self.largest_matrix[1]:
                    self.largest_matrix = (rows, cols)
                self.largest_square = max(self.largest_square, min(rows, cols))
                self.largest_numel = max(self.largest_numel, t.numel())
        return out


@dataclass(frozen=True)
class ActivationProfile:
    """One forward + backward on this rank, in bytes of storages made during it (weights, gradients made before
    and the inputs left out): ``held`` after the forward (saved for backward and the output), of which
    ``held_by[name]`` by the modules named (made while they ran and still held); ``peak`` over forward and
    backward; the largest trailing matrix (rows, columns) of any op's output, the side of the largest square
    within one (an n x n score matrix has ``n``), and the largest element count."""

    held: int
    held_by: dict[str, int]
    peak: int
    largest_matrix: tuple[int, int]
    largest_square: int
    largest_numel: int


def profile_activations(model: nn.Module, run: Callable[[], torch.Tensor],
                        modules: Sequence[str] = ()) -> ActivationProfile:
    """``run()`` (a forward of ``model``) and the backward of its sum, profiled; every parameter's gradient is
    made (zeros) first, so backward accumulates into it in place and the peak counts activations and work."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    recorder = _MatrixRecorder()
    hooks = [hook for name in modules for hook in _tagging(model.get_submodule(name), name, recorder)]
    try:
        with recorder:
            out = run()
            held, held_by = recorder.current, recorder.by_tag()
            out.sum().backward()
    finally:
        for hook in hooks:
            hook.remove()
    held_by.pop("", None)
    return ActivationProfile(held, held_by, recorder.peak, recorder.largest_matrix, recorder.largest_square,
                             recorder.largest_numel)


def _tagging(module: nn.Module, name: str, recorder: LiveBytes) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks that charge what ``module``'s forward makes to ``name`` (not what its backward makes)."""
    def enter(*_: object) -> None:
        if torch.is_grad_enabled():
            recorder.tag = name

    def leave(*_: object) -> None:
        recorder.tag = ""

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
