"""Job monitor of a batch job: heartbeats between ranks over UDP, one clean message for a failure, a stall watchdog.

Every rank runs a small thread that sends a heartbeat (its step, phase, current action and
seconds since its last progress) to the *monitor* ranks (the first three) once per
interval. The side channel is plain UDP, apart from MPI, so it keeps working while the
ranks are blocked in communication, and it cannot itself hang the job.

* A failure on a rank (an exception) is sent to the monitors with its traceback; the lowest
  live monitor prints one message (the first failing rank's, naming the other failing ranks)
  and aborts the job. The traceback goes to a log file, or into the message with ``-v``.
* With a step timeout armed, a monitor aborts the job once a rank has made no progress (no
  new action) for longer than the timeout, naming the stalled rank(s): those whose
  heartbeats stopped (a stopped or frozen process), else those not waiting in communication,
  with the action each rank is in. Ranks in an exempt phase (writing a checkpoint) hold the
  watchdog off.
* Across hosts, the monitors sit on different hosts, and a host whose ranks all fall silent is
  lost (``lost_host.py``): the job ends naming it, armed or not (exit code 6). In a batch job the
  monitor listens on through MPI's teardown after the summary (``teardown.py``), so a host lost then
  ends the job the same way instead of leaving MPI's finalize waiting for it.
"""
from __future__ import annotations

import json
import secrets
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from ..config import Choice
from .lost_host import LOST_HOST_SECONDS, choose_monitors, describe_lost, ended_before, lost_hosts
from .teardown import linger

if TYPE_CHECKING:
    from ..comm.protocol import Comm

EXIT_FAILED = 1
EXIT_STALLED = 4
EXIT_HOST_LOST = 6
MONITORS = 3                 # ranks watching the job, on different hosts where there are (the lowest live reports)
COLLECT_SECONDS = 0.5        # gather failures from several ranks into one message
FAIL_GRACE_SECONDS = 10.0    # a failing rank aborts by itself when no monitor did by then
MAX_TEXT = 12000             # bytes of traceback carried in one datagram
FRESH_SECONDS = 0.1          # progress is sent at once when the last heartbeat is older
COMM_ACTIONS = ("send", "recv", "all-reduce", "allreduce", "gather", "barrier", "wait")
GOODBYES = 3                 # a goodbye is sent this many times (datagrams may be lost)
FINALIZING = "finalizing"    # the phase of a rank in MPI's finalize (``teardown.py``)
COLLECTIVE_FINALIZE_SECONDS = 3.0   # a rank alive in its finalize this long waits for others: an MPI whose finalize
                                    # is collective (not MPICH's local one), so the monitor outlasting it goes on


def world_rank_text(rank: int, world: int) -> str:
    return f"[rank {rank}/{world}] " if world > 1 else ""


@dataclass
class RankState:
    """What one rank last said about itself (on a monitor)."""

    rank: int
    heard: float = 0.0            # monitor's clock when the last heartbeat arrived
    step: int | None = None
    phase: str = "set-up"
    action: str = ""
    idle: float = 0.0             # seconds since the rank's last progress, when it sent
    exempt: bool = False
    timeout: float | None = None
    closed: bool = False
    phase_since: float = 0.0      # monitor's clock when ``phase`` began

    def idle_now(self, now: float) -> float:
        return self.idle + max(0.0, now - self.heard)

    def waiting(self) -> bool:
        text = self.action.lower()
        return any(word in text for word in COMM_ACTIONS)

    def doing(self) -> str:
        if self.step is None:
            return self.action or self.phase
        return f"step {self.step}: {self.action or self.phase}"


@dataclass(frozen=True)
class Failure:
    """An exception on one rank, as reported to the monitors."""

    rank: int
    summary: str
    trace: str = ""
    log: str | None = None


@dataclass(frozen=True)
class Heartbeat:
    """A rank's periodic news: its step, phase and action, seconds since its last progress, its timeout."""

    rank: int
    step: int | None
    phase: str
    action: str
    idle: float
    exempt: bool
    timeout: float | None


@dataclass(frozen=True)
class Goodbye:
    """A rank closed its monitor: its silence from now on is no stall."""

    rank: int


class MessageKind(Choice):
    """What a monitor datagram carries (its ``"t"`` field)."""

    HEARTBEAT = "hb"
    BYE = "bye"
    FAIL = "fail"


Message = Heartbeat | Goodbye | Failure
MESSAGE_TYPES: dict[MessageKind, type[Message]] = {
    MessageKind.HEARTBEAT: Heartbeat, MessageKind.BYE: Goodbye, MessageKind.FAIL: Failure}


