"""Notebook-side MPI cluster: start/connect ipyparallel MPI engines (mpiexec as ``comm.launcher`` builds it), run
calls with timeouts (``dl.cluster``: the launch settings, errors and log helpers re-exported from their modules)."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Generic, NoReturn, TypedDict, TypeVar, Unpack

from ..comm.launcher import Launcher, MPIFlavor, check_allowed
from .engine_errors import EngineDied, EngineError, EngineTimeout, RemoteTaskError
from .engine_launch import (
    CONTROLLER_ARGS,
    ENGINE_ARGS,
    ENGINE_COMMAND,
    ENGINE_ENV,
    EnginePlacement,
    controller_address,
    engine_env,
    mpi_flavor,
    mpi_launch_args,
    slurm_batch_template,
)
from .launcher_log import (
    NANNIES_CAVEAT,
    deaths_in_log,
    launcher_exit_code,
    named_by_nannies,
    rank_lines,
    strip_ansi,
)
from .reaper_client import Reaper

if TYPE_CHECKING:     # ipyparallel loads when a cluster starts (it carries no type information)
    from ipyparallel import AsyncResult, Client, DirectView
    from ipyparallel import Cluster as IpyCluster
    from ipyparallel.error import CompositeError

__all__ = ["CONTROLLER_ARGS", "ENGINE_ARGS", "ENGINE_ENV", "Cluster", "ClusterOptions", "EngineDied", "EngineError",
           "EnginePlacement", "EngineTimeout", "PendingCall", "RankInfo", "Reaper", "RemoteTaskError", "connect",
           "controller_address", "deaths_in_log", "engine_env", "mpi_flavor", "mpi_launch_args", "rank_lines",
           "slurm_batch_template", "start"]

R = TypeVar("R")   # what a function called on the engines returns


@dataclass(frozen=True)
class PendingCall(Generic[R]):
    """A call running on some engines (``Cluster.submit``): ipyparallel's handle of it, and the MPI
    ranks it runs on (its results come back in that order)."""

    result: AsyncResult
    ranks: tuple[int, ...]


@dataclass
class RankInfo:
    """What the notebook knows about one engine: MPI rank, ipyparallel id, pid, host."""

    rank: int
    engine_id: int
    pid: int
    host: str


def _engine_identity() -> tuple[int, int, int, str]:
    import os as _os
    import socket

    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size(), _os.getpid(), socket.gethostname()


def _ranks_of(client: Client, timeout: float) -> tuple[list[RankInfo], set[int]]:
    """Every engine's MPI rank, engine id, pid and host (by rank), and the MPI world sizes they report."""
    identities: list[tuple[int, int, int, str]] = client[:].apply_async(_engine_identity).get(timeout=timeout)
    ranks = sorted((RankInfo(rank, eid, pid, host) for eid, (rank, _, pid, host) in zip(client.ids, identities)),
                   key=lambda info: info.rank)
    return ranks, {size for _, size, _, _ in identities}


