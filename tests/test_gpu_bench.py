"""benchmarks/gpu_bench.sh's pure parts: the five rows and their names, the CPU rehearsal's scaled-down sizes, the
plan line the script reads, the time limits, and a table row made from a row's log (PASS, FAIL, stopped)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from benchmarks.support.gpu_bench.report import MARK, Result, last_result
from benchmarks.support.gpu_bench.rows import DEVICES, SCALES, row_limit, rows
from benchmarks.support.gpu_bench.table import table_row

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_bench.sh"
NAMES = ("ring blocks", "memory per rank", "engine overhead", "staged MPI", "bitwise rerun")


@pytest.mark.parametrize("device", DEVICES)
def test_five_rows_in_order_each_named_with_its_spelling(device: str) -> None:
    found = rows(device)
    assert len(found) == len(NAMES)
    for row, name in zip(found, NAMES):
        assert name in row.name
        assert (REPO / "benchmarks" / "support" / "gpu_bench" / f"{row.program}.py").exists()


def test_the_gpu_sizes_are_the_issues_and_the_cpu_says_it_is_scaled_down() -> None:
    gpu, cpu = SCALES["cuda"], SCALES["cpu"]
    assert (gpu.tokens, gpu.heads, gpu.vit, gpu.vit_sides) == ((4096, 8192, 16384), 16, "vit_large_patch16_224",
                                                               (1024, 2048))
    assert (gpu.resnet_side, gpu.vit_b_side, gpu.vit_b_depth, gpu.vit_depth, gpu.note) == (1024, 1024, 0, 0, "")
    assert min(gpu.megabytes) == 1 and max(gpu.megabytes) == 256
    assert max(cpu.tokens) < min(gpu.tokens) and max(cpu.vit_sides) < min(gpu.vit_sides) and cpu.note
    assert cpu.resnet_side < gpu.resnet_side and max(cpu.megabytes) < max(gpu.megabytes)
    for row in rows("cpu"):
        assert ("--note", "cpu scale") == row.args[row.args.index("--note"):][:2]


def test_the_plan_line_round_trips_as_the_script_reads_it() -> None:
    for row in rows("cuda"):
        name, ranks, limit, command = row.line(77).split("\t")
        assert (name, int(ranks), int(limit)) == (row.name, row.ranks, 77)
        assert shlex.split(command) == ["-m", f"benchmarks.support.gpu_bench.{row.program}", *row.args]
    assert "python -m benchmarks.support.gpu_bench.rows --device \"$DEVICE\"" in SCRIPT.read_text()


def test_limits_fit_the_eight_minutes_and_an_override_wins() -> None:
    assert sum(row_limit(row, "cuda", None) for row in rows("cuda")) <= 8 * 60 - 30
    assert all(row_limit(row, "cpu", None) > row_limit(row, "cuda", None) for row in rows("cpu"))
    assert {row_limit(row, "cuda", 42) for row in rows("cuda")} == {42}


def test_the_result_line_is_found_last_and_a_broken_one_is_none() -> None:
    log = f"noise\n{Result(False, 'old').line()}\n{Result(True, 'a | b').line()}\ntrailing\n"
    assert last_result(log) == Result(True, "a | b")
    assert last_result("nothing here") is None
    assert last_result(MARK + "{not json") is None


def test_table_rows_say_pass_fail_and_stopped(tmp_path: Path) -> None:
    log = tmp_path / "row.log"
    log.write_text(Result(True, "1.2x | 3").line() + "\n")
    assert table_row("ring blocks", log, 0, 12, 75) == f"| ring blocks | PASS | 1.2x / 3 | 12s | {log} |"
    assert "| FAIL | exit 1; 1.2x / 3 |" in table_row("ring blocks", log, 1, 12, 75)
    assert "| FAIL | stopped after 75s; " in table_row("ring blocks", log, 124, 75, 75)
    log.write_text(Result(False, "DIFFER").line())
    assert "| FAIL | DIFFER |" in table_row("bitwise rerun", log, 0, 3, 60)
    assert "| FAIL | no result line (see the log) |" in table_row("staged MPI", tmp_path / "missing.log", 0, 1, 60)
