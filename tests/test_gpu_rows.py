"""benchmarks/gpu_check.sh's row selection (benchmarks/support/gpu_rows.py) on simulated GPU counts: with fewer GPUs
than ranks the nccl rows are skipped with the reason and the mpi plane's rows run; with one GPU per rank, all run.
And the venv its --wheels mode makes (benchmarks/support/node_venv.py) sees the packages of the python making it."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import mpi4py

from benchmarks.support.gpu_rows import NO_ENV, NO_REASON, RowKind, plan, rows
from benchmarks.support.node_venv import PTH_NAME

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
        kind, name, ranks, shown, env, command = line.split("\t")
        assert (RowKind(kind), name, int(ranks)) == (row.kind, row.name, row.ranks)
        assert shown == (reason or NO_REASON) and tuple(shlex.split(command)) == row.args
        variables = () if env == NO_ENV else tuple(tuple(pair.split("=", 1)) for pair in shlex.split(env))
        assert variables == row.env


def test_only_the_torch_plane_soak_turns_torch_s_flight_recorder_off() -> None:
    """torch records ~1 KB per torch-plane collective until its ring of 2000 is full: the soak's heap check would
    measure torch's record, not the package."""
    for device in ("cuda", "cpu"):
        with_env = {row.name: dict(row.env) for row in rows(device) if row.env}
        assert with_env == {f"soak: trace and memory flat ({'nccl' if device == 'cuda' else 'gloo'})":
                            {"TORCH_FR_BUFFER_SIZE": "0"}}


def test_a_venv_made_from_a_venv_sees_the_makers_packages_after_its_own(tmp_path: Path) -> None:
    """As on the GPU node, whose python3 is a venv's holding torch: the tests' interpreter (a venv's, under make) makes
    one; mpi4py, installed beside the maker, imports in it from the maker's folder, and the new venv's own
    site-packages (where the wheels go) come first."""
    made = tmp_path / "node"
    subprocess.run([sys.executable, "-m", "benchmarks.support.node_venv", str(made)], cwd=REPO, check=True,
                   capture_output=True)
    code = ("import mpi4py, site, sys; print(mpi4py.__file__); print(site.getsitepackages()[0]); "
            "print(*sys.path, sep=',')")
    found, own, path = subprocess.run([str(made / "bin" / "python"), "-c", code], cwd=tmp_path, capture_output=True,
                                      text=True, check=True).stdout.splitlines()
    assert Path(found).resolve() == Path(mpi4py.__file__).resolve()
    maker_site = str(Path(mpi4py.__file__).resolve().parents[1])
    entries = [str(Path(entry).resolve()) for entry in path.split(",") if entry]
    assert entries.index(str(Path(own).resolve())) < entries.index(maker_site)
    maker_is_a_venv = sys.prefix != sys.base_prefix
    assert (Path(own) / PTH_NAME).exists() == maker_is_a_venv
