"""Nothing lost, nothing silent under a real mpiexec (3 ranks: 2 spatial tiles, then a pipeline of 2 micro-batches)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from mpi4dl_nb.checkpoint import files as ck
from mpi4dl_nb.cli import train_cmd as cli
from tests.support.bad_data import flip_bytes, png_with_bad_pixel_data, write_tiles
from tests.support.mpirun import launch_mpi, start_mpi
from tests.support.procs import command_line, descendants, mpi_rank, wait_gone
from tests.support.summary import json_record

MODEL = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4",
         "--image-size", "32", "--batch-size", "4", "--num-samples", "16", "--no-progress"]
pytestmark = pytest.mark.mpi    # every test here runs `python -m mpi4dl_nb train` on 3 ranks

PARALLEL = ["--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "2",
            "--slice-method", "vertical", "--parts", "2"]


def train(*args: object, timeout: float = 240) -> tuple[int, str, float]:
    """3 ranks of ``python -m mpi4dl_nb train``: exit code, merged output, seconds."""
    start = time.monotonic()
    result = launch_mpi(3, "mpi4dl_nb", "train", *MODEL, *PARALLEL, *args, module=True, timeout=timeout)
    assert not result.timed_out, result.stdout
    return result.returncode, result.stdout, time.monotonic() - start


def table(row: str, seconds: float, code: int) -> None:
    print(f"\n[batch-jobs table] {row}: exit {code} after {seconds:.1f} s (job start included)")


def test_foreign_checkpoint_neither_rotates_ours_away_nor_is_resumed(tmp_path, capsys):
    """Item 1 (acceptance): keep 1 beside a higher-numbered checkpoint of an earlier run."""
    folder = tmp_path / "ck"
    folder.mkdir()
    foreign = folder / "step-00000100.pt"          # an earlier run's, written by an older version
    torch.save({"step": 100, "format_version": 1, "model": {}, "run": {"image_size": 64}}, foreign)
    code, out, _ = train("--steps", "4", "--checkpoint-every", "1", "--keep-checkpoints", "1",
                         "--checkpoint-dir", folder)
    assert code == 0, out
    record = json_record(out)
    assert Path(record["checkpoint"]).exists() and foreign.exists()
    own = [e for e in ck.list_checkpoints(folder) if e.run_id == record["run_id"]]
    assert [e.step for e in own] == [4] and Path(record["checkpoint"]) == own[0].path
    # latest resumes this run's step 4, not the other run's step 100 (one process is enough)
    serial = ["--split-size", "1", "--spatial-size", "0", "--parts", "2"]
    assert cli.main(MODEL + serial + ["--steps", "5", "--checkpoint-dir", str(folder), "--resume", "latest"]) == 0
    resumed = json_record(capsys.readouterr().out)
    assert resumed["start_step"] == 4 and resumed["run_id"] == record["run_id"]


def test_divergence_exits_nonzero_naming_the_step(tmp_path):
    """Item 3 (acceptance): --lr 1e6 stops every rank at the first non-finite step, one message, exit 3."""
    code, out, seconds = train("--lr", "1e6", "--steps", "20", "--checkpoint-every", "1",
                               "--checkpoint-dir", tmp_path / "ck")
    assert code == 3 and out.count("stopped: step ") == 1 and "non-finite" in out, out
    assert '{"model"' not in out and "Traceback" not in out
    for entry in ck.list_checkpoints(tmp_path / "ck"):
        assert entry.problem is None and ck.load_checkpoint(entry.path)["step"] < int(
            out.split("stopped: step ")[1].split()[0])
    table("non-finite loss (--lr 1e6)", seconds, code)


def test_corrupt_tile_is_refused_before_the_first_step(tmp_path):
    """Item 5 (acceptance): one message from rank 0 naming the file, exit 2, no step run."""
    paths = write_tiles(tmp_path / "tiles", per_class=4)
    flip_bytes(paths[5])
    code, out, seconds = train("--app", "medical", "--datapath", tmp_path / "tiles", "--num-classes", "2",
                               "--steps", "3")
    assert code == 2 and out.count("cannot be trained on") == 1 and str(paths[5]) in out, out
    assert "1 of 8 files" in out and "damaged or truncated PNG" in out
    assert "Traceback" not in out and '{"model"' not in out and "[0] " in out.split("cannot be")[0]
    table("bad data", seconds, code)


def test_a_failing_rank_ends_the_job_with_one_message(tmp_path):
    """Item 5: a tile whose pixels fail to decode (its headers and checksums are fine, so the data
    check passes it) fails on the ranks reading it; the job ends with one message and the
    traceback in a log file, not every rank's traceback."""
    paths = write_tiles(tmp_path / "tiles", per_class=4)
    png_with_bad_pixel_data(paths[2])
    code, out, seconds = train("--app", "medical", "--datapath", tmp_path / "tiles", "--num-classes", "2",
                               "--steps", "4", "--checkpoint-dir", tmp_path / "ck")
    assert code == 1 and out.count(" failed: ") == 1 and f"cannot read tile {paths[2]}" in out, out
    assert "Traceback" not in out
    log = Path(out.split("traceback: ")[1].split()[0])
    assert log.parent == tmp_path / "ck" and "Traceback" in log.read_text()
    table("an exception on a rank", seconds, code)


def test_stalled_rank_is_named_and_the_job_ends(tmp_path):
    """Item 6: SIGSTOP one rank mid-run: --step-timeout aborts the job, naming it and its action."""
    folder = tmp_path / "ck"
    log = open(tmp_path / "log.txt", "w")
    job = start_mpi(3, "mpi4dl_nb", "train", *MODEL, *PARALLEL, "--steps", "100000", "--step-timeout", "3",
                    "--checkpoint-every", "2", "--checkpoint-dir", folder, module=True, stdout=log,
                    stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while ck.latest_checkpoint(folder) is None:
            assert job.poll() is None, (tmp_path / "log.txt").read_text()
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.3)
        ranks = {mpi_rank(pid): pid for pid in descendants(job.pid) if "mpi4dl_nb" in command_line(pid)}
        assert sorted(ranks) == [0, 1, 2], ranks
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            job.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the job still hangs 60 s after a rank was stopped")
        seconds = time.monotonic() - stopped
        left, _ = wait_gone(ranks.values(), 10)
        assert not left
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        log.close()
    out = (tmp_path / "log.txt").read_text()
    assert job.returncode == 4 and "stalled: rank 1 made no progress" in out, out
    assert "rank 1: no heartbeat (stopped or frozen)" in out and "rank 0: waiting" in out
    assert "in step " in out.split("rank 1: no heartbeat")[1].splitlines()[0]
    assert seconds < 3 + 15          # the timeout, plus heartbeat lag and the abort, on a loaded machine
    table("a stalled rank (SIGSTOP, --step-timeout 3)", seconds, job.returncode)
