"""The ``Any`` budget (.ci/any_budget.py, run by ``make lint``): mpi4dl_nb/ stays within 0.3 per 1,000
non-blank lines."""

from __future__ import annotations

import subprocess
import sys

from tests.support.mpirun import REPO

SCRIPT = REPO / ".ci" / "any_budget.py"


def budget(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_package_is_within_the_any_budget():
    result = budget()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "within the budget of 0.3 Any per 1,000 non-blank lines" in result.stdout


def test_counts_any_names_not_comments_or_strings_per_non_blank_line_and_fails_over_the_limit(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "root.py").write_text('from typing import Any\n\n\ndef f(x: Any) -> "Any":   # Any\n    return x\n \n')
    (pkg / "sub" / "a.py").write_text("import typing\n\nX: typing.Any = 1\n" + "y = 2\n\n" * 998)
    rows = {line.split()[0]: line.split()[1:] for line in budget(str(pkg), "--limit", "2").stdout.splitlines()[1:]}
    assert rows["(root)"] == ["3", "2", "666.67"]      # the import and the annotation; not the string or comment
    assert rows["sub"] == ["1000", "1", "1.00"]        # blank lines (and whitespace-only ones) do not count
    assert rows["pkg"] == ["1003", "3", "2.99"]
    assert budget(str(pkg), "--limit", "2.9").returncode == 1
    assert budget(str(pkg), "--limit", "3").returncode == 0
