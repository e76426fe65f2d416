"""Launches over hosts (comm/launcher.py): the host list MPICH and Open MPI take, where each rank lands, and the
per-node count that decides whether MPICH yields its core."""

from __future__ import annotations

import pytest

from mpi4dl_nb.comm.launcher import (
    YIELD_ENV,
    Launcher,
    MPIFlavor,
    host_slots,
    placement,
    rank_environment,
    ranks_per_node,
)


def test_slots_group_repeated_names():
    assert host_slots(["h1", "h1", "h2", "h3", "h3"]) == "h1:2,h2:1,h3:2"
    assert host_slots(["a", "b", "a"]) == "a:1,b:1,a:1"
    with pytest.raises(ValueError, match="one per slot"):
        host_slots(["h1:2"])


def test_ranks_fill_the_slots_in_order_and_cycle():
    assert placement(5, ["h1", "h1", "h2", "h2", "h3"]) == ["h1", "h1", "h2", "h2", "h3"]
    assert placement(3, ["h1", "h2"]) == ["h1", "h2", "h1"]            # round-robin, as hydra's -hosts h1,h2
    assert ranks_per_node(3, ["h1", "h2"]) == 2 and ranks_per_node(3) == 3


def test_host_flags_of_both_flavours():
    assert Launcher("mpiexec", MPIFlavor.MPICH).flags(hosts=["h1", "h2"], tag_output=False) == ["-hosts", "h1:1,h2:1"]
    ompi = Launcher("mpirun", MPIFlavor.OPENMPI).flags(hosts=["h1", "h1", "h2"], as_root=False, tag_output=False)
    assert ompi[ompi.index("--host") + 1] == "h1:2,h2:1" and "--map-by" in ompi
    with pytest.raises(ValueError, match="not both"):
        Launcher("mpiexec", MPIFlavor.MPICH).flags(hostfile="hosts.txt", hosts=["h1"])


def test_yield_follows_the_busiest_node_not_the_world():
    spread = rank_environment(4, cores=2, base={}, hosts=["h1", "h2"])      # 2 ranks per node on 2 cores
    assert not set(YIELD_ENV) & set(spread)
    crowded = rank_environment(4, cores=2, base={}, hosts=["h1", "h1", "h1", "h2"])    # 3 on h1
    assert crowded[next(iter(YIELD_ENV))] == "1"
    assert next(iter(YIELD_ENV)) in rank_environment(4, cores=2, base={})   # all 4 on this node
