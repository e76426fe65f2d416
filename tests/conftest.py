"""Shared pytest set-up: the MPI launcher as fixtures (one launch per job, shared by a module's tests), the
``mpi`` marker (tests/support/mpi_marker.py: every test that launches, so ``pytest -m "not mpi"`` is the fast loop)."""

from __future__ import annotations

import pytest

from tests.support.battery import END, REGISTERED, Job, encode, job_report
from tests.support.checks import CheckReport
from tests.support.cost_plugin import note_launch
from tests.support.mpirun import launch_mpi, run_mpi

pytest_plugins = ["tests.support.mpi_marker", "pytester"]


@pytest.fixture
def mpirun():
    """``mpirun(n, program, *args, timeout=..., checks=[names])`` runs tests/mpi/<program>.py on n
    ranks and raises on any failed or missing check (``module=True``: ``python -m program``)."""
    return run_mpi


@pytest.fixture(scope="module")
def mpi_checks():
    """``mpi_checks(n, program, *args, timeout=...)``: the CheckReport of one launch, run once per
    argument list and shared by the module's tests, so each test can require its own named checks
    (``report.require([name])``) without paying for another launch."""
    reports: dict[tuple, CheckReport] = {}

    def launch(nprocs: int, program: str, *args: object, timeout: float = 180) -> CheckReport:
        key = (nprocs, program, *map(str, args))
        if key not in reports:
            reports[key] = launch_mpi(nprocs, program, *args, timeout=timeout).checks
        return reports[key]

    return launch


@pytest.fixture(scope="session")
def shared_launch():
    """``shared_launch(job)``: the CheckReport of a ``shared_job`` (tests/support/battery.py). The
    first request for a world size and plane runs every job registered for them in one launch."""
    reports: dict[tuple, CheckReport] = {}

    def report(job: Job) -> CheckReport:
        if job.launch not in reports:
            jobs = REGISTERED[job.launch]
            reports[job.launch] = launch_mpi(job.nprocs, "battery", encode(jobs),
                                             timeout=sum(j.timeout for j in jobs)).checks
            note_launch(((r.name, r.rank, r.detail) for r in reports[job.launch].results), END)
        return job_report(reports[job.launch], job)

    return report


# Notebooks whose JupyterLab Run All checks everything their headless run checks (no error, figures
# shown; for 04 and 06 also their printed output, through tests/support/notebook_output.py).
LAB_COVERS_HEADLESS = ("01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11", "12", "13")


def _lab_runs(items: list[pytest.Item]) -> set[str]:
    """Notebook numbers a collected browser test runs with Run All in this session."""
    numbers = set()
    for item in items:
        if "tests/ui/test_notebooks_in_lab.py" not in item.nodeid.replace("\\", "/"):
            continue
        name = item.name
        if name.startswith("test_0"):
            numbers.add(name[5:7])
        elif name.startswith("test_notebook_runs_clean_in_lab["):
            numbers.add(name.split("[", 1)[1][:2])
    return numbers


def limit_shared_launches(items: list[pytest.Item]) -> None:
    """A test that asks for a shared launch may be the one that runs it, every job of its world size and plane
    (CI at stop 72: 15 minutes under load for the five ranks' launch, past pytest-timeout's 900 s): such tests get
    the longest launch's own limit, the sum of its jobs' (each job's own limit still aborts a stuck job)."""
    if not REGISTERED:
        return
    limit = max(sum(job.timeout for job in jobs) for jobs in REGISTERED.values()) + 120
    for item in items:
        if "shared_launch" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(limit))


@pytest.hookimpl(trylast=True)     # after -k/-m deselection: only browser tests that will run count
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Shared launches get their own limit (``limit_shared_launches``). Run each tutorial once when it runs anyway
    in real JupyterLab (CI: ~4 minutes saved): the headless run of a notebook is skipped when this session's
    browser tests Run All of it and can run (browser present); the Lab run makes the same checks."""
    limit_shared_launches(items)
    in_lab = _lab_runs(items) & set(LAB_COVERS_HEADLESS)
    if not in_lab:
        return
    from tests.ui.lab import missing_requirements

    if missing_requirements():
        return
    for item in items:
        if item.name.startswith("test_notebook_runs_headless["):
            number = item.name.split("[", 1)[1][:2]
            if number in in_lab:
                item.add_marker(pytest.mark.skip(reason=f"notebook {number} runs in JupyterLab in this "
                                                        f"session (tests/ui), with the same checks"))
