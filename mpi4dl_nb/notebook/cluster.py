"""Notebook-side MPI cluster: start/connect ipyparallel MPI engines, run calls with timeouts."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

#: Environment every engine gets: one thread per rank, MPI yielding when ranks > cores,
#: and a glibc malloc that keeps freed activation memory (no page faults every step).
ENGINE_ENV: dict[str, str] = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": "100000000000",
    "PYTHONUNBUFFERED": "1",
}

#: The controller pings engines every second (ipyparallel's default, 3 s, held every start-up
#: ~2 s: an engine counts as registered only after its first heartbeat) and drops an engine
#: after 30 missed pings; the engines' heart answers from a thread outside the GIL.
CONTROLLER_ARGS = ["--HeartMonitor.period=1000", "--HeartMonitor.max_heartmonitor_misses=30"]

#: Engines end themselves when the controller is gone for 20 heartbeat checks (1.5 s each, ~30 s):
#: remote engines (hostfile, Slurm) outlive a dead driver no longer than that (local ones end at once).
ENGINE_ARGS = ["--IPEngine.max_heartbeat_misses=20"]

MPI_FLAVORS = ("mpich", "openmpi")
LAUNCHERS = ("local", "hostfile", "slurm")


class EngineError(RuntimeError):
    """A remote call failed: an engine died, hung past its timeout or raised.

    ``ranks`` are the MPI ranks concerned, ``outputs`` maps rank -> that engine's output
    (launcher log lines of that rank plus what the call printed).
    """

    def __init__(self, message: str, ranks: Sequence[int] = (),
                 outputs: Mapping[int, str] | None = None) -> None:
        self.ranks = list(ranks)
        self.outputs = dict(outputs or {})
        text = message
        for rank in self.ranks:
            out = self.outputs.get(rank, "").strip()
            if out:
                tail = "\n".join(out.splitlines()[-25:])
                text += f"\n--- output of rank {rank} (last lines) ---\n{tail}"
        super().__init__(text)


class EngineDied(EngineError):
    """An engine process exited during a call (the MPI job is gone: restart the cluster)."""


class EngineTimeout(EngineError):
    """A call did not finish within its timeout (likely a hung collective)."""


class RemoteTaskError(EngineError):
    """The function raised on one or more engines; the message holds their tracebacks."""


# --------------------------------------------------------------------- launch arguments
def detect_mpi_flavor(mpiexec: str) -> str:
    """'mpich' or 'openmpi' from ``mpiexec --version``."""
    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                              timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"cannot run {mpiexec!r} --version: {exc}; pass mpi='mpich' or "
                           f"mpi='openmpi' and mpiexec=<path>") from exc
    lowered = text.lower()
    if "open mpi" in lowered or "openrte" in lowered or "open-mpi" in lowered:
        return "openmpi"
    if "hydra" in lowered or "mpich" in lowered or "intel" in lowered:
        return "mpich"
    raise RuntimeError(f"{mpiexec} --version names neither MPICH nor Open MPI:\n{text[:300]}\n"
                       f"pass mpi='mpich' or mpi='openmpi' explicitly")


def mpi_launch_args(flavor: str, env: Mapping[str, str], *, as_root: bool | None = None,
                    hostfile: str | None = None, oversubscribe: bool = True) -> list[str]:
    """mpiexec flags for the engine set (rank-tagged output, env export, oversubscription)."""
    if flavor not in MPI_FLAVORS:
        raise ValueError(f"mpi={flavor!r}: use one of {', '.join(MPI_FLAVORS)}")
    as_root = (os.geteuid() == 0) if as_root is None else as_root
    if flavor == "mpich":
        args = ["-prepend-rank"]
        if hostfile:
            args += ["-f", hostfile]
        # hydra exports the whole environment by default; -genv makes remote hosts agree.
        for name, value in env.items():
            args += ["-genv", name, value]
        return args
    args = ["--tag-output"]
    if oversubscribe:
        args.append("--oversubscribe")
    if as_root:
        args.append("--allow-run-as-root")
    if hostfile:
        args += ["--hostfile", hostfile]
    for name, value in env.items():
        args += ["-x", f"{name}={value}"]
    return args


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def strip_ansi(text: str) -> str:
    """Text without terminal colour codes (IPython colours remote tracebacks)."""
    return _ANSI.sub("", text)


def rank_lines(output: str, rank: int) -> str:
    """Lines of a rank-tagged launcher log that belong to ``rank`` (MPICH or Open MPI tags)."""
    mine = []
    mpich = re.compile(r"^\[(\d+)\]\s?")
    ompi = re.compile(r"^\[\d+,(\d+)\]<\w+>:?\s?")
    for line in output.splitlines():
        for pattern in (mpich, ompi):
            match = pattern.match(line)
            if match:
                if int(match.group(1)) == rank:
                    mine.append(line[match.end():])
                break
    return "\n".join(mine)


_MPICH_EXIT = re.compile(r"EXIT CODE: (\d+)")
_MPICH_EXIT_STRING = re.compile(r"EXIT STRING: ([^\n]+)")
_OMPI_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")
_OMPI_CODE = re.compile(r"Process name: \[\[\d+,\d+\],(\d+)\]\s*\n\s*Exit code:\s*(\d+)")
# an engine's nanny logs the moment its engine's pipe closes (MPICH prefixes the MPI rank)
_NANNY_SAW_EXIT = re.compile(r"^\[(\d+)\] \d{4}-\d\d-\d\d (\d\d):(\d\d):(\d\d\.\d+) \[KernelNanny\.\d+\] "
                             r"(?:Pipe closed|Parent \d+ exited)", re.M)
FIRST_DEATH_WINDOW = 0.005   # seconds: engines ending later were ended by the launcher's clean-up


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def deaths_in_log(output: str) -> dict[int, str]:
    """Ranks that died first, with how (exit code or signal), from the engine job's log.

    Open MPI names the rank. MPICH ends every other rank when one dies and reports the exit
    status but not reliably which rank, so the rank comes from the engines' nannies: each
    logs when its engine ended, and those ending first died on their own.
    """
    found: dict[int, str] = {}
    for match in _OMPI_SIGNAL.finditer(output):
        number = int(match.group(2))
        found[int(match.group(1))] = f"killed by signal {number} ({signal_name(number)})"
    for match in _OMPI_CODE.finditer(output):
        found.setdefault(int(match.group(1)), f"exit code {match.group(2)}")
    if found:
        return found
    ended: dict[int, float] = {}
    for match in _NANNY_SAW_EXIT.finditer(output):
        hours, minutes, seconds = int(match.group(2)), int(match.group(3)), float(match.group(4))
        ended.setdefault(int(match.group(1)), hours * 3600 + minutes * 60 + seconds)
    if not ended:
        return {}
    code = _MPICH_EXIT.search(output)
    text = _MPICH_EXIT_STRING.search(output)
    if code is None:
        how = "exited"
    elif text is not None and "signal" in text.group(1).lower():
        how = f"killed by signal {code.group(1)} ({signal_name(int(code.group(1)))})"
    else:
        how = f"exit code {code.group(1)}"
    first = min(ended.values())
    return {rank: how for rank, when in sorted(ended.items()) if when - first <= FIRST_DEATH_WINDOW}


def engine_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """ENGINE_ENV plus PYTHONPATH so engines import this checkout, plus ``extra``."""
    env = dict(ENGINE_ENV)
    package_root = str(Path(__file__).resolve().parents[2])   # the folder holding mpi4dl_nb/
    paths = [package_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.update(extra or {})
    return env


def find_mpiexec() -> str:
    """The MPI launcher beside this interpreter (the venv's MPICH wheel), else the one on PATH."""
    candidate = Path(sys.executable).parent / "mpiexec"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpiexec found next to this Python nor on PATH; install an MPI "
                           "(pip install mpich) or pass mpiexec=<path>")
    return found


