"""BENCHMARKS.md and benchmarks/run_all.sh agree: every benchmark command the document shows is run by the script,
and every command the script runs has its figures in the document (files only: nothing runs)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "BENCHMARKS.md"
RUN_ALL = REPO / "benchmarks" / "run_all.sh"

# a benchmark command as written in the document: an optional mpiexec prefix, then the script and its arguments,
# up to the end of the line, a comment or the end of inline code
DOC_COMMAND = re.compile(r"(?:mpiexec -n \d+ )?python benchmarks/[\w/]+\.py[^`#\n]*")


def normalized(command: str) -> str:
    return " ".join(command.split())


def doc_commands(text: str) -> set[str]:
    return {normalized(found) for found in DOC_COMMAND.findall(text)}


def run_all_commands(text: str) -> set[str]:
    """The commands of the script's ``run`` lines, without the ``yielding`` wrapper (an environment setting)."""
    found = set()
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if words[:1] != ["run"]:
            continue
        words = words[1:]
        if words[:1] == ["yielding"]:
            words = words[1:]
        found.add(" ".join(words))
    return found


def test_every_command_in_benchmarks_md_is_run_by_run_all():
    missing = doc_commands(DOC.read_text()) - run_all_commands(RUN_ALL.read_text())
    assert not missing, f"BENCHMARKS.md shows commands benchmarks/run_all.sh does not run: {sorted(missing)}"


def test_every_command_run_all_runs_has_its_figures_in_benchmarks_md():
    extra = run_all_commands(RUN_ALL.read_text()) - doc_commands(DOC.read_text())
    assert not extra, f"benchmarks/run_all.sh runs commands BENCHMARKS.md does not show: {sorted(extra)}"


def test_the_parsers_find_the_commands():
    doc = doc_commands("```\nMPIR_CVAR_ENABLE_HEAVY_YIELD=1 mpiexec -n 4 python benchmarks/b.py --x 1   # note\n```\n"
                       "and inline `python benchmarks/c.py --y` too")
    assert doc == {"mpiexec -n 4 python benchmarks/b.py --x 1", "python benchmarks/c.py --y"}
    script = run_all_commands("run yielding mpiexec -n 4 python benchmarks/b.py --x 1\n# run python no.py\n"
                              "run python benchmarks/c.py --y\n")
    assert script == doc


def test_benchmarks_md_and_the_planner_method_stay_short():
    assert len(DOC.read_text().splitlines()) <= 400, "BENCHMARKS.md: current figures only (history is in git)"
    assert len((REPO / "docs" / "planner.md").read_text().splitlines()) <= 160


def test_every_section_says_when_and_where_its_figures_were_measured():
    """Each numbered section holds a note with the time of its run (``HH:MM UTC``); the date and commit are the
    note's own or, for a time alone, the default the document's head states (``COMMIT_DEFAULT``)."""
    text = DOC.read_text()
    head, *sections = re.split(r"^## ", text, flags=re.M)
    assert re.search(r"only\s+a\s+time\s+of\s+day\s+ran\s+on\s+\d{4}-\d\d-\d\d\s+at\s+commit\s+[0-9a-f]{7}", head), \
        "BENCHMARKS.md's head must say the date and commit of figures whose note gives a time only"
    timed = re.compile(r"\d\d:\d\d(?:-\d\d:\d\d)? UTC")
    undated = [section.splitlines()[0] for section in sections if not timed.search(section)]
    assert not undated, f"sections without the time (and date, commit) of their run: {undated}"


def test_no_benchmark_imports_from_tests():
    pattern = re.compile(r"^\s*(from|import)\s+tests\b", re.MULTILINE)
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "benchmarks").rglob("*.py") if pattern.search(p.read_text())]
    assert not offenders, f"benchmarks import from tests/: {offenders}"
