"""The engine across test hosts, one 5-rank launch (tests/mpi/multihost.py): SP 2x2 with the tiles on h1 and h2 and
the layer stage on h3 equals one process in float64 on both data planes; each rank's node-local view (local rank,
node size, device index) counts its own host; a node-local checkpoint directory is refused, naming the hosts."""

from __future__ import annotations

import pytest

from tests.mpi.engine_exact import copies_name
from tests.support.checks import CheckReport
from tests.support.mpirun import launch_mpi

pytestmark = pytest.mark.multihost

SLOTS = ["h1", "h1", "h2", "h2", "h3"]      # tiles 0-1 on h1, tiles 2-3 on h2, the layer stage on h3
CASE = "sp_lp_square"                       # split 2, spatial 1, 2x2 square tiles


@pytest.fixture(scope="module")
def report(test_hosts) -> CheckReport:
    result = launch_mpi(len(SLOTS), "multihost", f"--hosts={','.join(SLOTS)}", f"--shared={test_hosts.shared}",
                        f"--scratch={test_hosts.scratch}", CASE, launcher=test_hosts.launcher, hosts=SLOTS,
                        env=test_hosts.selection, timeout=300)
    return result.checks


def test_every_rank_counts_its_own_host(report):
    report.require(["placement", "summary host"])


@pytest.mark.parametrize("plane", ["", "gloo: "], ids=["mpi", "gloo"])
def test_sp_2x2_on_two_hosts_with_the_layer_stage_on_a_third_is_exact(report, plane):
    report.require([plane + CASE, plane + copies_name(CASE)])


def test_a_node_local_checkpoint_directory_is_refused_before_training(report):
    report.require(["checkpoint dir shared", "checkpoint dir node-local refused"])
