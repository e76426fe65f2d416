"""Slurm with two nodes on test hosts (engines/slurm/local_cluster.sh start --nodes 2: slurmctld on the head, a slurmd
on h1 and on h2): the documented batch script with -N 2 is exact across both nodes, the ipcluster Slurm profile puts
engines on both (an exact spatial step between them), and scancel of the engines' job leaves no rank on either."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from tests.multihost.hosts import HostSet, suite_prefix
from tests.multihost.hosts import missing as hosts_missing
from tests.slurm.local import BATCH, BIN, PROFILE, started
from tests.slurm.local import missing as slurm_missing
from tests.support.requirements import require_or_skip

pytestmark = [pytest.mark.slurm, pytest.mark.multihost]

NODES = ["h1", "h2"]
ENGINE_PROGRAM = ("-m", "ipyparallel.engine")


@pytest.fixture(scope="module")
def hosts_and_slurm(tmp_path_factory):
    """(HostSet, LocalSlurm): two test hosts brought up by local_cluster.sh, which takes them down on stop."""
    require_or_skip(slurm_missing() + hosts_missing(), "the two-node Slurm tests")
    hosts = HostSet(tmp_path_factory.mktemp("slurm-hosts"), suite_prefix("s"), len(NODES))
    try:
        with started(tmp_path_factory.mktemp("slurm2-state") / "slurm", nodes=len(NODES),
                     extra_env=hosts.selection) as slurm:
            yield hosts, slurm
    finally:
        assert not hosts.left_behind(), f"test hosts left after local_cluster.sh stop: {hosts.left_behind()}"


def test_sbatch_on_two_nodes_is_exact(hosts_and_slurm):
    hosts, slurm = hosts_and_slurm
    work = hosts.shared / "batch"
    work.mkdir()
    slurm.run_batch_job(BATCH, "-N", "2", timeout=300, cwd=work)
    (output,) = work.glob("mpi4dl-train-*.out")
    text = output.read_text()
    summary = json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
    assert summary["world_size"] == 3 and sorted(set(summary["hosts"])) == NODES, summary["hosts"]
    assert "exactness: 3 ranks vs 1 process, 2 steps in float64" in text and "-> exact" in text, text


def test_slurm_profile_puts_engines_on_both_nodes_and_scancel_leaves_none(hosts_and_slurm):
    hosts, slurm = hosts_and_slurm
    work = hosts.shared / "profile"
    profile = work / "profile_slurm"
    shutil.copytree(PROFILE, profile)                     # ipcluster writes logs and keys into its profile
    env = dict(slurm.env, MPI4DL_SLURM_OPTIONS="--nodes=2 --ntasks-per-node=1 --time=00:10:00")
    ipcluster = [str(BIN / "ipcluster"), f"--profile-dir={profile}"]
    slurm.cmd(ipcluster[0], "start", "-n", "2", *ipcluster[1:], "--daemonize", timeout=120, cwd=work, env=env)
    try:
        found = json.loads(slurm.cmd(sys.executable, "-m", "tests.slurm.profile_driver", str(profile), "2",
                                     timeout=300, env=env).splitlines()[-1])
        assert [tuple(step[:3]) for step in found["steps"]] == [(0, 2, "h1"), (1, 2, "h2")], found
        assert all(out_err < 1e-12 and grad_err < 1e-12 for *_, out_err, grad_err in found["steps"]), found
        (job,) = found["jobs"]                               # both engines are tasks of one Slurm job
        running = {host: hosts.pids(host) for host in NODES}
        assert len(slurm.marked_ranks(ENGINE_PROGRAM)) == 2, running
        slurm.cmd("scancel", job)
        slurm.wait_until_gone(job, program=ENGINE_PROGRAM)
    finally:
        slurm.cmd(ipcluster[0], "stop", *ipcluster[1:], timeout=120, cwd=work, env=env, check=False)
