"""Checkpoints: atomic writes, resume == uninterrupted run (serial, MPI, across layouts), a killed rank ends the job."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mpi4dl_nb.run import checkpoint as ck
from mpi4dl_nb.run import train_cmd as cli
from tests.support.mpirun import REPO, mpi_env, mpiexec
from tests.support.summary import json_record

MODEL = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4",
         "--image-size", "32", "--batch-size", "4", "--num-samples", "16", "--dtype", "float64",
         "--lr", "0.05", "--momentum", "0.9", "--no-progress"]
SERIAL = ["--split-size", "1", "--spatial-size", "0"]
# 3 ranks: a 2-tile spatial first stage, then a pipeline of 2 micro-batches
PARALLEL = ["--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "2",
            "--slice-method", "vertical", "--parts", "2"]


def test_save_is_atomic_and_keeps_newest(tmp_path, monkeypatch):
    first = ck.save_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(2)}})
    assert first.name == "step-00000001.pt" and ck.latest_checkpoint(tmp_path) == first

    def crash(obj, handle, *args, **kwargs):
        handle.write(b"partial bytes")
        raise OSError("disk full")
    real_save = torch.save
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint(tmp_path, 2, {"model": {"w": torch.zeros(2)}})
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001.pt"]   # no tmp left
    assert torch.equal(ck.load_checkpoint(first)["model"]["w"], torch.ones(2))
    for step in (2, 3, 4):
        ck.save_checkpoint(tmp_path, step, {"x": step}, keep=2)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step-00000003.pt", "step-00000004.pt"]
    assert ck.load_checkpoint(ck.resolve_resume("latest", tmp_path))["x"] == 4
    assert ck.resolve_resume(str(tmp_path), None).name == "step-00000004.pt"


def test_resume_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ck.resolve_resume(str(tmp_path), None)
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        ck.resolve_resume(str(tmp_path / "x.pt"), None)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot load checkpoint"):
        ck.load_checkpoint(junk)
    torch.save({"weights": 1}, tmp_path / "foreign.pt")
    with pytest.raises(ValueError, match="not an mpi4dl_nb checkpoint"):
        ck.load_checkpoint(tmp_path / "foreign.pt")


def run_serial(capsys, argv: list[str]) -> dict:
    assert cli.main(SERIAL + MODEL + argv) == 0
    return json_record(capsys.readouterr().out)


def final_state(folder: Path, step: int = 6) -> dict:
    return ck.load_checkpoint(ck.checkpoint_path(folder, step))


def assert_same_training(a: dict, b: dict, rtol: float) -> None:
    assert a["step"] == b["step"]
    assert set(a["model"]) == set(b["model"])
    for key, value in a["model"].items():
        diff = (value.double() - b["model"][key].double()).abs().max().item()
        assert diff <= rtol * max(1.0, value.double().abs().max().item()), key
    assert set(a["optimizer"]) == set(b["optimizer"]) and a["optimizer"]
    for key, state in a["optimizer"].items():
        other = b["optimizer"][key]["momentum_buffer"]
        assert torch.allclose(state["momentum_buffer"], other, rtol=0, atol=rtol * 10), key


def test_serial_resume_equals_straight_run(tmp_path, capsys):
    straight = run_serial(capsys, ["--steps", "6", "--checkpoint-dir", str(tmp_path / "a")])
    half = run_serial(capsys, ["--steps", "3", "--checkpoint-dir", str(tmp_path / "b")])
    assert half["steps"] == 3 and half["checkpoint"].endswith("step-00000003.pt")
    resumed = run_serial(capsys, ["--steps", "6", "--checkpoint-dir", str(tmp_path / "b"),
                                  "--resume", "latest"])
    assert resumed["start_step"] == 3 and resumed["steps_run"] == 3
    assert resumed["losses"] == straight["losses"][3:]
    a, b = final_state(tmp_path / "a"), final_state(tmp_path / "b")
    assert_same_training(a, b, rtol=0.0)          # same process layout: bit for bit
    # a different model refuses the checkpoint, naming the flag
    with pytest.raises(SystemExit):
        cli.main(SERIAL + MODEL + ["--num-filters", "8", "--steps", "6",
                                   "--resume", str(tmp_path / "b")])
    assert "num_filters" in capsys.readouterr().err


def test_mpi_resume_equals_straight_run_and_moves_layouts(mpirun, tmp_path, capsys):
    """3 ranks (SP+PP): resuming the step-3 checkpoint to step 6 == 6 straight steps; the
    checkpoint also resumes in one process."""
    common = [*MODEL, *PARALLEL, "--checkpoint-every", "3"]
    mpirun(3, "mpi4dl_nb", "train", *common, "--steps", "6", "--checkpoint-dir",
           str(tmp_path / "a"), module=True, timeout=300)
    # the straight run's step-3 checkpoint is what a run stopped after 3 steps leaves
    half_checkpoint = (tmp_path / "a" / "step-00000003.pt").read_bytes()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "step-00000003.pt").write_bytes(half_checkpoint)
    result = mpirun(3, "mpi4dl_nb", "train", *common, "--steps", "6", "--checkpoint-dir",
                    str(tmp_path / "b"), "--resume", "latest", module=True, timeout=300)
    record = json_record(result.stdout)
    assert record["start_step"] == 3 and record["steps"] == 6
    assert_same_training(final_state(tmp_path / "a"), final_state(tmp_path / "b"), rtol=0.0)
    # the parallel checkpoint resumes in one process (another layout; same 2 micro-batches,
    # as BatchNorm sees each micro-batch) to the same weights
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "step-00000003.pt").write_bytes(half_checkpoint)
    run_serial(capsys, ["--steps", "6", "--checkpoint-dir", str(tmp_path / "c"),
                        "--resume", "latest", "--parts", "2"])
    assert_same_training(final_state(tmp_path / "a"), final_state(tmp_path / "c"), rtol=1e-9)


def descendants(root: int) -> list[int]:
    """PIDs of every process below ``root`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def is_rank(pid: int) -> bool:
    try:
        return b"mpi4dl_nb" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_killed_rank_ends_job_and_checkpoint_survives(tmp_path):
    folder = tmp_path / "ck"
    cmd = [*mpiexec(), "-n", "3", sys.executable, "-m", "mpi4dl_nb", "train", *MODEL, *PARALLEL,
           "--steps", "100000", "--checkpoint-every", "1", "--checkpoint-dir", str(folder)]
    log = open(tmp_path / "log.txt", "w")
    job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=mpi_env(3),
                           cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while len(ck.list_checkpoints(folder)) < 2:
            assert job.poll() is None, (tmp_path / "log.txt").read_text()
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.5)
        ranks = [pid for pid in descendants(job.pid) if is_rank(pid)]
        assert len(ranks) == 3, ranks
        os.kill(ranks[-1], signal.SIGKILL)
        killed_at = time.monotonic()
        job.wait(timeout=60)
        assert job.returncode != 0
        survivors = [pid for pid in ranks if alive(pid)]
        while survivors and time.monotonic() - killed_at < 60:   # the launcher's kill lands
            time.sleep(0.2)
            survivors = [pid for pid in survivors if alive(pid)]
        assert not survivors, f"ranks {survivors} still alive 60 s after one was killed"
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        log.close()
    latest = ck.latest_checkpoint(folder)
    data = ck.load_checkpoint(latest)
    assert data["step"] >= 1 and data["model"] and data["optimizer"]
