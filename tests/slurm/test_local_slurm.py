"""The Slurm path on a real one-node Slurm (engines/slurm/local_cluster.sh): the documented batch script, the
ipcluster Slurm profile driven from Python, and scancel of a running job."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ipyparallel import interactive

from tests.support.requirements import require_or_skip

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "engines" / "slurm" / "local_cluster.sh"
BATCH = REPO / "engines" / "slurm" / "train.sbatch"
PROFILE = REPO / "engines" / "profile_slurm"
BIN = Path(sys.executable).parent


def missing() -> list[str]:
    found = [tool for tool in ("slurmctld", "slurmd", "sbatch", "munged")
             if not (shutil.which(tool) or Path("/usr/sbin", tool).exists())]
    needs = [f"{', '.join(found)} (apt: slurm-wlm, munge)"] if found else []
    if os.geteuid() != 0:
        needs.append("root (to start munged, slurmctld and slurmd)")
    return needs


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A started one-node Slurm; yields the environment for its clients (SLURM_CONF, this venv, a marker)."""
    require_or_skip(missing(), "the Slurm tests")
    state = tmp_path_factory.mktemp("slurm-state")
    env = dict(os.environ, MPI4DL_SLURM_DIR=str(state / "slurm"), MPI4DL_PYTHON=sys.executable,
               PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               MPI4DL_SLURM_MARK=secrets.token_hex(8))
    started = subprocess.run(["bash", str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=90)
    assert started.returncode == 0, started.stderr
    env["SLURM_CONF"] = started.stdout.strip().rsplit("=", 1)[1]
    try:
        yield env
    finally:
        stopped = subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=90)
        assert stopped.returncode == 0, stopped.stderr


def slurm_cmd(env, *args: str, timeout: float = 60, cwd: Path | None = None) -> str:
    done = subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert done.returncode == 0, f"{' '.join(args)}: {done.stderr}"
    return done.stdout


def run_batch_job(env, script: Path, *args: str, timeout: float, cwd: Path) -> str:
    """Submit ``script`` and wait for it to end (state polled every 0.3 s: ``sbatch --wait`` polls with a
    back-off up to 10 s and returned here ~25 s after the job had ended); its ``scontrol show job`` record."""
    job = slurm_cmd(env, "sbatch", "--parsable", *args, str(script), timeout=60, cwd=cwd).strip()
    deadline = time.monotonic() + timeout
    while True:
        record = slurm_cmd(env, "scontrol", "show", "job", "--oneliner", job)
        state = record.split("JobState=", 1)[1].split()[0]
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            outputs = "\n".join(path.read_text()[-3000:] for path in cwd.glob("*.out"))
            assert state == "COMPLETED" and " ExitCode=0:0" in record, f"job {job}: {state}\n{outputs}"
            return record
        if time.monotonic() > deadline:
            slurm_cmd(env, "scancel", job)
            pytest.fail(f"job {job} still {state} after {timeout} s")
        time.sleep(0.3)


def marked_ranks(env) -> list[str]:
    """Live python processes carrying this run's marker: the job's ranks (they inherit the submit environment)."""
    needle = f"MPI4DL_SLURM_MARK={env['MPI4DL_SLURM_MARK']}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and needle in (entry / "environ").read_bytes().split(b"\0"):
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
                if argv[1:3] == ["-m", "mpi4dl_nb"]:            # a rank (not srun, not this test)
                    found.append(" ".join(argv))
        except OSError:
            continue
    return found


def slurm_job_of(pid: int) -> str | None:
    """The Slurm job id a process was started in (from its environment as srun set it), or None."""
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if item.startswith(b"SLURM_JOB_ID="):
            return item.split(b"=", 1)[1].decode()
    return None


def test_sbatch_runs_the_documented_sp_lp_job_and_it_is_exact(slurm, tmp_path):
    # --overcommit: 3 ranks on this machine's cores (a real partition has a core per rank)
    run_batch_job(slurm, BATCH, "--overcommit", timeout=300, cwd=tmp_path)
    (output,) = tmp_path.glob("mpi4dl-train-*.out")
    text = output.read_text()
    summary = json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
    config = summary["config"]
    assert summary["world_size"] == 3 and (config["split_size"], config["spatial_size"]) == (2, 1)   # SP + LP
    assert "exactness: 3 ranks vs 1 process, 2 steps in float64" in text and "-> exact" in text, text


