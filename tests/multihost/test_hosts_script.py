"""engines/hosts/hosts.sh itself, on a set of its own (two hosts, 1 Gbit/s links): hosts with their own names, disks
and /dev/shm; nothing added to the machine's own network; the rate limit; kill and revive; down, twice; a set whose
owner (``up --owner PID``) is killed goes down by itself."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.multihost.hosts import HostSet, missing, suite_prefix
from tests.support.requirements import require_or_skip

pytestmark = pytest.mark.multihost


def own_network() -> tuple[str, str]:
    """The machine's own interfaces and addresses (the root network namespace), without counters."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    addresses = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True).stdout
    return "\n".join(line.split(" qlen")[0] for line in links.splitlines()), addresses


def on(hosts: HostSet, host: str, script: str) -> str:
    done = hosts.run(host, ["sh", "-c", script], timeout=60)
    assert done.returncode == 0, done.stdout
    return done.stdout.strip()


def test_hosts_up_to_down(tmp_path):
    require_or_skip(missing(), "the multihost tests")
    before = own_network()
    hosts = HostSet(tmp_path / "hosts", suite_prefix("u"), 2)
    try:
        assert "engines/hosts/mpiexec -n" in hosts.script("up", "2", "--rate", "1gbit")    # says how to launch
        assert own_network() == before                         # no interface, no address in the machine's own
        for host in hosts.names:
            assert on(hosts, host, "hostname") == host
            assert on(hosts, host, "getent hosts h1 h2 head | wc -l") == "3"
            assert "default" not in on(hosts, host, "ip route")    # no way out
            assert "tbf" in on(hosts, host, "tc qdisc show dev eth0") and "1Gbit" in on(hosts, host,
                                                                                       "tc qdisc show dev eth0")
            on(hosts, host, f"echo {host} > {hosts.scratch}/disk; echo {host} > {hosts.shared}/$(hostname)"
                            f"; echo {host} > /dev/shm/segment")
        assert on(hosts, "head", "tc qdisc show dev h1").count("tbf") == 1          # both directions limited
        assert on(hosts, "h1", f"cat {hosts.scratch}/disk /dev/shm/segment") == "h1\nh1"    # node-local ...
        assert on(hosts, "h2", f"cat {hosts.scratch}/disk /dev/shm/segment") == "h2\nh2"
        assert not (hosts.scratch / "disk").exists() and not os.path.exists("/dev/shm/segment")
        assert sorted(p.name for p in hosts.shared.iterdir()) == ["h1", "h2"]        # ... and shared
        sleeper = hosts.start("h2", ["sleep", "600"])
        deadline = time.monotonic() + 30
        while not hosts.pids("h2"):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert "link down, 1 processes killed" in hosts.kill("h2")
        assert sleeper.wait(timeout=30) != 0 and hosts.pids("h2") == []
        assert "link down" in hosts.script("status")
        hosts.revive("h2")
        assert "link down" not in hosts.script("status")
    finally:
        first = hosts.down()
    assert "kept" in first and (hosts.shared / "h1").exists()          # the shared directory keeps its files
    assert "0 namespaces removed" in hosts.down()                       # safe twice
    assert not hosts.left_behind() and own_network() == before


def test_hosts_go_down_by_themselves_when_their_owner_is_killed(tmp_path):
    require_or_skip(missing(), "the multihost tests")
    owner = subprocess.Popen(["sleep", "600"])
    hosts = HostSet(tmp_path / "owned", suite_prefix("o"), 1)
    try:
        assert f"taken down when process {owner.pid} ends" in hosts.script("up", "1", "--owner", str(owner.pid))
        assert hosts.left_behind()
        owner.kill()                        # killed before any teardown of its own
        owner.wait(timeout=30)
        deadline = time.monotonic() + 30
        while hosts.left_behind() or hosts.directory.exists():     # the directory goes last, after the state
            assert time.monotonic() < deadline, \
                f"left 30 s after the owner died: {hosts.left_behind() or [str(hosts.directory)]}"
            time.sleep(0.2)
    finally:
        owner.kill()
        hosts.down()
