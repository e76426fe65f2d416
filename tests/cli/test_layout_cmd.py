"""`python -m mpi4dl_nb layout`: the table, and refusal on a wrong rank count: every rank exits, one message."""

import subprocess
import sys
import time

import pytest

from mpi4dl_nb.comm.launcher import rank_environment
from tests.support.mpirun import REPO, run_mpi


def test_layout_prints_table_and_world_size():
    out = subprocess.run([sys.executable, "-m", "mpi4dl_nb", "layout", "--split-size", "3",
                          "--spatial-size", "2", "--num-spatial-parts", "4"],
                         capture_output=True, text=True, cwd=REPO, env=rank_environment(1), check=True).stdout
    assert "world size: 9 ranks" in out
    assert len([item for item in out.splitlines() if "spatial" in item and item.split()[0].isdigit()]) == 8


@pytest.mark.mpi
def test_wrong_rank_count_exits_all_ranks_fast():
    start = time.monotonic()
    result = run_mpi(4, "mpi4dl_nb", "layout", "--split-size", "2", "--spatial-size", "1",
                     "--num-spatial-parts", "4", module=True, expect_failure=True, timeout=60)
    elapsed = time.monotonic() - start
    assert elapsed < 20 and result.returncode == 2
    # every rank decides alike from the same flags: rank 0 says it once, all exit
    assert result.stdout.count("configuration error: this configuration needs 5 ranks") == 1, result.stdout
    assert "[0] mpi4dl_nb: configuration error" in result.stdout and "mpiexec -n 5" in result.stdout
    print(f"\n[batch-jobs table] wrong rank count: exit {result.returncode} after {elapsed:.1f} s "
          f"(job start included)")


@pytest.mark.mpi
def test_right_rank_count_runs():
    result = run_mpi(5, "mpi4dl_nb", "layout", "--split-size", "2", "--spatial-size", "1",
                     "--num-spatial-parts", "4", module=True, timeout=60)
    assert "world size: 5 ranks" in result.stdout


def test_layout_prints_the_training_state_per_rank_under_each_zero_stage(capsys):
    """``layout --model``: per stage, the state a rank keeps at --zero-stage 0-3 (issue 80), the chosen one marked."""
    from mpi4dl_nb.cli import layout_cmd

    code = layout_cmd.main(["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "16",
                            "--image-size", "32", "--num-classes", "3", "--split-size", "2", "--spatial-size", "1",
                            "--num-spatial-parts", "4", "--zero-stage", "3", "--optimizer", "adamw"])
    shown = capsys.readouterr().out
    lines = shown.split("training state per rank of each stage")[1].splitlines()
    assert code == 0 and lines[1].split()[-4:] == ["zero-0", "zero-1", "zero-2", "zero-3*"], shown
    tiles, layer = (line.split() for line in lines[3:5])
    assert tiles[:2] == ["0", "4"] and layer[:2] == ["1", "1"], shown
    whole = [float(cell) for cell in tiles[3:]]
    assert whole[0] > whole[1] > whole[2] > whole[3] and whole[3] == pytest.approx(whole[0] / 4, abs=0.001), shown
    assert len(set(layer[3:])) == 1, shown      # a stage on one rank: nothing to shard
