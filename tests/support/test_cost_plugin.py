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


def test_each_test_s_cpu_includes_its_children_and_the_costliest_comes_first(pytester, monkeypatch, tmp_path):
    monkeypatch.setenv("MPI4DL_TEST_COSTS", str(tmp_path / "costs.tsv"))
    pytester.makepyfile(test_inner=INNER)
    pytester.runpytest_inprocess("-p", "tests.support.cost_plugin", "-q").assert_outcomes(passed=2)
    header, *rows = (tmp_path / "costs.tsv").read_text().splitlines()
    assert header.split("\t") == ["cpu_s", "wall_s", "machine_busy_s", "test"]
    costs = {line.split("\t")[3].split("::")[1]: float(line.split("\t")[0]) for line in rows}
    assert list(costs) == ["test_burns_a_child_s_cpu", "test_idle"]
    assert costs["test_burns_a_child_s_cpu"] > 0.05 > costs["test_idle"]
