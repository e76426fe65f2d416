"""Benchmark jobs under ``mpiexec``: the project's one launcher, the ranks' environment, a JSON result read back."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence

from mpi4dl_nb.comm.launcher import Launcher, rank_environment


def mpi_command(ranks: int, argv: Sequence[str]) -> list[str]:
    """``mpiexec -n ranks argv...`` as the package launches jobs (output not rank-tagged: it is parsed)."""
    return Launcher.find().command(ranks, argv, tag_output=False)


def run_job(ranks: int, argv: Sequence[str], extra_env: Mapping[str, str] | None = None,
            timeout: float | None = None, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` on ``ranks`` ranks with the ranks' environment (one thread, tuned malloc, MPICH yielding
    when ranks outnumber cores); raises with the job's output when it fails."""
    command = mpi_command(ranks, argv)
    done = subprocess.run(command, capture_output=True, text=True, env=rank_environment(ranks, extra_env),
                          timeout=timeout, cwd=cwd)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed (exit {done.returncode}):\n"
                           f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def last_json(output: str, prefix: str = "") -> dict:
    """The last line of ``output`` that starts with ``prefix`` and then a JSON object, parsed."""
    for line in reversed(output.splitlines()):
        if line.startswith(prefix) and line[len(prefix):].lstrip().startswith("{"):
            return json.loads(line[len(prefix):])
    raise RuntimeError(f"no JSON line{f' after {prefix!r}' if prefix else ''} in the job's output:\n{output[-2000:]}")
