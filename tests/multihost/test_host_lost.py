"""A host lost mid-run: `train` over h1 and h2, h2 killed during step 3 (its link cut first, as a crash): every rank
left exits within the stall-watchdog time with one message naming h2, and the last checkpoint, on the shared
directory, resumes exactly with rank 0 on another host (h3, h1: a different host layout). A host lost during the
teardown (issue 51: killed right after the summary line, ``mpiexec`` waited for it for ever): the job ends within
60 s with exit code 6, naming h2 once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpi4dl_nb.comm.launcher import PACKAGE_ROOT, rank_environment
from mpi4dl_nb.run.monitor import EXIT_HOST_LOST

pytestmark = pytest.mark.multihost

MODEL = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4", "--image-size",
         "32", "--batch-size", "2", "--dtype", "float64", "--seed", "3"]
PARALLEL = ["--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "2", "--slice-method", "vertical"]
SERIAL = ["--split-size", "1", "--spatial-size", "0", "--num-spatial-parts", "1"]
STEP_TIMEOUT = 10          # the stall watchdog's time, and so how long a silent host may take to count as lost
RESUMED_STEPS = 5
TEARDOWN_LIMIT = 60        # seconds from the kill after the summary line to the launcher's exit (issue 51)
SLOW_EXIT = '''"""Every rank's exit hooks take two seconds (a teardown that takes a while): a host killed right
after the summary line is then killed while the job tears down."""
import atexit
import time

atexit.register(time.sleep, 2.0)
'''


def train(*flags: str) -> list[str]:
    return [sys.executable, "-m", "mpi4dl_nb", "train", *MODEL, *flags]


def summary(output: str) -> dict[str, object]:
    """The run's JSON summary: its last line starting with ``{``."""
    return dict(json.loads([line for line in output.splitlines() if line.startswith("{")][-1]))


def wait_for(proc: subprocess.Popen[str], text: str, timeout: float) -> str:
    """Read ``proc``'s output until a line holds ``text``; everything read so far."""
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        seen.append(line)
        if text in line:
            return "".join(seen)
        assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n{''.join(seen)}"
    pytest.fail(f"the job ended before {text!r}:\n{''.join(seen)}")


def wait_for_file(folder: Path, pattern: str, timeout: float) -> None:
    """Wait until a file matching ``pattern`` is in ``folder`` (the progress line of a step comes before its
    checkpoint is written: a kill right after it may otherwise land during that save)."""
    deadline = time.monotonic() + timeout
    while not list(folder.glob(pattern)):
        assert time.monotonic() < deadline, f"no {pattern} in {folder} within {timeout} s"
        time.sleep(0.1)


def test_a_killed_host_ends_the_job_naming_it_and_the_last_checkpoint_resumes_exactly(test_hosts, tmp_path):
    checkpoints = test_hosts.shared / "lost-host-ck"
    serial = subprocess.Popen(train(*SERIAL, "--steps", str(RESUMED_STEPS), "--no-progress"), cwd=tmp_path,
                              env=rank_environment(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    job = test_hosts.launcher.command(3, train(*PARALLEL, "--steps", "40", "--checkpoint-dir", str(checkpoints),
                                               "--checkpoint-every", "1", "--step-timeout", str(STEP_TIMEOUT)),
                                      hosts=["h1", "h2"], tag_output=False)     # ranks 0, 2 on h1, rank 1 on h2
    proc = subprocess.Popen(job, cwd=tmp_path, env=rank_environment(3, test_hosts.selection, hosts=["h1", "h2"]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        before = wait_for(proc, "step 1/40", timeout=240)    # the first line (then one every 5 s off a terminal)
        wait_for_file(checkpoints, "step-00000002-*.json", timeout=60)  # step 2 committed: step 3 under way
        test_hosts.kill("h2")
        killed = time.monotonic()
        rest, _ = proc.communicate(timeout=STEP_TIMEOUT + 45)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        test_hosts.revive("h2")
    output = before + rest
    print(f"\n[batch-jobs table] a lost host: exit {proc.returncode} after {took:.1f} s "
          f"(--step-timeout {STEP_TIMEOUT})")
    assert proc.returncode == EXIT_HOST_LOST, output
    assert took < STEP_TIMEOUT + 30, f"the job took {took:.0f} s to end after the kill:\n{output}"
    assert output.count("lost host h2 (rank 1)") == 1, output
    settled = time.monotonic() + 15                 # ranks that mpiexec's abort killed may take a moment to go
    while test_hosts.pids("h1") and time.monotonic() < settled:
        time.sleep(0.2)
    assert not test_hosts.pids("h1"), f"ranks left on h1 15 s after the job ended: {test_hosts.pids('h1')}"
    resumed = test_hosts.launcher.command(3, train(*PARALLEL, "--steps", str(RESUMED_STEPS), "--checkpoint-dir",
                                                   str(checkpoints), "--resume", "latest", "--no-progress"),
                                          hosts=["h3", "h1"], tag_output=False)     # rank 0 now on h3
    done = subprocess.run(resumed, cwd=tmp_path, env=rank_environment(3, test_hosts.selection, hosts=["h3", "h1"]),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, done.stdout
    resumed_run = summary(done.stdout)
    reference, _ = serial.communicate(timeout=300)
    assert serial.returncode == 0, reference
    start, tail, want = resumed_run["start_step"], resumed_run["losses"], summary(reference)["losses"]
    assert isinstance(start, int) and isinstance(tail, list) and isinstance(want, list)
    assert start >= 2 and len(tail) == RESUMED_STEPS - start, done.stdout
    assert max(abs(a - b) for a, b in zip(tail, want[start:])) < 1e-9, (tail, want)
    assert resumed_run["hosts"] == ["h3", "h1", "h3"]


def test_a_host_killed_after_the_summary_line_ends_the_job_within_60_s_naming_it(test_hosts, tmp_path):
    slow = tmp_path / "slow-exit"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_EXIT)            # imported by every rank at start-up
    paths = {"PYTHONPATH": os.pathsep.join([str(slow), str(PACKAGE_ROOT)])}
    job = test_hosts.launcher.command(3, train(*PARALLEL, "--steps", "2", "--no-progress"), hosts=["h1", "h2"],
                                      tag_output=False)          # ranks 0, 2 on h1, rank 1 on h2
    proc = subprocess.Popen(job, cwd=tmp_path, env=rank_environment(3, {**test_hosts.selection, **paths},
                                                                     hosts=["h1", "h2"]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        before = wait_for(proc, '{"model"', timeout=240)           # the summary line: the job is done
        test_hosts.kill("h2")
        killed = time.monotonic()
        rest, _ = proc.communicate(timeout=TEARDOWN_LIMIT + 30)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        test_hosts.revive("h2")
    output = before + rest
    print(f"\n[batch-jobs table] a host lost in the teardown: exit {proc.returncode} after {took:.1f} s")
    assert took < TEARDOWN_LIMIT, f"the job took {took:.0f} s to end after the kill:\n{output}"
    assert proc.returncode == EXIT_HOST_LOST, output
    assert output.count("lost host h2 (rank 1)") == 1, output
    assert "no heartbeat" in output and "after the job's summary, in MPI's teardown" in output
    assert summary(before)["steps_run"] == 2
    settled = time.monotonic() + 15
    while test_hosts.pids("h1") and time.monotonic() < settled:
        time.sleep(0.2)
    assert not test_hosts.pids("h1"), f"ranks left on h1 15 s after the job ended: {test_hosts.pids('h1')}"
