"""The Slurm path on a real one-node Slurm (engines/slurm/local_cluster.sh, as `make slurm-up` starts it): the
documented batch script runs, and scancel of it leaves no rank and a loadable checkpoint. tests/slurm/test_two_nodes.py
checks the batch job's exactness and the ipcluster Slurm profile on two nodes."""

from __future__ import annotations

import time

import pytest

from tests.slurm.local import BATCH, started
from tests.slurm.local import missing as slurm_missing
from tests.support.requirements import require_or_skip

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A started one-node Slurm (tests/slurm/local.py's LocalSlurm)."""
    require_or_skip(slurm_missing(), "the Slurm tests")
    with started(tmp_path_factory.mktemp("slurm-state") / "slurm") as cluster:
        yield cluster


def test_scancel_stops_every_rank_and_leaves_a_loadable_checkpoint(slurm, tmp_path):
    from mpi4dl_nb.checkpoint.files import latest_checkpoint, load_checkpoint

    checkpoints = tmp_path / "ck"
    env = dict(slurm.env, MPI4DL_CHECK_SERIAL="0")
    job = slurm.cmd("sbatch", "--parsable", "--overcommit", str(BATCH), "--steps", "100000",
                    "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1", cwd=tmp_path, env=env).strip()
    deadline = time.monotonic() + 300                       # a job starts in seconds; a loaded machine needs minutes
    while len(list(checkpoints.glob("step-*.pt"))) < 2:      # running, with at least one finished checkpoint
        if time.monotonic() > deadline:
            outputs = "\n".join(path.read_text()[-2000:] for path in tmp_path.glob("*.out"))
            pytest.fail(f"no checkpoints from job {job} within 300 s; its output:\n{outputs}")
        time.sleep(0.3)
    assert len(slurm.marked_ranks()) == 3
    slurm.cmd("scancel", job)
    slurm.wait_until_gone(job)
    state = slurm.cmd("scontrol", "show", "job", job)
    assert "JobState=CANCELLED" in state
    latest = latest_checkpoint(checkpoints)
    payload = load_checkpoint(latest)                       # the newest complete checkpoint, not a torn one
    assert payload["step"] >= 1 and payload["model"]