class Reaper:
    """The driver's end of ``reaper.py``: a watcher process that ends the cluster's processes if the driver dies."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("reaper.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)

    def _send(self, line: str) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(f"{line}\n".encode())
                self.proc.stdin.flush()
            except OSError:
                pass

    def watch(self, pids: Sequence[int]) -> None:
        for pid in pids:
            self._send(f"watch {int(pid)}")

    def close(self) -> None:
        """After a stop: close the pipe, so the watcher ends whatever is left of the cluster and exits."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass


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


# ------------------------------------------------------------------------- the cluster
@dataclass
class Cluster:
    """N ipyparallel engines that are the N ranks of one MPI job, driven from a notebook.

    Use as a context manager (``with dl.cluster.start(n=4) as cluster:``) so the engines
    are always stopped. ``run(func, *args, timeout=...)`` calls ``func`` on every engine
    and returns the results indexed by MPI rank; failures raise :class:`EngineError`.
    """

    n: int = 4
    mpi: str = "auto"
    mpiexec: str | None = None
    launcher: str = "local"
    hostfile: str | None = None
    slurm_options: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    start_timeout: float = 120.0
    call_timeout: float = 600.0
    profile_dir: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r}: the number of engines must be an integer >= 1")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher={self.launcher!r}: use one of {', '.join(LAUNCHERS)}")
        if self.launcher == "hostfile" and not self.hostfile:
            raise ValueError("launcher='hostfile' needs hostfile=<path> (one host per line)")
        if self.mpi not in ("auto",) + MPI_FLAVORS:
            raise ValueError(f"mpi={self.mpi!r}: use 'auto', 'mpich' or 'openmpi'")
        self._ipp_cluster: Any = None
        self._client: Any = None
        self._view: Any = None
        self._owned = True
        self._tmp_profile: tempfile.TemporaryDirectory | None = None
        self._reaper: Reaper | None = None
        self._died: str | None = None
        self.ranks: list[RankInfo] = []

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> Cluster:
        """Start the controller and the MPI engine set; wait until all ranks registered."""
        import ipyparallel as ipp

        if self._ipp_cluster is not None:
            raise RuntimeError("cluster already started; use restart() or stop() first")
        if self.profile_dir is None:
            self._tmp_profile = tempfile.TemporaryDirectory(prefix="mpi4dl-ipp-")
            self.profile_dir = self._tmp_profile.name
        engines = "slurm" if self.launcher == "slurm" else "mpi"
        controller_args = (["--ip=*"] if self.launcher != "local" else []) + CONTROLLER_ARGS
        self._ipp_cluster = ipp.Cluster(engines=engines, n=self.n, profile_dir=self.profile_dir,
                                        controller_args=controller_args, log_level=40,
                                        engine_timeout=self.start_timeout)
        self._died = None
        if self._reaper is None:
            self._reaper = Reaper()
        try:
            self._ipp_cluster.start_controller_sync()
            self._reaper.watch([self._ipp_cluster.controller.process.pid])
            self._start_engines()
        except BaseException:
            self.stop()
            raise
        return self

    def _engine_launcher_kwargs(self) -> dict[str, Any]:
        env = engine_env(self.env)
        mpiexec = self.mpiexec or find_mpiexec()
        flavor = detect_mpi_flavor(mpiexec) if self.mpi == "auto" else self.mpi
        self.mpi = flavor
        bin_dir = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
        if self.launcher == "slurm":
            return {"environment": env, "engine_args": ENGINE_ARGS,
                    "batch_template": slurm_batch_template(self.slurm_options, env)}
        args = mpi_launch_args(flavor, env, hostfile=self.hostfile)
        return {"mpi_cmd": [mpiexec], "mpi_args": args, "environment": env, "engine_args": ENGINE_ARGS}

    def _start_engines(self) -> None:
        cluster = self._ipp_cluster
        cluster.start_engines_sync(self.n, **self._engine_launcher_kwargs())
        if self._reaper is not None:
            self._reaper.watch([s.process.pid for s in cluster.engines.values()
                                if getattr(s, "process", None) is not None])
        self._client = cluster.connect_client_sync()
        deadline = time.monotonic() + self.start_timeout
        while len(self._client.ids) < self.n:
            if self._engine_set_stopped():
                raise EngineDied(f"the MPI engine job exited during start-up "
                                 f"({len(self._client.ids)} of {self.n} engines registered)",
                                 range(self.n), self._outputs_by_rank(range(self.n)))
            if time.monotonic() > deadline:
                raise EngineTimeout(f"only {len(self._client.ids)} of {self.n} engines "
                                    f"registered within start_timeout={self.start_timeout}s; "
                                    f"raise start_timeout or use fewer engines",
                                    range(self.n), self._outputs_by_rank(range(self.n)))
            time.sleep(0.1)
        self._view = self._client[:]
        identities = self._view.apply_async(_engine_identity).get(timeout=self.start_timeout)
        sizes = {size for _, size, _, _ in identities}
        if sizes != {self.n}:
            raise EngineError(f"engines report MPI world sizes {sorted(sizes)}, expected {self.n}; "
                              f"are they MPI-launched (mpi4py built for this mpiexec)?")
        self.ranks = sorted((RankInfo(rank, eid, pid, host)
                             for eid, (rank, _, pid, host) in zip(self._client.ids, identities)),
                            key=lambda info: info.rank)
        # Engine ids in MPI rank order, so results come back indexed by rank.
        self._view = self._client[[info.engine_id for info in self.ranks]]
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

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"Cluster(n={self.n}, mpi={self.mpi!r}, launcher={self.launcher!r}, {state})"

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
    def client(self) -> Any:
        """The ipyparallel Client (for advanced use: load-balanced views, %px magics)."""
        return self._client

    @property
    def view(self) -> Any:
        """DirectView on all engines, in MPI rank order."""
        self._require_running()
        return self._view

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

    def _outputs_by_rank(self, ranks: Sequence[int], result: Any = None) -> dict[int, str]:
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

    def _require_running(self) -> None:
        if self._view is None:
            raise RuntimeError("the cluster is not running; call start() (or use "
                               "`with dl.cluster.start(n=...) as cluster:`)")
        if self._died is not None:
            raise EngineDied(f"the engines are gone ({self._died}); call cluster.restart() to get a "
                             f"working cluster")

    # -------------------------------------------------------------------- calls
    def run(self, func: Callable[..., Any], *args: Any, timeout: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Call ``func(*args, **kwargs)`` on every engine; results indexed by MPI rank."""
        return self.wait(self.submit(func, *args, **kwargs), timeout=timeout)

    def run_on(self, ranks: Sequence[int], func: Callable[..., Any], *args: Any,
               timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Like :meth:`run` on a subset of ranks (no collectives among others!)."""
        self._require_running()
        view = self._client[[self.ranks[r].engine_id for r in ranks]]
        return self.wait(view.apply_async(func, *args, **kwargs), timeout=timeout,
                         ranks=list(ranks))

    def submit(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start ``func`` on every engine without waiting; pass the handle to :meth:`wait`."""
        self._require_running()
        return self._view.apply_async(func, *args, **kwargs)

    def wait(self, handle: Any, timeout: float | None = None,
             ranks: Sequence[int] | None = None) -> list[Any]:
        """Results of a submitted call; raises EngineDied/EngineTimeout/RemoteTaskError."""
        import ipyparallel as ipp

        timeout = self.call_timeout if timeout is None else timeout
        ranks = list(range(self.n)) if ranks is None else list(ranks)
        deadline = time.monotonic() + timeout
        while not handle.ready():
            if self._engine_set_stopped() or len(self._client.ids) < self.n:
                self._raise_died(handle, ranks)
            if time.monotonic() > deadline:
                raise EngineTimeout(
                    f"remote call did not finish within timeout={timeout}s (a rank may wait in "
                    f"a collective another rank never joined); the engines are blocked: call "
                    f"cluster.restart() to get a working cluster", ranks,
                    self._outputs_by_rank(ranks, handle))
            handle.wait(0.05)
        try:
            return handle.get(timeout=1)
        except ipp.error.CompositeError as exc:
            dead = [e for e in exc.elist if e[0] == "EngineError"]
            if dead:
                self._raise_died(handle, ranks)
            raise RemoteTaskError(self._describe_remote_errors(exc, ranks), ranks,
                                  self._outputs_by_rank(ranks, handle)) from None
        except ipp.error.RemoteError as exc:
            raise RemoteTaskError(f"{exc.ename}: {exc.evalue}\n{strip_ansi(exc.traceback or '')}", ranks,
                                  self._outputs_by_rank(ranks, handle)) from None
        except ipp.error.EngineError:
            self._raise_died(handle, ranks)

    def _describe_remote_errors(self, exc: Any, ranks: Sequence[int]) -> str:
        by_engine = {info.engine_id: info.rank for info in self.ranks}
        lines = ["the function raised on the engines:"]
        for ename, evalue, _tb, info in exc.elist:
            rank = by_engine.get(info.get("engine_id"), "?") if info else "?"
            lines.append(f"[rank {rank}] {ename}: {evalue}")
        first_tb = exc.elist[0][2] if exc.elist else ""
        if first_tb:
            lines.append("first traceback:\n" + strip_ansi(str(first_tb)))
        return "\n".join(lines)

    def _raise_died(self, handle: Any, ranks: Sequence[int]) -> NoReturn:
        # Give the launcher a moment to end the job and log the death.
        for _ in range(30):
            if self._engine_set_stopped():
                break
            time.sleep(0.1)
        time.sleep(0.3)
        how = deaths_in_log(self.launcher_output())
        alive = set(self._client.ids) if self._client is not None else set()
        dead = sorted(how) or [info.rank for info in self.ranks if info.engine_id not in alive] \
            or list(ranks)
        codes = self._launcher_exit_codes()
        details = "; ".join(f"rank {r} {how[r]}" for r in dead if r in how) or \
            (f"mpiexec exited with code {codes[0]}" if codes else "no exit status reported")
        self._died = f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} died: {details}"
        raise EngineDied(f"engine(s) of MPI rank(s) {dead} died during the call ({details}); the MPI "
                         f"job is gone: call cluster.restart() to get a working cluster", dead,
                         self._outputs_by_rank(dead, handle))

    def execute(self, code: str, timeout: float | None = None) -> None:
        """Run Python source on every engine (like ``%px``), with a timeout."""
        self._require_running()
        self.wait(self._view.execute(code, block=False), timeout=timeout)

    def push(self, namespace: Mapping[str, Any], timeout: float | None = None) -> None:
        """Set variables in every engine's namespace."""
        self._require_running()
        self.wait(self._view.push(dict(namespace), block=False), timeout=timeout)

    def pull(self, name: str, timeout: float | None = None) -> list[Any]:
        """A variable from every engine's namespace, indexed by MPI rank."""
        self._require_running()
        return self.wait(self._view.pull(name, block=False), timeout=timeout)


def launcher_exit_code(launcher: Any) -> int | None:
    """Exit code of a launcher's local process (mpiexec), None while it runs or if it has none here."""
    popen = getattr(launcher, "_popen_process", None)
    if popen is None:
        return None
    try:
        return popen.poll()
    except Exception:
        return None


def slurm_batch_template(options: Sequence[str], env: Mapping[str, str]) -> str:
    """sbatch script that starts the engines as one ``srun`` MPI job (ipyparallel template)."""
    lines = ["#!/bin/bash", "#SBATCH --job-name=mpi4dl-engines", "#SBATCH --ntasks={n}"]
    lines += [f"#SBATCH {opt}" for opt in options]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in env.items()
              if name != "PATH"]
    lines.append("srun {program_and_args} --mpi")
    return "\n".join(lines) + "\n"


def start(n: int = 4, **options: Any) -> Cluster:
    """Start a local (or hostfile/Slurm) MPI cluster of ``n`` engines; use as a context manager.

    Options are :class:`Cluster` fields: ``mpi`` ('auto'|'mpich'|'openmpi'), ``mpiexec``,
    ``launcher`` ('local'|'hostfile'|'slurm'), ``hostfile``, ``slurm_options``, ``env``,
    ``start_timeout``, ``call_timeout``, ``profile_dir``.
    """
    return Cluster(n=n, **options).start()


def connect(n: int | None = None, *, profile_dir: str | None = None, cluster_id: str = "",
            timeout: float = 60.0, call_timeout: float = 600.0) -> Cluster:
    """Attach to a running ipyparallel MPI cluster (e.g. ``ipcluster start --engines=mpi``).

    ``stop()`` on the result only disconnects; the cluster keeps running.
    """
    import ipyparallel as ipp

    kwargs: dict[str, Any] = {"cluster_id": cluster_id}
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
    cluster._view = client[:]
    identities = cluster._view.apply_async(_engine_identity).get(timeout=timeout)
    cluster.ranks = sorted((RankInfo(rank, eid, pid, host)
                            for eid, (rank, _, pid, host) in zip(client.ids, identities)),
                           key=lambda info: info.rank)
    cluster._view = client[[info.engine_id for info in cluster.ranks]]
    return cluster
