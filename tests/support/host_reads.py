"""HostReads: every read of a tensor's value into Python made while it is on, by call site.

On a GPU each of these waits for every kernel queued before it (a host sync):

* reads: ``.item()``, ``float()``, ``int()``, ``bool()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, a
  tensor as a Python index, ``torch.equal``/``allclose`` (a Python bool from the values), and the ops
  whose output size depends on the values (``nonzero``, ``masked_select``, ``unique``, indexing with
  a boolean mask), wherever they are called from (torch's own Python code too: a BatchNorm with
  ``momentum=None`` reads its counter);
* blocking copies onto a device that the package's own code asks for: ``.to(<device>)`` or
  ``.cuda()`` without ``non_blocking=True``, and ``torch.tensor(data, device=<device>)`` (built on the
  host, then copied with a wait). On CPU these copy nothing, so only the package's calls are counted
  (torch's internal ``.to`` calls are casts); a device named by the literal ``"cpu"`` or ``"meta"`` is
  not a device copy.

While on, these methods of ``torch.Tensor`` and functions of ``torch`` are wrapped (not a
``TorchFunctionMode``: torch runs a backward with the modes popped, and the backward is where halo
adjoints, gradient buckets and hooks run), so every Python call of one is seen. Each is recorded under the
innermost package frame that led to it (``mpi4dl_nb/...``, with its function), so a rule can allow a site
by module and function. On CPU the tensors live on the host, so the test catches the call pattern a GPU run
would sync on, whatever the device.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType

import torch

PACKAGE = Path(__file__).resolve().parents[2] / "mpi4dl_nb"

Args = Sequence[object]
Kwargs = Mapping[str, object]
Syncs = Callable[[Args, Kwargs, FrameType | None], bool]   # (args, kwargs, the caller's frame) -> a sync?
HOST_NAMES = ("cpu", "meta")   # devices named by a literal: no copy onto a device


def _always(args: Args, kwargs: Kwargs, caller: FrameType | None) -> bool:
    return True


def _boolean_index(args: Args, kwargs: Kwargs, caller: FrameType | None) -> bool:
    """``tensor[index]`` with a boolean mask: its result's size is read from the values."""
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def _in_package(frame: FrameType | None) -> bool:
    return frame is not None and Path(frame.f_code.co_filename).is_relative_to(PACKAGE)


def _named_device(value: object) -> bool:
    """Whether ``value`` names a device to copy onto (a ``torch.device``, or a string other than the host's)."""
    return isinstance(value, torch.device) or (isinstance(value, str) and value not in HOST_NAMES
                                               and not value.startswith("cpu"))


def _blocking_copy(args: Args, kwargs: Kwargs, caller: FrameType | None) -> bool:
    """``tensor.to(device)`` from the package without ``non_blocking=True``."""
    if not _in_package(caller) or kwargs.get("non_blocking") is True:
        return False
    return any(_named_device(a) for a in args[1:]) or _named_device(kwargs.get("device"))


def _tensor_on_device(args: Args, kwargs: Kwargs, caller: FrameType | None) -> bool:
    """``torch.tensor(data, device=<device>)`` from the package: built on the host, copied with a wait."""
    return _in_package(caller) and _named_device(kwargs.get("device"))


WRAPPED: tuple[tuple[object, str, Syncs], ...] = (
    *((torch.Tensor, name, _always) for name in (
        "item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__", "equal", "allclose",
        "nonzero", "argwhere", "masked_select", "unique")),
    *((torch, name, _always) for name in ("equal", "allclose", "nonzero", "argwhere", "masked_select", "unique")),
    (torch.Tensor, "__getitem__", _boolean_index),
    (torch.Tensor, "__setitem__", _boolean_index),
    (torch.Tensor, "to", _blocking_copy),
    (torch.Tensor, "cuda", lambda args, kwargs, caller: _in_package(caller) and not kwargs.get("non_blocking")),
    (torch, "tensor", _tensor_on_device),
    (torch, "as_tensor", _tensor_on_device),
)


@dataclass(frozen=True)
class Read:
    """One kind of read at one place: the op, the package frame that led to it, and the frame that made it."""

    op: str
    module: str          # the package module, relative to mpi4dl_nb/ ("" when no package frame led to it)
    function: str        # its function
    line: int
    made_in: str         # the innermost frame (file:line), maybe torch's own code

    def __str__(self) -> str:
        where = f"mpi4dl_nb/{self.module}:{self.line} {self.function}" if self.module else "outside the package"
        return f"{self.op} at {where} (made in {self.made_in})"


@dataclass(frozen=True)
class Allowed:
    """A read the rule lets through: at ``module``'s ``function``, at most ``most`` times (None: any), because
    ``why``."""

    module: str
    function: str
    why: str
    most: int | None = None

    def covers(self, read: Read) -> bool:
        return read.module == self.module and read.function == self.function


class HostReads:
    """Counts every host sync of the module docstring made while entered, by call site."""

    def __init__(self) -> None:
        self.reads: Counter[Read] = Counter()
        self._saved: list[tuple[object, str, object | None]] = []   # (owner, name, its own attribute; None: inherited)

    def __enter__(self) -> HostReads:
        for owner, name, syncs in WRAPPED:
            self._wrap(owner, name, syncs)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        while self._saved:   # back as they were: an inherited slot is deleted again, not set (that would slow it)
            owner, name, own = self._saved.pop()
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)

    def _wrap(self, owner: object, name: str, syncs: Syncs) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, vars(owner).get(name)))
        op = f"{'torch' if owner is torch else 'Tensor'}.{name}"

        def counted(*args: object, **kwargs: object) -> object:
            caller = sys._getframe(1)
            if syncs(args, kwargs, caller):
                self.reads[_read(op, caller)] += 1
            return original(*args, **kwargs)
        setattr(owner, name, counted)

    def count(self, rule: Allowed) -> int:
        """The reads ``rule`` covers."""
        return sum(n for read, n in self.reads.items() if rule.covers(read))

    def unexpected(self, allowed: Sequence[Allowed]) -> list[str]:
        """The reads no rule of ``allowed`` covers, and the rules read more often than they allow."""
        found = [f"{count} x {read}" for read, count in self.reads.items()
                 if not any(rule.covers(read) for rule in allowed)]
        for rule in allowed:
            count = self.count(rule)
            if rule.most is not None and count > rule.most:
                found.append(f"{count} reads at {rule.module} {rule.function}, at most {rule.most} allowed "
                             f"({rule.why})")
        return found


def _read(op: str, frame: FrameType | None) -> Read:
    made_in = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(PACKAGE):
            return Read(op, path.relative_to(PACKAGE).as_posix(), frame.f_code.co_name, frame.f_lineno, made_in)
        frame = frame.f_back
    return Read(op, "", "", 0, made_in)