def encode_message(message: Message, key: str) -> bytes:
    """One datagram: the message's kind, its fields and the job's ``key``."""
    kind = next(k for k, cls in MESSAGE_TYPES.items() if isinstance(message, cls))
    return json.dumps({"t": kind.value, **asdict(message), "key": key}).encode()


def decode(data: bytes, key: str) -> Message | None:
    """The message of a datagram of this job (``key``); None for anything else."""
    try:
        raw = json.loads(data.decode())
        if not isinstance(raw, dict) or raw.pop("key", None) != key:
            return None
        return MESSAGE_TYPES[MessageKind(raw.pop("t", None))](**raw)
    except (ValueError, TypeError, KeyError):
        return None


def describe_ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class JobMonitor:
    """One rank's end of the monitor; build it with :meth:`start` (collective) on every rank."""

    def __init__(self, ctx: Comm, peers: list[tuple[str, int]], sock: socket.socket | None, *,
                 verbose: bool = False, log_dir: Path | None = None, interval: float = 1.0,
                 stream: TextIO | None = None, abort: Callable[[int], None] | None = None,
                 key: str = "", hosts: Sequence[str] | None = None) -> None:
        self.ctx = ctx
        self.key = key
        self.rank = ctx.rank
        self.world = ctx.world_size
        self.peers = peers
        self.sock = sock
        self.verbose = verbose
        self.log_dir = log_dir
        self.interval = interval
        self.stream = stream if stream is not None else sys.stderr
        self._abort_with = abort
        self.hosts = list(hosts) if hosts else [""] * self.world     # each rank's host ("": one node)
        self.monitors = choose_monitors(self.hosts, MONITORS)
        self.is_monitor = self.rank in self.monitors
        # this rank's own state
        self.step: int | None = None
        self.phase_name = "set-up"
        self.exempt = False
        self.action = ""
        self.last_progress = time.monotonic()
        self.timeout: float | None = None
        self._current: Callable[[], str | None] | None = None   # ``follow``: the action under way, read per beat
        self._seen: str | None = None
        # monitor state
        now = time.monotonic()
        self.states = {r: RankState(r, heard=now) for r in range(self.world)}
        self.failures: list[Failure] = []
        self.first_failure: float | None = None
        self.acted = False
        self.tearing_down = False       # the job is over; MPI's teardown is under way (``teardown.py``)
        self._last_sent = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ set-up
    @classmethod
    def start(cls, ctx: Comm, *, verbose: bool = False, log_dir: Path | None = None,
              interval: float = 1.0, stream: TextIO | None = None) -> JobMonitor:
        """Open this rank's UDP socket, learn every rank's address (collective), start the thread.

        On one node the sockets listen on the loopback only; datagrams carry a key drawn by
        rank 0, so nothing but this job's ranks is heard.
        """
        sock = None
        peers: list[tuple[str, int]] = []
        hosts: list[str] = []
        key = ""
        if ctx.world_size > 1:
            hosts = ctx.all_gather_object(socket.gethostname())
            one_node = len(set(hosts)) == 1
            key = str(ctx.bcast_object(secrets.token_hex(8) if ctx.rank == 0 else None, root=0))
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind(("127.0.0.1" if one_node else "", 0))
            ports = ctx.all_gather_object(sock.getsockname()[1])
            peers = [("127.0.0.1" if one_node else host, port) for host, port in zip(hosts, ports)]
        monitor = cls(ctx, peers, sock, verbose=verbose, log_dir=log_dir, interval=interval,
                      stream=stream, key=key, hosts=hosts if len(set(hosts)) > 1 else None)
        if sock is not None:
            monitor._thread = threading.Thread(target=monitor._loop, name="mpi4dl-monitor", daemon=True)
            monitor._thread.start()
        return monitor

    def close(self) -> None:
        """The job is over: in a batch job listen on through MPI's teardown (``teardown.linger``: the goodbye comes
        at exit, after MPI's finalize), else say goodbye now."""
        if self._stop.is_set() or self.tearing_down:
            return
        if self.sock is not None and linger(self):
            self.tearing_down, self.step = True, None
            self.arm(None)
            self.phase_name, self.exempt = "teardown", True    # no stall: only a lost host ends the job now
            self.progress("MPI teardown")
            return
        self.end()

    def before_finalize(self) -> None:
        """Every rank at the teardown (a barrier, this monitor listening: a host lost before it is named and the job
        ended); a monitor across hosts then outlasts the ranks ``ended_before`` names (their goodbye comes after
        their finalize), so a host lost meanwhile is named and the job ended while this rank still can."""
        self.progress("MPI teardown: waiting for every rank")
        self.ctx.barrier()
        if self.is_monitor and len(set(self.hosts)) > 1:
            awaited = [self.states[r] for r in ended_before(self.hosts, self.monitors, self.rank)]
            self.progress("MPI teardown: waiting for the other hosts' ranks to end")
            while not all(self._ended(state, time.monotonic()) for state in awaited):
                time.sleep(0.01)
        self.phase_name = FINALIZING
        self.progress(FINALIZING)

    def _ended(self, state: RankState, now: float) -> bool:
        """Whether a rank said goodbye, or is alive in a finalize long enough to be waiting for the others."""
        return state.closed or (state.phase == FINALIZING and self.live(state.rank, now)
                                and now - state.phase_since > COLLECTIVE_FINALIZE_SECONDS)

    def say_goodbye(self) -> None:
        """Tell the monitors this rank is done (its silence from now on is no stall and no lost host)."""
        for _ in range(GOODBYES):
            self._send_monitors(Goodbye(self.rank))

    def end(self) -> None:
        """Stop heartbeats (say goodbye, so monitors do not take the silence for a stall)."""
        if self._stop.is_set():
            return
        self.say_goodbye()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)
        if self.sock is not None:
            self.sock.close()

    # --------------------------------------------------------- this rank's state
    def progress(self, action: str = "") -> None:
        """This rank moved on (called before each action of a step); monitors hear of it within 0.1 s."""
        self.action = action
        self.last_progress = now = time.monotonic()
        if now - self._last_sent > FRESH_SECONDS:
            self._beat(now)

    def follow(self, current: Callable[[], str | None] | None) -> None:
        """Read this rank's action from ``current()`` (None: no step under way) at each heartbeat, instead of a
        ``progress`` call per action: a new action counts as progress, seen within one heartbeat interval."""
        self._current, self._seen = current, None

    def _poll(self, now: float) -> None:
        current = self._current() if self._current is not None else None
        if current is not None and current != self._seen:
            self._seen = self.action = current
            self.last_progress = now

    def _beat(self, now: float) -> None:
        self._poll(now)
        self._last_sent = now
        self._send_monitors(self._heartbeat())

    def begin_step(self, step: int) -> None:
        self.step = step
        self.phase_name = "training"
        self._seen = None          # the step's first action is progress, even one named as the last step's was
        self.progress("")

    @contextmanager
    def phase(self, name: str, exempt: bool = False) -> Iterator[None]:
        """Mark a phase (``exempt``: may take long, e.g. writing a checkpoint; the watchdog waits)."""
        before = (self.phase_name, self.exempt, self.action)
        self.phase_name, self.exempt = name, exempt
        self.progress(name)
        try:
            yield
        finally:
            self.phase_name, self.exempt, self.action = before
            self.last_progress = time.monotonic()

    def arm(self, timeout: float | None) -> None:
        """Set (or clear, None) the stall timeout in seconds; every rank announces its own. Arming starts the clock:
        the set-up before it (building the model, loading weights) is no stall, however long it took."""
        if timeout and not self.timeout:
            self.last_progress = time.monotonic()
        self.timeout = timeout
        self.interval = min(self.interval, max(0.2, timeout / 8)) if timeout else self.interval

    # --------------------------------------------------------------- datagrams
    def _send_monitors(self, message: Message) -> None:
        if self.sock is None:
            return
        data = encode_message(message, self.key)
        for rank in self.monitors:
            try:
                self.sock.sendto(data, self.peers[rank])
            except OSError:
                pass

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(self.rank, self.step, self.phase_name, self.action, time.monotonic() - self.last_progress,
                         self.exempt, self.timeout)

    def _loop(self) -> None:
        assert self.sock is not None
        self.sock.settimeout(0.05)
        next_beat = 0.0
        last_tick = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now - last_tick > max(10.0, 10 * self.interval):   # this process was suspended:
                for state in self.states.values():              # the silence says nothing
                    state.heard = now
            last_tick = now
            if now >= next_beat:
                self._beat(now)
                next_beat = now + self.interval
            if not self.is_monitor:
                self._stop.wait(min(0.1, max(0.0, next_beat - time.monotonic())))
                continue
            self._drain()
            if not self.acted:
                self._decide(time.monotonic())

    def _drain(self) -> None:
        """Read every datagram waiting (the first for up to the socket timeout), so states are current."""
        assert self.sock is not None
        blocking = True
        while True:
            try:
                data, _ = self.sock.recvfrom(65536) if blocking else \
                    self.sock.recvfrom(65536, socket.MSG_DONTWAIT)
            except (TimeoutError, BlockingIOError, OSError):
                return
            blocking = False
            message = decode(data, self.key)
            if message is not None:
                self._receive(message)

    def _receive(self, message: Message) -> None:
        state = self.states.get(message.rank)
        if state is None:
            return
        if isinstance(message, Heartbeat):
            state.heard = time.monotonic()
            if message.phase != state.phase:
                state.phase_since = state.heard
            state.step, state.phase, state.action = message.step, message.phase, message.action
            state.idle, state.exempt, state.timeout = message.idle, message.exempt, message.timeout
        elif isinstance(message, Goodbye):
            state.closed = True
        elif all(f.rank != message.rank for f in self.failures):
            self.failures.append(message)
            if self.first_failure is None:
                self.first_failure = time.monotonic()

    # --------------------------------------------------------------- decisions
    def silent_after(self) -> float:
        return max(3 * self.interval, 2.0)

    def live(self, rank: int, now: float) -> bool:
        state = self.states[rank]
        return rank == self.rank or (not state.closed and now - state.heard < self.silent_after())

    def reporter(self, now: float) -> bool:
        """Whether this monitor speaks: every lower monitor is silent."""
        return all(not self.live(m, now) for m in self.monitors if m < self.rank)

    def _decide(self, now: float) -> None:
        if self.first_failure is not None:
            waited = now - self.first_failure
            if waited >= COLLECT_SECONDS and (self.reporter(now) or waited > COLLECT_SECONDS + 3.0):
                self.acted = True
                self._write(self.failure_message())
                self._abort(EXIT_FAILED)
            return
        lost = self.lost_host(now)
        if lost is not None:
            self.acted = True
            self._write(lost)
            self._abort(EXIT_HOST_LOST)
            return
        stalled = self.stall(now)
        if stalled is not None:
            self.acted = True
            self._write(stalled)
            self._abort(EXIT_STALLED)

    def who(self, rank: int) -> str:
        """``rank 1``, with its host across hosts: ``rank 1 (h2)``."""
        return f"rank {rank} ({self.hosts[rank]})" if self.hosts[rank] else f"rank {rank}"

    def silent_hosts(self, now: float, limit: float) -> dict[str, list[int]]:
        """Other hosts whose every rank has been silent longer than ``limit`` seconds, with their ranks."""
        def silent_for(rank: int) -> float | None:
            state = self.states[rank]
            return None if state.closed else (0.0 if rank == self.rank else now - state.heard)
        return lost_hosts(self.hosts, self.hosts[self.rank], silent_for, limit)

    def lost_host(self, now: float) -> str | None:
        """The message when every rank of another host has been silent past ``LOST_HOST_SECONDS`` (or the armed
        step timeout, if shorter); None while every host is heard, or when another monitor speaks."""
        self._refresh_own(now)
        limits = [s.timeout for s in self.states.values() if s.timeout]
        lost = self.silent_hosts(now, min([LOST_HOST_SECONDS, *limits]))
        if not lost or not self.reporter(now):
            return None
        silence = min(now - self.states[r].heard for ranks in lost.values() for r in ranks)
        when = " after the job's summary, in MPI's teardown" if self.tearing_down else ""
        lines = [f"mpi4dl_nb train: {describe_lost(lost, silence)}{when}; aborting the job"]
        gone = {r for ranks in lost.values() for r in ranks}
        for s in sorted(self.states.values(), key=lambda s: s.rank):
            how = "lost with its host, last" if s.rank in gone else "alive,"
            lines.append(f"  {self.who(s.rank)}: {how} in {s.doing()}")
        lines.append("  the job had finished: its summary and checkpoints are complete" if self.tearing_down else
                     "  the last complete checkpoint stays on disk; rerun with --resume latest on the remaining hosts")
        return "\n".join(lines)

    def stall(self, now: float) -> str | None:
        """The stall message when an armed rank has made no progress past the timeout (None: all is well).

        Ranks not armed yet (still in set-up) and alive are not judged; a silent rank is.
        """
        self._refresh_own(now)
        limits = [s.timeout for s in self.states.values() if s.timeout]
        if not limits:
            return None
        timeout = max(limits)
        states = [s for s in self.states.values() if not s.closed]
        if any(s.exempt and self.live(s.rank, now) for s in states):
            return None
        silent = [s.rank for s in states if not self.live(s.rank, now)]
        quiet_hosts = self.silent_hosts(now, self.silent_after())
        if silent and set(silent) <= {r for ranks in quiet_hosts.values() for r in ranks}:
            return None          # whole hosts fell silent: lost_host speaks for them, naming the host
        late = [s for s in states if s.idle_now(now) > timeout and (s.timeout or s.rank in silent)]
        if not late or not self.reporter(now):
            return None
        working = [s.rank for s in late if not s.waiting() and s.rank not in silent]
        stalled = silent or working or [s.rank for s in late]
        lines = [f"mpi4dl_nb train: stalled: {describe_ranks(stalled)} made no progress for more "
                 f"than --step-timeout {timeout:g} s; aborting the job"]
        for s in sorted(states, key=lambda s: s.rank):
            how = "no heartbeat (stopped or frozen)" if s.rank in silent else \
                ("stalled" if s.rank in stalled else "waiting")
            lines.append(f"  {self.who(s.rank)}: {how}, idle {s.idle_now(now):.0f} s, in {s.doing()}")
        lines.append("  the last complete checkpoint stays on disk; rerun with --resume latest")
        return "\n".join(lines)

    def _refresh_own(self, now: float) -> None:
        own = self.states[self.rank]
        own.heard, own.step, own.phase, own.action = now, self.step, self.phase_name, self.action
        own.idle, own.exempt, own.timeout = now - self.last_progress, self.exempt, self.timeout

    def failure_message(self, job: bool = True) -> str:
        """The one message for the job's failure(s) (``job=False``: a lone process, nothing aborted)."""
        first = self.failures[0]
        others = sorted(f.rank for f in self.failures[1:])
        same = [f.rank for f in self.failures[1:] if f.summary == first.summary]
        lines = [f"mpi4dl_nb train: {f'rank {first.rank} ' if job else ''}failed: {first.summary}"]
        if others:
            lines.append(f"  {describe_ranks(others)} failed too" +
                         (" (same error)" if len(same) == len(others) else ""))
        if self.verbose and first.trace:
            lines.append(first.trace.rstrip())
        elif first.log:
            where = f" on {self.hosts[first.rank]}" if self.hosts[first.rank] else ""
            lines.append(f"  traceback: {first.log}{where} (or rerun with -v)")
        lines.append(f"  {'the job is aborted; ' if job else ''}checkpoints on disk are untouched")
        return "\n".join(lines)

    def _abort(self, code: int) -> None:
        if self.tearing_down and self._abort_with is None:    # MPI may be finalizing: MPI_Abort no longer can
            from ..comm.finalize import end_job

            self.stream.flush()
            end_job(code, self.ctx.abort)
        (self._abort_with or self.ctx.abort)(code)

    def _write(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    # ----------------------------------------------------------------- failure
    def fail(self, error: BaseException) -> None:
        """Report ``error`` (being handled) once for the whole job and end it; returns only with one rank."""
        trace = traceback.format_exc()
        notes = " ".join(str(note) for note in getattr(error, "__notes__", ()))   # e.g. the guard's way out
        summary = f"{type(error).__name__}: {error} {notes}".strip()
        if len(summary) > 2000:
            summary = summary[:2000] + " ..."
        log = write_log(self.log_dir, self.rank, trace)
        failure = Failure(self.rank, summary, trace[-MAX_TEXT:], str(log) if log else None)
        if self.world == 1:
            self.failures = [failure]
            self._write(self.failure_message(job=False))
            return
        for _ in range(3):
            self._send_monitors(failure)
            time.sleep(0.05)
        time.sleep(FAIL_GRACE_SECONDS)   # a monitor aborts the job meanwhile
        self.failures = self.failures or [failure]
        self._write(world_rank_text(self.rank, self.world) + self.failure_message())
        self._abort(EXIT_FAILED)


def write_log(folder: Path | None, rank: int, text: str) -> Path | None:
    """Write a rank's traceback to ``folder`` (the run's log or checkpoint directory), else to the temporary
    directory (never the working directory); the file's path, None if it cannot be written anywhere."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for base in ([folder] if folder is not None else []) + [Path(tempfile.gettempdir())]:
        path = Path(base) / f"mpi4dl_nb-error-{stamp}-rank{rank}.log"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return path
        except OSError:
            continue
    return None


@dataclass
class StepTimer:
    """The default step timeout: generous until the first steps are measured, then a multiple of the slowest."""

    given: float | None = None          # --step-timeout (0: off); None: derive
    first_steps: int = 3
    factor: float = 10.0
    floor: float = 60.0
    before_measured: float = 1800.0
    seconds: list[float] = field(default_factory=list)

    def timeout(self) -> float | None:
        if self.given is not None:
            return self.given or None
        if len(self.seconds) < self.first_steps:
            return self.before_measured
        return max(self.floor, self.factor * max(self.seconds[:self.first_steps]))

    def add(self, seconds: float) -> None:
        if len(self.seconds) < self.first_steps:
            self.seconds.append(seconds)
