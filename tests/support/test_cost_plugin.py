"""The cost plugin (tests/support/cost_plugin.py) writes each test's CPU, wall and machine-busy seconds."""

from __future__ import annotations

INNER = """
import subprocess
import sys


def test_burns_a_child_s_cpu():
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)


def test_idle():
    pass
"""


def run_inner(pytester, monkeypatch, tmp_path, source: str, tests: int, written: str) -> list[str]:
    """Run ``source``'s ``tests`` tests in-process under the plugin; the lines it wrote to ``written``."""
    monkeypatch.setenv("MPI4DL_TEST_COSTS", str(tmp_path / "costs.tsv"))
    pytester.makepyfile(test_inner=source)
    pytester.runpytest_inprocess("-p", "tests.support.cost_plugin", "-q").assert_outcomes(passed=tests)
    return (tmp_path / written).read_text().splitlines()


def test_each_test_s_cpu_includes_its_children_and_the_costliest_comes_first(pytester, monkeypatch, tmp_path):
    header, *rows = run_inner(pytester, monkeypatch, tmp_path, INNER, 2, "costs.tsv")
    assert header.split("\t") == ["cpu_s", "wall_s", "machine_busy_s", "test"]
    costs = {line.split("\t")[3].split("::")[1]: float(line.split("\t")[0]) for line in rows
             if line.split("\t")[3].startswith("test_inner.py::")}     # in-process: an outer run's tests too
    assert list(costs) == ["test_burns_a_child_s_cpu", "test_idle"]
    assert costs["test_burns_a_child_s_cpu"] > 0.05 > costs["test_idle"]


JOBS_INNER = """
from tests.support.cost_plugin import note_launch


def test_a_shared_launch():
    note_launch([("[cheap] (job ran to its end)", 0, "cpu 1.5s, peak rss so far 900 MB"),
                 ("[dear 2] (job ran to its end)", 1, "cpu 30.0s, peak rss so far 2900 MB"),
                 ("[dear 2] a check", 1, "cpu 99.0s")], "(job ran to its end)")
"""


def test_each_shared_job_s_cpu_per_rank_goes_beside_the_tests_costliest_first(pytester, monkeypatch, tmp_path):
    header, *rows = run_inner(pytester, monkeypatch, tmp_path, JOBS_INNER, 1, "costs.jobs.tsv")
    assert header.split("\t") == ["cpu_s", "rank", "job", "detail"]
    ours = [row.split("\t")[:3] for row in rows if row.split("\t")[2] in ("dear 2", "cheap")]  # (in-process: an
    assert ours == [["30.0", "1", "dear 2"], ["1.5", "0", "cheap"]]                       # outer run's jobs too)
