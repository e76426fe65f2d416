"""LiveBytes: the bytes of tensor storages created under it that are still alive, and their peak.

A ``TorchDispatchMode`` sees every operator's outputs, on any device - ``meta`` included,
so a model runs shape-only and its memory is still counted. Each new storage is charged
once (views share it), with the current ``tag`` (e.g. the layer running), and released
when the storage dies (a weak reference on it). Storages that existed before are not
counted, nor their release. This is how the planner counts what a stage allocates,
forward and backward, without allocating it.

Storages marked *fixed* (``mark_fixed``: a backend's scratch that does not grow with the batch,
e.g. reordered weights) are counted too, and ``fixed_at_peak`` says how many of the peak's bytes
they were, so a one-sample simulation can be scaled to a batch (``LayerFootprint.times``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def storage_of(t: torch.Tensor) -> tuple[int, int]:
    """(identity, bytes) of the storage behind ``t``."""
    storage = t.untyped_storage()
    return storage._cdata, storage.nbytes()


def _storage_id(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


FIXED = "fixed"                  # the tag of storages that do not grow with the batch
_ACTIVE = threading.local()      # per thread: the counters entered, innermost last


class LiveBytes(TorchDispatchMode):
    """Counts live bytes of the storages operators create while it is active (thread-local)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._live: dict[int, tuple[int, str]] = {}     # storage id -> (bytes, tag)
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.current = 0
        self.peak = 0
        self.tag = ""
        self.fixed = 0              # live bytes marked fixed
        self.fixed_at_peak = 0      # of them, at the peak moment

    # ------------------------------------------------------------ the active counter
    def __enter__(self) -> LiveBytes:
        _ACTIVE.stack = [*getattr(_ACTIVE, "stack", []), self]
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        _ACTIVE.stack = getattr(_ACTIVE, "stack", [])[:-1]

    @staticmethod
    def active() -> LiveBytes | None:
        """The counter this thread runs under (the innermost), if any."""
        stack = getattr(_ACTIVE, "stack", [])
        return stack[-1] if stack else None

    # ------------------------------------------------------------------ charging
    def _charge(self, t: torch.Tensor) -> None:
        try:
            key, nbytes = storage_of(t)
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):   # tensors without a storage
            return
        with self._lock:
            if key in self._live or nbytes == 0:
                return
            self._live[key] = (nbytes, self.tag)
            self.current += nbytes
            if self.current > self.peak:
                self.peak, self.fixed_at_peak = self.current, self.fixed
        self._refs[key] = weakref.ref(storage, self._release_callback(key))

    def _release_callback(self, key: int) -> Callable[[weakref.ref[torch.UntypedStorage]], None]:
        def release(_: weakref.ref[torch.UntypedStorage]) -> None:
            with self._lock:
                entry = self._live.pop(key, None)
                if entry is not None:
                    self.current -= entry[0]
                    if entry[1] == FIXED:
                        self.fixed -= entry[0]
                self._refs.pop(key, None)
        return release

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: Collection[type],
                           args: Sequence[object] = (), kwargs: Mapping[str, object] | None = None) -> object:
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and _storage_id(t) not in inputs:   # not in place, not a view
                self._charge(t)
        return out

    # ----------------------------------------------------------------- queries
    def retag(self, t: torch.Tensor, tag: str) -> None:
        """Charge ``t``'s storage to ``tag`` (if this counter created it)."""
        key, _ = storage_of(t)
        with self._lock:
            if key in self._live:
                nbytes, old = self._live[key]
                self._live[key] = (nbytes, tag)
                self.fixed += nbytes * ((tag == FIXED) - (old == FIXED))
                if self.current == self.peak:   # the peak moment is now
                    self.fixed_at_peak = self.fixed

    def mark_fixed(self, t: torch.Tensor) -> None:
        """``t``'s storage does not grow with the batch (see the module docstring)."""
        self.retag(t, FIXED)

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage was created under this counter and is alive."""
        return storage_of(t)[0] in self._live

    def by_tag(self) -> dict[str, int]:
        """Live bytes per tag."""
        out: dict[str, int] = {}
        with self._lock:
            for nbytes, tag in self._live.values():
                out[tag] = out.get(tag, 0) + nbytes
        return out

    def reset_peak(self) -> None:
        self.peak, self.fixed_at_peak = self.current, self.fixed
