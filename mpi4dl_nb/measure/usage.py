"""Per-rank metrics: peak memory (CUDA allocator, or counted tensor bytes on CPU) and compute vs communication time."""
from __future__ import annotations

import gc
import os
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..comm.trace import comm_seconds, is_communication

__all__ = ["ActivationMeter", "RunMetrics", "comm_seconds", "cuda_peak_bytes", "growth_per_step",
           "is_communication", "live_tensor_bytes", "rss_bytes", "state_bytes", "storage_key",
           "tensor_bytes"]

RECENT_STEPS = 1000   # per-step values RunMetrics keeps (totals cover every step)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """Identity of the memory behind ``t`` (shared by views)."""
    try:
        storage = t.untyped_storage()
        return (storage.data_ptr(), storage.nbytes())
    except (RuntimeError, NotImplementedError):   # tensors without storage (e.g. sparse)
        return (id(t), tensor_bytes(t))


class _Saved:
    """A tensor saved for backward; releases its count when autograd drops it."""

    __slots__ = ("tensor", "meter", "key", "__weakref__")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter, key: tuple[int, int]) -> None:
        self.tensor = tensor
        self.meter = meter
        self.key = key

    def __del__(self) -> None:
        self.meter._release(self.key)


class ActivationMeter:
    """Counts the bytes autograd keeps for backward (each storage once) and their peak.

    ``with meter:`` installs ``torch.autograd.graph.saved_tensors_hooks`` for the forward pass;
    the count falls again as backward frees the graph. Parameters saved by a layer are excluded
    (they are counted by :func:`state_bytes`).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._lock = threading.Lock()
        self._refs: dict[tuple[int, int], int] = {}
        self.current = 0
        self.peak = 0
        self._exclude = {storage_key(t) for t in exclude}
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _Saved:
        key = storage_key(t)
        if key in self._exclude or t.device.type == "meta":
            return t
        with self._lock:
            count = self._refs.get(key, 0)
            if count == 0:
                self.current += key[1]
                self.peak = max(self.peak, self.current)
            self._refs[key] = count + 1
        # detached: a node saving its own output would otherwise hold itself through the tensor's grad_fn,
        # a cycle no garbage collection sees, kept once a backward retains the graph (zero-bubble's I)
        return _Saved(t.detach(), self, key)

    @staticmethod
    def _unpack(packed: torch.Tensor | _Saved) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key: tuple[int, int]) -> None:
        with self._lock:
            count = self._refs.get(key, 0) - 1
            if count <= 0:
                self._refs.pop(key, None)
                self.current -= key[1]
            else:
                self._refs[key] = count

    def reset_peak(self) -> None:
        self.peak = self.current

    def __enter__(self) -> ActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
        self._hooks = None


def state_bytes(parameters: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None = None,
                buffers: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of parameters, their gradients, buffers and optimizer state tensors."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor):
            key = storage_key(t)
            if key not in seen:
                seen.add(key)
                total += key[1]

    for p in parameters:
        add(p)
        add(p.grad)
    for b in buffers:
        add(b)
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                add(value)
    return total


def cuda_peak_bytes(device: torch.device) -> int | None:
    """The CUDA caching allocator's peak for ``device``, or None off CUDA."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


@dataclass
class RunMetrics:
    """Time and loss totals one rank accumulates over training steps, in constant memory.

    Totals cover every step; per-step values (``losses``, ``step_seconds``) are kept for the
    last ``keep`` steps only, so a run of any length holds the same few kilobytes.
    """

    steps: int = 0
    images: int = 0
    seconds: float = 0.0
    comm_seconds: float = 0.0
    first_step_seconds: float = 0.0
    keep: int = RECENT_STEPS
    _losses: deque[float] = field(default_factory=deque, repr=False)
    _step_seconds: deque[float] = field(default_factory=deque, repr=False)

    def __post_init__(self) -> None:
        self._losses = deque(self._losses, maxlen=self.keep)
        self._step_seconds = deque(self._step_seconds, maxlen=self.keep)

    def add_step(self, images: int, seconds: float, comm: float, loss: float) -> None:
        if self.steps == 0:
            self.first_step_seconds = seconds
        self.steps += 1
        self.images += images
        self.seconds += seconds
        self.comm_seconds += min(comm, seconds)
        self._losses.append(loss)
        self._step_seconds.append(seconds)

    @property
    def losses(self) -> list[float]:
        """Losses of the last ``keep`` steps, oldest first."""
        return list(self._losses)

    @property
    def step_seconds(self) -> list[float]:
        """Durations of the last ``keep`` steps, oldest first."""
        return list(self._step_seconds)

    @property
    def last_loss(self) -> float | None:
        return self._losses[-1] if self._losses else None

    def seconds_after(self, warmup_steps: int) -> float:
        """Seconds of every step but the first ``warmup_steps`` (0 or 1)."""
        if warmup_steps not in (0, 1):
            raise ValueError(f"warmup_steps={warmup_steps}: 0 or 1 (only the first step is kept apart)")
        return self.seconds - (self.first_step_seconds if warmup_steps and self.steps else 0.0)

    @property
    def compute_seconds(self) -> float:
        return max(0.0, self.seconds - self.comm_seconds)

    def as_dict(self) -> dict[str, float]:
        return {"steps": self.steps, "images": self.images, "seconds": self.seconds,
                "compute_seconds": self.compute_seconds, "comm_seconds": self.comm_seconds}


def rss_bytes() -> int | None:
    """This process's resident memory now (Linux ``/proc/self/statm``), None where unknown."""
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def anon_rss_bytes() -> int | None:
    """This process's resident anonymous memory now (Linux ``RssAnon``: the heap, tensors, what a leak grows;
    without the shared libraries' file pages, which the kernel drops and faults back in as the machine's memory
    pressure comes and goes), None where unknown."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage the garbage collector can reach (each storage once; slow)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta":   # type(): no __class__
            key = storage_key(obj)
            if key not in seen:
                seen.add(key)
                total += key[1]
    return total


def growth_per_step(samples: Sequence[tuple[int, float]]) -> float:
    """Least-squares slope of ``(step, value)`` samples: the value's growth per step."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mean_x = sum(x for x, _ in samples) / n
    mean_y = sum(y for _, y in samples) / n
    spread = sum((x - mean_x) ** 2 for x, _ in samples)
    if spread == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in samples) / spread
