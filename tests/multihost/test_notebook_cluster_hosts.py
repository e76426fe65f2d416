"""The notebook cluster across test hosts: ``dl.cluster.start(n, hosts=["h1", "h2"])`` from the head puts one engine on
each host and they compute an exact spatial step; its connection files are 0600; from h2, code signed with a wrong
key runs on no engine, a client and an engine with a wrong key are refused; and when the notebook's process dies
(a kernel going away) no engine, controller or launcher is left on any host, nor its connection files."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from tests.multihost.hosts import MPIEXEC

pytestmark = pytest.mark.multihost

HOSTS = ["h1", "h2"]


def wait_for_file(path, proc, timeout: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"the driver exited ({proc.returncode}):\n{proc.stdout.read() if proc.stdout else ''}")
        assert time.monotonic() < deadline, f"no {path.name} within {timeout} s"
        time.sleep(0.2)
    return dict(json.loads(path.read_text()))


def test_cluster_on_two_hosts_refuses_wrong_keys_and_ends_with_its_kernel(test_hosts, tmp_path):
    out = test_hosts.shared / "notebook"
    out.mkdir()
    driver = test_hosts.start("head", [sys.executable, "-m", "tests.multihost.cluster_driver", str(out),
                                       str(MPIEXEC), *HOSTS])
    try:
        cluster = wait_for_file(out / "cluster.json", driver, timeout=300)
        steps = cluster["steps"]
        assert isinstance(steps, list)
        assert [(rank, size, host) for rank, size, host, *_ in steps] == [(0, 2, "h1"), (1, 2, "h2")]
        assert all(out_err < 1e-12 and grad_err < 1e-12 for *_, out_err, grad_err in steps), steps
        modes = cluster["modes"]
        assert isinstance(modes, dict) and len(modes) == 2 and set(modes.values()) == {"0o600"}, modes
        assert cluster["profile_mode"] == "0o700"
        intruder = test_hosts.run("h2", [sys.executable, "-m", "tests.multihost.intruder", str(out)], timeout=300)
        assert intruder.returncode == 0, intruder.stdout
        report = json.loads((out / "intruder.json").read_text())
        assert report["right_key_markers"] == ["right-h1", "right-h2"], report     # the route works ...
        assert report["wrong_key_markers"] == [], report                           # ... a wrong key runs nothing
        assert report["client"] != "connected", report
        assert report["engine"]["code"] != 0 and "Registration timed out" in report["engine"]["said"], report
        (out / "intruders-done").touch()
        assert wait_for_file(out / "after.json", driver, timeout=60) == {"engines": 2}   # the intruder never joined
    finally:
        os.kill(driver.pid, signal.SIGKILL)        # the kernel dies: hosts.sh run exec'd into the driver
        driver.wait(timeout=30)
    deadline = time.monotonic() + 30
    while left := {host: test_hosts.pids(host) for host in ["head", *HOSTS] if test_hosts.pids(host)}:
        assert time.monotonic() < deadline, f"processes left 30 s after the driver died: {left}"
        time.sleep(0.5)
    assert not os.path.exists(str(cluster["profile"])), "the temporary profile (keys) outlived the driver"
