"""Per-rank peak memory of inference: heap bytes in use (glibc ``mallinfo2``) sampled after every layer and read.

Inference keeps no autograd graph, so the training meter (bytes saved for backward) sees
nothing. What bounds a rank is everything it holds at once: the window's input, the
activations alive between layers, halo strips, the prefetched next window, the output
pieces. ``mallinfo2`` counts exactly the heap bytes in use (all threads' arenas and mmapped
blocks), whoever allocated them; it is sampled after every leaf module's forward and every
read, so a peak inside one operator (e.g. a convolution's workspace) may be missed. On CUDA
the caching allocator's peak is used instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable, Iterable
from typing import cast

import torch
from torch import nn


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        func = ctypes.CDLL(name).mallinfo2
    except (OSError, AttributeError):   # not glibc >= 2.33
        return None
    func.restype = _MallInfo2
    return cast(Callable[[], _MallInfo2], func)


_MALLINFO = _mallinfo2()


def heap_in_use() -> int | None:
    """Bytes this process' malloc has handed out and not got back (None off glibc). Beside anonymous RSS
    (``usage.anon_rss_bytes``): RSS growing while this stays flat is the allocator's free space (a higher heap top
    kept: no trimming under the ranks' tuned malloc, ``comm/allocator.py``), not a leak."""
    if _MALLINFO is None:
        return None
    info = _MALLINFO()
    return int(info.uordblks + info.hblkhd)


class PeakMeter:
    """Peak memory above a baseline, from samples; ``source`` says what was measured."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.source = "cuda-allocator" if self.cuda else ("heap" if _MALLINFO is not None else "none")
        self.baseline = 0
        self.peak = 0
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def start(self) -> None:
        """Take the baseline (what is already held: the model, the libraries) and reset the peak."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = int(torch.cuda.memory_allocated(self.device))
        else:
            self.baseline = heap_in_use() or 0
        self.peak = 0

    def sample(self) -> None:
        if self.cuda:
            self.peak = max(self.peak, int(torch.cuda.max_memory_allocated(self.device)) - self.baseline)
            return
        used = heap_in_use()
        if used is not None:
            self.peak = max(self.peak, used - self.baseline)

    def watch(self, modules: Iterable[nn.Module]) -> None:
        """Sample after the forward of every leaf module."""
        for module in modules:
            if not any(True for _ in module.children()):
                self._handles.append(module.register_forward_hook(lambda *args: self.sample()))

    def unwatch(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (an inference rank's resident state; a training rank's, with
    gradients and optimizer state: measure/usage.py's state_bytes)."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