@interactive
def _spatial_step():
    """One float64 training step of a conv on 2 tiles vs the same step in this process alone (on every rank)."""
    import torch
    from torch import nn

    import mpi4dl_nb as dl

    ctx = dl.init()
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1).double()
    x = torch.randn(1, 3, 16, 16, dtype=torch.float64)
    reference = conv(x)
    reference.square().sum().backward()
    ref_grad = conv.weight.grad.clone()
    conv.zero_grad()
    grid = dl.TileGrid(1, 2)
    tile_out = dl.spatialize(conv, grid, ctx)(dl.scatter_tiles(x, grid, ctx))
    tile_out.square().sum().backward()
    grad = conv.weight.grad.clone()
    ctx.all_reduce(grad)
    full = dl.gather_tiles(tile_out.detach(), grid, ctx)
    return ctx.rank, ctx.world_size, float((full - reference).abs().max()), float((grad - ref_grad).abs().max())


def test_ipcluster_slurm_profile_runs_an_exact_spatial_step(slurm, tmp_path):
    import mpi4dl_nb as dl

    profile = tmp_path / "profile_slurm"
    shutil.copytree(PROFILE, profile)                     # ipcluster writes logs and keys into its profile
    env = dict(slurm, MPI4DL_SLURM_OPTIONS="--overcommit --time=00:10:00")
    ipcluster = [str(BIN / "ipcluster"), "start", "-n", "2", f"--profile-dir={profile}", "--daemonize"]
    slurm_cmd(env, *ipcluster, timeout=120, cwd=tmp_path)      # the job script and its log land in cwd
    try:
        with dl.cluster.connect(n=2, profile_dir=str(profile), timeout=120) as cluster:
            results = cluster.run(_spatial_step, timeout=120)
            jobs = {slurm_job_of(info.pid) for info in cluster.ranks}
        assert [r[:2] for r in results] == [(0, 2), (1, 2)]
        (job,) = jobs                                               # both ranks are tasks of one Slurm job ...
        assert job and "mpi4dl-engines" in slurm_cmd(slurm, "squeue", "--noheader", "--format=%j", f"--jobs={job}")
        assert all(out_err < 1e-12 and grad_err < 1e-12 for *_, out_err, grad_err in results)   # ... and exact
    finally:
        subprocess.run([str(BIN / "ipcluster"), "stop", f"--profile-dir={profile}"], env=env,
                       capture_output=True, timeout=120, cwd=tmp_path)
    deadline = time.monotonic() + 30
    while slurm_cmd(slurm, "squeue", "--noheader").strip():
        assert time.monotonic() < deadline, "the engines' Slurm job outlived ipcluster stop"
        time.sleep(0.5)


def test_scancel_stops_every_rank_and_leaves_a_loadable_checkpoint(slurm, tmp_path):
    from mpi4dl_nb.checkpoint.files import latest_checkpoint, load_checkpoint

    checkpoints = tmp_path / "ck"
    env = dict(slurm, MPI4DL_CHECK_SERIAL="0")
    job = slurm_cmd(env, "sbatch", "--parsable", "--overcommit", str(BATCH), "--steps", "100000",
                    "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1", cwd=tmp_path).strip()
    deadline = time.monotonic() + 300                       # a job starts in seconds; a loaded machine needs minutes
    while len(list(checkpoints.glob("step-*.pt"))) < 2:      # running, with at least one finished checkpoint
        if time.monotonic() > deadline:
            outputs = "\n".join(path.read_text()[-2000:] for path in tmp_path.glob("*.out"))
            pytest.fail(f"no checkpoints from job {job} within 300 s; its output:\n{outputs}")
        time.sleep(0.3)
    assert len(marked_ranks(slurm)) == 3
    slurm_cmd(slurm, "scancel", job)
    deadline = time.monotonic() + 30
    while marked_ranks(slurm) or slurm_cmd(slurm, "squeue", "--noheader", f"--jobs={job}").strip():
        assert time.monotonic() < deadline, f"left after scancel: {marked_ranks(slurm)}"
        time.sleep(0.3)
    state = slurm_cmd(slurm, "scontrol", "show", "job", job)
    assert "JobState=CANCELLED" in state
    latest = latest_checkpoint(checkpoints)
    payload = load_checkpoint(latest)                       # the newest complete checkpoint, not a torn one
    assert payload["step"] >= 1 and payload["model"]
