"""benchmarks/gpu_check.sh's row selection (benchmarks/support/gpu_rows.py) on simulated GPU counts: with fewer GPUs
than ranks the nccl rows are skipped with the reason and the mpi plane's rows run; with one GPU per rank, all run."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from benchmarks.support.gpu_rows import NO_REASON, RowKind, plan, rows

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def test_one_gpu_skips_every_nccl_row_with_the_reason_and_runs_the_mpi_rows() -> None:
    decided = plan("cuda", gpus=1)
    nccl = [(row, reason) for row, reason in decided if "nccl" in row.planes]
    mpi_only = [(row, reason) for row, reason in decided if row.planes == ("mpi",)]
    assert len(nccl) >= 8 and len(mpi_only) >= 4
    for row, reason in nccl:
        assert reason == f"needs one GPU per rank ({row.ranks} ranks, 1 GPU here)", row.name
    assert [reason for _, reason in mpi_only] == [None] * len(mpi_only)
    assert {row.name for row, _ in mpi_only} >= {"spatial exactness 2x2 (mpi)", "engine exactness 5 ranks (mpi)",
                                                 "train CLI 5 ranks (mpi)"}


def test_a_gpu_per_rank_runs_everything_and_fewer_skip_only_the_rows_with_more_ranks() -> None:
    most = max(row.ranks for row in rows("cuda"))
    assert all(reason is None for _, reason in plan("cuda", gpus=most))
    skipped = {row.name for row, reason in plan("cuda", gpus=3) if reason is not None}
    assert skipped == {row.name for row in rows("cuda") if "nccl" in row.planes and row.ranks > 3}
    assert "engine exactness 3 ranks GEMS 1F1B (nccl)" not in skipped
    assert "soak: trace and memory flat (nccl)" in skipped


def test_on_cpu_the_torch_plane_is_gloo_and_nothing_is_skipped() -> None:
    decided = plan("cpu", gpus=0)
    assert all(reason is None for _, reason in decided)
    assert not any("nccl" in row.planes or "nccl" in " ".join(row.args) for row, _ in decided)
    assert any("gloo" in row.planes for row, _ in decided)


def test_the_script_reads_the_plan_the_module_prints() -> None:
    """The command line the script calls, parsed as the script parses it (tabs; ``-``: runs; shell-quoted args)."""
    assert "python -m benchmarks.support.gpu_rows --device \"$DEVICE\" --gpus \"$GPUS\"" in SCRIPT.read_text()
    printed = subprocess.run([sys.executable, "-m", "benchmarks.support.gpu_rows", "--device", "cuda", "--gpus", "1"],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines()
    expected = plan("cuda", gpus=1)
    assert len(printed) == len(expected)
    for line, (row, reason) in zip(printed, expected):
        kind, name, ranks, shown, command = line.split("\t")
        assert (RowKind(kind), name, int(ranks)) == (row.kind, row.name, row.ranks)
        assert shown == (reason or NO_REASON) and tuple(shlex.split(command)) == row.args
