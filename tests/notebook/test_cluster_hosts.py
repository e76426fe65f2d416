"""``dl.cluster.start(n, hosts=[...])`` without starting anything: the settings checked, the engines placed with the
launcher's host list, the controller's address the one towards the hosts (tests/multihost runs it for real)."""

from __future__ import annotations

import pytest

from mpi4dl_nb.comm.launcher import Launcher, MPIFlavor
from mpi4dl_nb.notebook import cluster as clu


def test_hosts_place_the_engines_round_robin_through_the_one_launcher():
    cluster = clu.Cluster(n=4, mpi="mpich", mpiexec="/opt/mpi/bin/mpiexec", hosts=["h1", "h2"])
    assert cluster.launcher is clu.EnginePlacement.HOSTS
    settings = cluster._engine_launcher_kwargs()
    launcher = Launcher("/opt/mpi/bin/mpiexec", MPIFlavor.MPICH)
    assert settings["mpi_args"] == launcher.flags(settings["environment"], hosts=["h1", "h2"])
    assert "-hosts" in settings["mpi_args"]


def test_hosts_are_refused_with_a_hostfile_or_slurm_and_needed_by_launcher_hosts():
    with pytest.raises(ValueError, match="hostfile"):
        clu.Cluster(n=2, launcher="hostfile", hostfile="h.txt", hosts=["h1"])
    with pytest.raises(ValueError, match="Slurm"):
        clu.Cluster(n=2, launcher="slurm", hosts=["h1"])
    with pytest.raises(ValueError, match="needs hosts"):
        clu.Cluster(n=2, launcher="hosts")


def test_the_controller_listens_where_the_hosts_reach_this_machine():
    assert clu.controller_address(["localhost"]).startswith("127.")
    with pytest.raises(ValueError, match="no route from this machine"):
        clu.controller_address(["no-such-host.invalid"])


def test_the_watcher_takes_a_temporary_profile_to_remove():
    from mpi4dl_nb.notebook import reaper

    watched: dict[int, float] = {}
    known: dict[int, float] = {}
    folders: list[str] = []
    assert reaper.handle("remove /tmp/mpi4dl-ipp-x y", watched, known, folders)
    assert folders == ["/tmp/mpi4dl-ipp-x y"]
    reaper.handle("forget", watched, known, folders)
    assert folders == []
