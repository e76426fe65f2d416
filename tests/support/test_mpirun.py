"""The MPI test harness reports a failing rank's traceback, kills a hung job, and names failed,
missing and stalled checks with their rank."""

import time

import pytest

from tests.mpi.harness_probe import FAILS, PASSES, STALLS
from tests.support.checks import RANK_PREFIX, CheckFailure, CheckReport, CheckResult, Outcome
from tests.support.mpirun import MPIRunError, launch_mpi, run_mpi


@pytest.mark.mpi
def test_failing_rank_reports_its_traceback():
    with pytest.raises(MPIRunError) as info:
        run_mpi(3, "harness_probe", "fail", timeout=60)
    text = str(info.value)
    assert "failed with exit code" in text
    # unbuffered stderr writes a traceback line in pieces, each of which may get a rank prefix
    assert "RuntimeError: deliberate failure on rank 1" in RANK_PREFIX.sub("", text)
    assert "[1]" in text  # output lines carry the rank prefix


@pytest.mark.mpi
def test_hang_is_killed_and_reported():
    start = time.monotonic()
    with pytest.raises(MPIRunError, match="timed out after 5s and was killed"):
        run_mpi(2, "harness_probe", "hang", timeout=5)
    assert time.monotonic() - start < 30


@pytest.mark.mpi
def test_failed_and_missing_checks_are_named_with_their_rank():
    with pytest.raises(MPIRunError) as info:
        run_mpi(2, "harness_probe", "checks", timeout=60, checks=[PASSES, FAILS, "never runs"])
    text = str(info.value)
    assert "1 failed and 1 missing of 3 named checks" in text
    assert f"FAIL [rank 1] {FAILS}: AssertionError: rank 1 disagrees at harness_probe.py:" in text
    assert f"[rank 0] {FAILS}" not in text.split("--- output")[0]    # rank 0 passed it
    assert "MISSING never runs: no rank reported it" in text
    assert "job: " in text and "failed with exit code" in text


@pytest.mark.mpi
def test_out_of_step_ranks_are_aborted_soon_after_a_failure():
    with pytest.raises(MPIRunError) as info:
        run_mpi(2, "harness_probe", "stall", timeout=300)
    text = str(info.value)
    # the ranks' own 2 s grace ended the job, not this test's time limit (no wall-clock bound: two ranks' start-up
    # alone took most of a minute in a suite loaded 8-12 on two cores)
    assert "timed out after" not in text, text[-2000:]
    assert f"FAIL [rank 1] {STALLS}" in text
    assert "the ranks are out of step, aborting the job" in text


def record(name: str, rank: int, passed: bool) -> str:
    import json

    return "@@CHECK " + json.dumps({"name": name, "rank": rank, "passed": passed, "detail": "d"})


def test_report_parses_joined_lines_and_explains_job_failures():
    # a launcher may put two ranks' lines on one line
    output = f"[0] {record('a', 0, True)}[1] {record('a', 1, True)}\n[1] {record('b', 1, False)}\n"
    output += "[1] " + record("c", 1, True).replace('"rank"', '[1] "rank"') + "\n"   # a prefix inside
    report = CheckReport.parse(output, job_error="failed with exit code 1")
    assert report.results == [CheckResult("a", 0, True, "d"), CheckResult("a", 1, True, "d"),
                              CheckResult("b", 1, False, "d"), CheckResult("c", 1, True, "d")]
    report.require(["a"])                    # the job failure is explained by check b
    with pytest.raises(CheckFailure, match=r"FAIL \[rank 1\] b"):
        report.require(["b"])
    with pytest.raises(CheckFailure, match="MISSING e"):
        report.require(["a", "e"])
    with pytest.raises(CheckFailure, match="job: failed with exit code 1"):
        report.require_clean(["a"])
    crashed = CheckReport.parse(record("a", 0, True), job_error="failed with exit code 134")
    with pytest.raises(CheckFailure, match="exit code 134"):
        crashed.require(["a"])               # nothing explains the crash: every check fails
    CheckReport.parse(output.replace("false", "true")).require_clean(["a", "b"])
    assert Outcome().detail == ""


@pytest.mark.mpi
def test_a_shared_launch_keeps_each_job_s_checks_and_failures_apart():
    """Four jobs in one 2-rank launch (tests/mpi/battery.py): the same check name stays apart per
    job, each job starts from a fresh process's random state, a failed check or a raise is its
    own job's, and a launch that ended early fails only the jobs that did not end."""
    from tests.mpi.battery_probe import NAME
    from tests.support.battery import Job, encode, job_report

    jobs = [Job(2, "mpi", "battery_probe", (mode,), 60) for mode in ("pass", "fail", "raise", "pass ")]
    launch = launch_mpi(2, "battery", encode(jobs), timeout=60).checks
    assert launch.job_error is not None                                   # exit code 1: failures
    reports = [job_report(launch, job) for job in jobs]
    assert [len(r.results) for r in reports] == [2, 2, 2, 2]               # one check x 2 ranks each
    for rank in (0, 1):                      # every job draws the process's first random number
        drawn = {r.detail.split(",")[0] for report in reports for r in report.results if r.rank == rank and r.passed}
        assert len(drawn) == 1 and float(drawn.pop()) < 1, rank
    reports[0].require_clean([NAME])
    reports[3].require_clean([NAME])
    with pytest.raises(CheckFailure, match=r"FAIL \[rank 1\] the same name in every job"):
        reports[1].require([NAME])
    with pytest.raises(CheckFailure, match="raised outside its checks.*deliberate failure"):
        reports[2].require([NAME])           # its check passed, but a raise fails it as a crash would
    cut = CheckReport([r for r in launch.results if "pass " not in r.name], "timed out after 60s", "", "")
    with pytest.raises(CheckFailure, match="did not end on every rank .timed out after 60s"):
        job_report(cut, jobs[3]).require([NAME])
    job_report(cut, jobs[0]).require_clean([NAME])


@pytest.mark.mpi
def test_a_job_past_its_own_limit_ends_the_shared_launch_naming_itself():
    from tests.mpi.battery_probe import NAME
    from tests.support.battery import Job, encode, job_report

    jobs = [Job(2, "mpi", "battery_probe", ("pass",), 60), Job(2, "mpi", "battery_probe", ("hang",), 3),
            Job(2, "mpi", "battery_probe", ("pass ",), 60)]
    start = time.monotonic()
    result = launch_mpi(2, "battery", encode(jobs), timeout=120)
    assert time.monotonic() - start < 60 and not result.timed_out        # its own 3 s, not the launch's 120
    assert "job 'battery_probe hang' ran past its 3 s limit; aborting the launch" in result.stdout
    job_report(result.checks, jobs[0]).require_clean([NAME])
    with pytest.raises(CheckFailure, match="did not end on every rank"):
        job_report(result.checks, jobs[1]).require([NAME])
    with pytest.raises(CheckFailure, match="MISSING the same name"):
        job_report(result.checks, jobs[2]).require([NAME])