# ------------------------------------------------------------------------- the cluster
@dataclass
class Cluster:
    """N ipyparallel engines that are the N ranks of one MPI job, driven from a notebook.

    Use as a context manager (``with dl.cluster.start(n=4) as cluster:``) so the engines
    are always stopped. ``run(func, *args, timeout=...)`` calls ``func`` on every engine
    and returns the results indexed by MPI rank; failures raise :class:`EngineError`.
    """

    n: int = 4
    mpi: MPIFlavor | str = "auto"                  # 'auto' (ask mpiexec), 'mpich' or 'openmpi'
    mpiexec: str | None = None
    launcher: EnginePlacement | str = EnginePlacement.LOCAL
    hosts: Sequence[str] = ()                      # one name per slot, ranks round-robin: engines on other hosts
    hostfile: str | None = None
    slurm_options: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    start_timeout: float = 120.0
    call_timeout: float = 600.0
    profile_dir: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r}: the number of engines must be an integer >= 1")
        if self.launcher not in EnginePlacement.values():
            raise ValueError(f"launcher={self.launcher!r}: use one of {', '.join(EnginePlacement.values())}")
        self.launcher = EnginePlacement(self.launcher)
        self.hosts = tuple(self.hosts)
        if self.hosts and self.launcher is EnginePlacement.LOCAL:
            self.launcher = EnginePlacement.HOSTS
        if self.hosts and self.launcher is not EnginePlacement.HOSTS:
            raise ValueError(f"hosts= places the engines with mpiexec; launcher={str(self.launcher)!r} takes its "
                             f"hosts from {'the hostfile' if self.launcher is EnginePlacement.HOSTFILE else 'Slurm'}")
        if self.launcher is EnginePlacement.HOSTS and not self.hosts:
            raise ValueError("launcher='hosts' needs hosts=[...] (the host of each engine slot)")
        if self.launcher is EnginePlacement.HOSTFILE and not self.hostfile:
            raise ValueError("launcher='hostfile' needs hostfile=<path> (one host per line)")
        if self.mpi != "auto":
            try:
                self.mpi = mpi_flavor(self.mpi)
            except ValueError:
                raise ValueError(f"mpi={self.mpi!r}: use 'auto', 'mpich' or 'openmpi'") from None
        self._ipp_cluster: IpyCluster | None = None
        self._client: Client | None = None
        self._view: DirectView | None = None
        self._owned = True
        self._tmp_profile: tempfile.TemporaryDirectory | None = None
        self._reaper: Reaper | None = None
        self._died: str | None = None
        self.ranks: list[RankInfo] = []

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> Cluster:
        """Start the controller and the MPI engine set; wait until all ranks registered.

        ``comm.launcher.LaunchForbidden`` before anything starts where no MPI job may (``MPI4DL_NB_NO_MPIEXEC``)."""
        check_allowed()
        import ipyparallel as ipp

        if self._ipp_cluster is not None:
            raise RuntimeError("cluster already started; use restart() or stop() first")
        if self.profile_dir is None:
            self._tmp_profile = tempfile.TemporaryDirectory(prefix="mpi4dl-ipp-")
            self.profile_dir = self._tmp_profile.name
        engines = "slurm" if self.launcher is EnginePlacement.SLURM else "mpi"
        where: dict[str, str] = {}
        if self.launcher is EnginePlacement.HOSTS:      # listen where the engines' hosts reach this machine
            address = controller_address(self.hosts)
            where = {"controller_ip": address, "controller_location": address}
        wide = self.launcher in (EnginePlacement.HOSTFILE, EnginePlacement.SLURM)
        controller_args = (["--ip=*"] if wide else []) + CONTROLLER_ARGS
        cluster = self._ipp_cluster = ipp.Cluster(engines=engines, n=self.n, profile_dir=self.profile_dir,
                                                  controller_args=controller_args, log_level=40,
                                                  engine_timeout=self.start_timeout, **where)
        self._died = None
        if self._reaper is None:
            self._reaper = Reaper()
        if self._tmp_profile is not None:
            self._reaper.remove(self._tmp_profile.name)
        try:
            cluster.start_controller_sync()
            self._reaper.watch([cluster.controller.process.pid])
            self._start_engines(cluster)
        except BaseException:
            self.stop()
            raise
        return self

    def _engine_launcher_kwargs(self) -> dict[str, object]:
        """ipyparallel's engine-set settings: the environment, and ``comm.launcher``'s mpiexec and flags
        (an sbatch script under Slurm)."""
        env = engine_env(self.env, self.n)
        bin_dir = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
        engine = {"environment": env, "engine_args": ENGINE_ARGS, "engine_cmd": ENGINE_COMMAND}
        if self.launcher is EnginePlacement.SLURM:
            return {**engine, "batch_template": slurm_batch_template(self.slurm_options, env)}
        launcher = Launcher.find(self.mpiexec, None if self.mpi == "auto" else self.mpi)
        self.mpi = launcher.flavor
        return {**engine, "mpi_cmd": [launcher.executable],
                "mpi_args": launcher.flags(env, hostfile=self.hostfile, hosts=self.hosts or None)}

    def _start_engines(self, cluster: IpyCluster) -> None:
        cluster.start_engines_sync(self.n, **self._engine_launcher_kwargs())
        if self._reaper is not None:
            self._reaper.watch([s.process.pid for s in cluster.engines.values()
                                if getattr(s, "process", None) is not None])
        client = self._client = cluster.connect_client_sync()
        deadline = time.monotonic() + self.start_timeout
        while len(client.ids) < self.n:
            if self._engine_set_stopped():
                raise EngineDied(f"the MPI engine job exited during start-up "
                                 f"({len(client.ids)} of {self.n} engines registered)",
                                 range(self.n), self._outputs_by_rank(range(self.n)))
            if time.monotonic() > deadline:
                raise EngineTimeout(f"only {len(client.ids)} of {self.n} engines "
                                    f"registered within start_timeout={self.start_timeout}s; "
                                    f"raise start_timeout or use fewer engines",
                                    range(self.n), self._outputs_by_rank(range(self.n)))
            time.sleep(0.1)
        self.ranks, sizes = _ranks_of(client, self.start_timeout)
        if sizes != {self.n}:
            raise EngineError(f"engines report MPI world sizes {sorted(sizes)}, expected {self.n}; "
                              f"are they MPI-launched (mpi4py built for this mpiexec)?")
        # Engine ids in MPI rank order, so results come back indexed by rank.
        self._view = client[[info.engine_id for info in self.ranks]]
        here = socket.gethostname()
        if self._reaper is not None:
            self._reaper.watch([info.pid for info in self.ranks if info.host == here])

    def stop(self) -> None:
        """Stop engines and controller (only those this object started); safe to call twice."""
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
        if self._ipp_cluster is not None and self._owned:
            # Engines first: stopped beside their controller (ipyparallel's stop_cluster) an engine
            # waits ~3 s on its way out; alone it ends in under 1 s.
            for stop in (self._ipp_cluster.stop_engines_sync, self._ipp_cluster.stop_controller_sync):
                try:
                    stop()
                except Exception:
                    pass
        self._ipp_cluster = None
        self._client = None
        self._view = None
        self.ranks = []
        if self._reaper is not None:
            self._reaper.close()
            self._reaper = None
        if self._tmp_profile is not None:
            self._tmp_profile.cleanup()
            self._tmp_profile = None
            self.profile_dir = None

    def restart(self, n: int | None = None) -> Cluster:
        """Replace the engine set by a fresh MPI job (after a death or a hang); ``n`` changes
        the number of engines (a configuration needs exactly its world size)."""
        if n is not None:
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"n={n!r}: the number of engines must be an integer >= 1")
            self.n = n
        if not self._owned:
            raise RuntimeError("this cluster was connected to, not started here; restart it "
                               "where it was started (ipcluster) and connect() again")
        # A fresh controller too: a reused one may still list the old engines as registered
        # (until its heartbeat notices them gone), and calls would be routed to dead engines.
        self.stop()
        return self.start()

    def __enter__(self) -> Cluster:
        if self._ipp_cluster is None and self._client is None:    # connect()ed clusters are already running
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        mpi = self.mpi.value if isinstance(self.mpi, MPIFlavor) else self.mpi
        return f"Cluster(n={self.n}, mpi={mpi!r}, launcher={str(self.launcher)!r}, {state})"

    # ------------------------------------------------------------------- status
    @property
    def running(self) -> bool:
        """Whether calls can run: started, and no engine has died since."""
        return self._view is not None and self._died is None and not self._engine_set_stopped()

    @property
    def pids(self) -> list[int]:
        """Engine process ids indexed by MPI rank."""
        return [info.pid for info in self.ranks]

    @property
    def client(self) -> Client | None:
        """The ipyparallel Client (for advanced use: load-balanced views, %px magics)."""
        return self._client

    @property
    def view(self) -> DirectView:
        """DirectView on all engines, in MPI rank order."""
        return self._running_view()

    def _engine_set_stopped(self) -> bool:
        cluster = self._ipp_cluster
        if cluster is None:
            return self._client is None    # a connected (not owned) cluster has no launcher
        sets = list(cluster.engines.values())
        return not sets or any(s.state == "after" or launcher_exit_code(s) is not None for s in sets)

    def _launcher_exit_codes(self) -> list[int]:
        cluster = self._ipp_cluster
        if cluster is None:
            return []
        return [code for s in cluster.engines.values() if (code := launcher_exit_code(s)) is not None]

    def launcher_output(self) -> str:
        """Everything the engine job printed to the launcher log so far (all ranks)."""
        if self._ipp_cluster is None:
            return ""
        return "\n".join(s.get_output(remove=False) or "" for s in self._ipp_cluster.engines.values())

    def engine_output(self, rank: int) -> str:
        """The launcher log lines of one MPI rank."""
        return rank_lines(self.launcher_output(), rank)

    def _outputs_by_rank(self, ranks: Sequence[int], result: AsyncResult | None = None) -> dict[int, str]:
        log = self.launcher_output()
        outputs = {}
        for rank in ranks:
            text = rank_lines(log, rank)
            if result is not None:
                try:
                    text += "\n" + "".join(result.stdout[rank]) + "".join(result.stderr[rank])
                except Exception:
                    pass
            outputs[rank] = text
        return outputs

    def _running_view(self) -> DirectView:
        """The view on every engine; RuntimeError/EngineDied saying what to do when there is none."""
        if self._view is None:
            raise RuntimeError("the cluster is not running; call start() (or use "
                               "`with dl.cluster.start(n=...) as cluster:`)")
        if self._died is not None:
            raise EngineDied(f"the engines are gone ({self._died}); call cluster.restart() to get a "
                             f"working cluster")
        return self._view

    def _everyone(self) -> tuple[int, ...]:
        """Every MPI rank of the cluster, in order."""
        return tuple(range(self.n))

    def _registered(self) -> list[int]:
        """Engine ids the controller lists now (none once the client is gone)."""
        return list(self._client.ids) if self._client is not None else []

    # -------------------------------------------------------------------- calls
    def run(self, func: Callable[..., R], *args: object, timeout: float | None = None,
            **kwargs: object) -> list[R]:
        """Call ``func(*args, **kwargs)`` on every engine; results indexed by MPI rank."""
        return self.wait(self.submit(func, *args, **kwargs), timeout=timeout)

    def run_on(self, ranks: Sequence[int], func: Callable[..., R], *args: object,
               timeout: float | None = None, **kwargs: object) -> list[R]:
        """Like :meth:`run` on a subset of ranks (no collectives among others!)."""
        self._running_view()
        assert self._client is not None       # a running cluster has its client
        view = self._client[[self.ranks[r].engine_id for r in ranks]]
        return self.wait(PendingCall[R](view.apply_async(func, *args, **kwargs), tuple(ranks)), timeout=timeout)

    def submit(self, func: Callable[..., R], *args: object, **kwargs: object) -> PendingCall[R]:
        """Start ``func`` on every engine without waiting; pass the handle to :meth:`wait`."""
        view = self._running_view()
        return PendingCall[R](view.apply_async(func, *args, **kwargs), self._everyone())

    def wait(self, handle: PendingCall[R], timeout: float | None = None) -> list[R]:
        """Results of a submitted call; raises EngineDied/EngineTimeout/RemoteTaskError."""
        import ipyparallel as ipp

        timeout = self.call_timeout if timeout is None else timeout
        result, ranks = handle.result, list(handle.ranks)
        deadline = time.monotonic() + timeout
        while not result.ready():
            if self._engine_set_stopped() or len(self._registered()) < self.n:
                self._raise_died(result, ranks)
            if time.monotonic() > deadline:
                raise EngineTimeout(
                    f"remote call did not finish within timeout={timeout}s (a rank may wait in "
                    f"a collective another rank never joined); the engines are blocked: call "
                    f"cluster.restart() to get a working cluster", ranks,
                    self._outputs_by_rank(ranks, result))
            result.wait(0.05)
        try:
            return result.get(timeout=1)
        except ipp.error.CompositeError as exc:
            dead = [e for e in exc.elist if e[0] == "EngineError"]
            if dead:
                self._raise_died(result, ranks)
            raise RemoteTaskError(self._describe_remote_errors(exc), ranks,
                                  self._outputs_by_rank(ranks, result)) from None
        except ipp.error.RemoteError as exc:
            raise RemoteTaskError(f"{exc.ename}: {exc.evalue}\n{strip_ansi(exc.traceback or '')}", ranks,
                                  self._outputs_by_rank(ranks, result)) from None
        except ipp.error.EngineError:
            self._raise_died(result, ranks)

    def _describe_remote_errors(self, exc: CompositeError) -> str:
        by_engine = {info.engine_id: info.rank for info in self.ranks}
        lines = ["the function raised on the engines:"]
        for ename, evalue, _tb, info in exc.elist:
            rank = by_engine.get(info.get("engine_id"), "?") if info else "?"
            lines.append(f"[rank {rank}] {ename}: {evalue}")
        first_tb = exc.elist[0][2] if exc.elist else ""
        if first_tb:
            lines.append("first traceback:\n" + strip_ansi(str(first_tb)))
        return "\n".join(lines)

    def _raise_died(self, result: AsyncResult, ranks: Sequence[int]) -> NoReturn:
        # Give the launcher a moment to end the job and log the death.
        for _ in range(30):
            if self._engine_set_stopped():
                break
            time.sleep(0.1)
        time.sleep(0.3)
        log = self.launcher_output()
        how = deaths_in_log(log)
        alive = set(self._registered())
        dead = sorted(how) or [info.rank for info in self.ranks if info.engine_id not in alive] \
            or list(ranks)
        codes = self._launcher_exit_codes()
        details = "; ".join(f"rank {r} {how[r]}" for r in dead if r in how) or \
            (f"mpiexec exited with code {codes[0]}" if codes else "no exit status reported")
        if how and named_by_nannies(log):
            details += f" - {NANNIES_CAVEAT}"
        self._died = f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} died: {details}"
        raise EngineDied(f"engine(s) of MPI rank(s) {dead} died during the call ({details}); the MPI "
                         f"job is gone: call cluster.restart() to get a working cluster", dead,
                         self._outputs_by_rank(dead, result))

    def execute(self, code: str, timeout: float | None = None) -> None:
        """Run Python source on every engine (like ``%px``), with a timeout."""
        view = self._running_view()
        self.wait(PendingCall[None](view.execute(code, block=False), self._everyone()), timeout=timeout)

    def push(self, namespace: Mapping[str, object], timeout: float | None = None) -> None:
        """Set variables in every engine's namespace."""
        view = self._running_view()
        self.wait(PendingCall[None](view.push(dict(namespace), block=False), self._everyone()), timeout=timeout)

    def pull(self, name: str, timeout: float | None = None) -> list[object]:
        """A variable from every engine's namespace, indexed by MPI rank."""
        view = self._running_view()
        return self.wait(PendingCall[object](view.pull(name, block=False), self._everyone()), timeout=timeout)


