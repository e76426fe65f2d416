"""The read-ahead worker: one thread loading items (a training step's input, an inference window's region) in order
while the caller computes, at most ``depth`` ahead; its error raised where the caller takes that item; stopped and
joined at the end or early."""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Generic, TypeVar

from ..console import to_stderr

Item = TypeVar("Item")
Result = TypeVar("Result")
JOIN_SECONDS = 60.0     # how long ``close`` waits for a load under way before leaving the (daemon) thread to it


class _End:
    """The worker's last entry: every item was loaded."""


class ReadAhead(Generic[Item, Result]):
    """``load(item)`` for each of ``items`` on a worker thread, in order, at most ``depth`` results loaded and not yet
    taken (the memory bound: with ``depth`` 1, the step under way and the next one).

    ``take()`` gives the next ``(item, result)``, waiting for it, or None after the last; an exception raised by
    ``load`` is raised by the ``take`` that wanted its result (the same object: its message and the worker's
    traceback), and the worker stops there; iterating takes until the last. ``wait_seconds``: the time the caller
    spent waiting in ``take``. ``close()`` (or leaving a ``with`` block) stops the worker after the load under way
    and joins it; results not taken are dropped.
    """

    def __init__(self, items: Iterable[Item], load: Callable[[Item], Result], depth: int = 1, *,
                 name: str = "mpi4dl-read-ahead") -> None:
        if depth < 1:
            raise ValueError(f"depth={depth}: a read ahead holds at least one result (0: read inline, no worker)")
        self._slots = threading.Semaphore(depth)      # released by each take: the worker loads one more
        self._ready: queue.Queue[tuple[Item, Result] | BaseException | _End] = queue.Queue()
        self._stop = threading.Event()
        self._over = False                            # the last item was taken, or the worker's error raised
        self.wait_seconds = 0.0
        self._thread = threading.Thread(target=self._run, args=(iter(items), load), daemon=True, name=name)
        self._thread.start()

    def _run(self, items: Iterator[Item], load: Callable[[Item], Result]) -> None:
        try:
            for item in items:
                self._slots.acquire()
                if self._stop.is_set():
                    return
                self._ready.put((item, load(item)))
        except BaseException as err:   # handed to the caller, raised where it takes this item
            self._ready.put(err)
            return
        self._ready.put(_End())

    def take(self) -> tuple[Item, Result] | None:
        """The next item and its result, once loaded (None: no more, or closed); the worker's error raised here."""
        if self._over or self._stop.is_set():
            return None
        start = time.perf_counter()
        value = self._ready.get()
        self.wait_seconds += time.perf_counter() - start
        if isinstance(value, _End):
            self._over = True
            return None
        if isinstance(value, BaseException):
            self._over = True
            raise value
        self._slots.release()
        return value

    def __iter__(self) -> Iterator[tuple[Item, Result]]:
        while (taken := self.take()) is not None:
            yield taken

    @property
    def alive(self) -> bool:
        """Whether the worker thread is still running."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the worker after the load under way and join it (a warning if it is still loading after
        ``JOIN_SECONDS``); drop the results not taken."""
        self._stop.set()
        self._slots.release()        # a worker waiting for a slot wakes, sees the stop and ends
        self._thread.join(JOIN_SECONDS)
        if self._thread.is_alive():
            to_stderr(f"warning: the read-ahead thread is still loading after {JOIN_SECONDS:g} s; it is left to "
                      f"finish on its own (a slow or hung file system?)")
        while not self._ready.empty():
            self._ready.get_nowait()

    def __enter__(self) -> ReadAhead[Item, Result]:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