class ClusterOptions(TypedDict, total=False):
    """The :class:`Cluster` fields ``start`` takes besides ``n``."""

    mpi: MPIFlavor | str
    mpiexec: str | None
    launcher: EnginePlacement | str
    hosts: Sequence[str]
    hostfile: str | None
    slurm_options: Sequence[str]
    env: Mapping[str, str]
    start_timeout: float
    call_timeout: float
    profile_dir: str | None


def start(n: int = 4, **options: Unpack[ClusterOptions]) -> Cluster:
    """Start a local (or hosts/hostfile/Slurm) MPI cluster of ``n`` engines; use as a context manager.

    Options are :class:`Cluster` fields: ``mpi`` ('auto'|'mpich'|'openmpi'), ``mpiexec``,
    ``launcher`` ('local'|'hosts'|'hostfile'|'slurm'), ``hosts`` (engines round-robin over these hosts; the
    controller listens on this machine's address towards them), ``hostfile``, ``slurm_options``, ``env``,
    ``start_timeout``, ``call_timeout``, ``profile_dir``.
    """
    return Cluster(n=n, **options).start()


def connect(n: int | None = None, *, profile_dir: str | None = None, cluster_id: str = "",
            timeout: float = 60.0, call_timeout: float = 600.0) -> Cluster:
    """Attach to a running ipyparallel MPI cluster (e.g. ``ipcluster start --engines=mpi``).

    ``stop()`` on the result only disconnects; the cluster keeps running.
    """
    import ipyparallel as ipp

    kwargs: dict[str, str] = {"cluster_id": cluster_id}
    if profile_dir is not None:
        kwargs["profile_dir"] = profile_dir
    client = ipp.Client(**kwargs)
    count = n if n is not None else len(client.ids)
    if count < 1:
        client.wait_for_engines(1, timeout=timeout)
        count = len(client.ids)
    client.wait_for_engines(count, timeout=timeout)
    cluster = Cluster(n=count, call_timeout=call_timeout, profile_dir=profile_dir)
    cluster._owned = False
    cluster._client = client
    cluster.ranks, _ = _ranks_of(client, timeout)
    cluster._view = client[[info.engine_id for info in cluster.ranks]]
    return cluster
