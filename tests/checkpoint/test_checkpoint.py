"""Checkpoints: atomic writes, resume == uninterrupted run (serial, MPI, across layouts), a killed rank ends the job."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mpi4dl_nb.checkpoint import files as ck
from mpi4dl_nb.checkpoint.record import DataRecord, RunRecord, read_checkpoint, write_checkpoint
from mpi4dl_nb.cli import evaluate_cmd
from mpi4dl_nb.cli import train_cmd as cli
from mpi4dl_nb.data.apps import AppKind
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.infer.model import load_layers
from mpi4dl_nb.models.spec import ModelFamily, ModelSpec
from mpi4dl_nb.run import checkpoint_space as space
from mpi4dl_nb.run import resume
from tests.support.bad_data import truncate
from tests.support.mpirun import start_mpi
from tests.support.procs import command_line, descendants, wait_gone
from tests.support.summary import json_record

MODEL = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4",
         "--image-size", "32", "--batch-size", "4", "--num-samples", "16", "--dtype", "float64",
         "--lr", "0.05", "--momentum", "0.9", "--no-progress"]
SERIAL = ["--split-size", "1", "--spatial-size", "0"]
# 3 ranks: a 2-tile spatial first stage, then a pipeline of 2 micro-batches
PARALLEL = ["--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "2",
            "--slice-method", "vertical", "--parts", "2"]


IDENTITY = {"model": "m", "image_size": 32, "batch_size": 4, "seed": 0}
RECORD = RunRecord(ModelSpec.of("resnet", num_layers=8, num_filters=4, num_classes=2, resnet_version=1),
                   DataRecord(AppKind.SYNTHETIC, 32, 4), seed=0, identity=IDENTITY)


def test_a_volume_record_keeps_its_patch_and_an_older_one_still_reads(tmp_path):
    """A volume run's record keeps the patch's D,H,W, the voxel size and the tile grid; a checkpoint written before
    they were recorded (no such fields) still loads, with them unknown (None)."""
    data = DataRecord(AppKind.MEDICAL, 16, 2, "float64", "/data/volumes", volume_size=(8, 16, 12),
                      voxel_size=(1.0, 0.5, 0.5), volume_grid=(1, 2, 2))
    record = replace(RECORD, data=data, identity={**IDENTITY, "image_size": "8,16,12"})
    loaded = read_checkpoint(write_checkpoint(tmp_path, record.at(2, "bbbbbbbbbbbb"), {"w": torch.ones(1)}, None))
    assert loaded.record.data == data and loaded.record.data.size_text == "8,16,12"
    payload = record.at(2, "bbbbbbbbbbbb").to_payload()
    stored = payload["record"]
    assert isinstance(stored, dict) and isinstance(stored["data"], dict)
    for name in ("volume_size", "voxel_size", "volume_grid"):
        del stored["data"][name]
    older = RunRecord.from_payload(payload, "old.pt").data
    assert older == replace(data, volume_size=None, voxel_size=None, volume_grid=None) and older.size_text == "16"
    stored["data"]["volume_size"] = [8, 16]
    with pytest.raises(ValueError, match="'volume_size': expected a list of three numbers"):
        RunRecord.from_payload(payload, "bad.pt")


def save(folder, step, run_id="aaaaaaaaaaaa", keep=2, model=None, record=RECORD):
    weights = model if model is not None else {"w": torch.full((2,), float(step))}
    return write_checkpoint(folder, record.at(step, run_id), weights, None, keep=keep)


def test_record_round_trips_and_names_what_is_missing(tmp_path):
    """The record a checkpoint stores reads back equal; a file without one is refused, saying so."""
    record = RunRecord(ModelSpec.of("amoebanet", num_layers=3, num_filters=8, num_classes=2),
                       DataRecord(AppKind.MEDICAL, 64, 2, "float64", "/data/tiles", 0.25, None),
                       seed=3, config={"split_size": 2}, step=5, run_id="0123456789ab", identity=IDENTITY)
    assert record.model.family is ModelFamily.AMOEBANET and record.model.resnet_version is None
    assert RunRecord.from_payload(record.to_payload(), "x.pt") == record
    loaded = read_checkpoint(write_checkpoint(tmp_path, record, {"w": torch.ones(1)}, None))
    assert loaded.record == record and torch.equal(loaded.model_state["w"], torch.ones(1))
    assert loaded.optimizer_state is None
    foreign = ck.save_checkpoint(tmp_path / "foreign", 1, {"x": 1}, run_id="cccccccccccc")
    with pytest.raises(ValueError, match="holds no model description"):
        read_checkpoint(foreign)
    broken = record.to_payload()
    broken["record"]["model"].pop("num_layers")
    with pytest.raises(ValueError, match="incomplete run record .*'num_layers' is missing"):
        RunRecord.from_payload(broken, "x.pt")
    # format 1 (no run id, no identity): the identity is what those files recorded
    old = {"step": 2, "format_version": 1, "data_seed": 7, "batch_size": 4, "model": {}, "run": {
        "model": "resnet", "resnet_version": 1, "num_layers": 8, "num_filters": 4, "num_classes": 2,
        "image_size": 32, "batch_size": 4, "app": "synthetic", "dtype": "float32"}}
    legacy = RunRecord.from_payload(old, "step-00000002.pt")
    assert legacy.seed == 7 and legacy.run_id is None and legacy.model == RECORD.model
    assert legacy.identity == {"image_size": 32, "batch_size": 4, "app": "synthetic", "dtype": "float32", "seed": 7}


def test_save_is_atomic_and_keeps_newest(tmp_path, monkeypatch):
    first = save(tmp_path, 1, model={"w": torch.ones(2)})
    assert first.name == "step-00000001-aaaaaaaaaaaa.pt" and ck.latest_checkpoint(tmp_path) == first
    assert ck.manifest_path(first).exists()

    def crash(obj, handle, *args, **kwargs):
        handle.write(b"partial bytes")
        raise OSError("disk full")
    real_save = torch.save
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path, 2, model={"w": torch.zeros(2)})
    monkeypatch.setattr(torch, "save", real_save)
    assert {p.name for p in tmp_path.iterdir()} == {first.name, ck.manifest_path(first).name}
    assert torch.equal(ck.load_checkpoint(first)["model"]["w"], torch.ones(2))
    for step in (2, 3, 4):
        save(tmp_path, step, keep=2)
    assert [e.step for e in ck.list_checkpoints(tmp_path)] == [3, 4]
    chosen = resume.select_resume("latest", tmp_path, lambda saved: None).checkpoint
    assert chosen.record.step == 4 and torch.equal(chosen.model_state["w"], torch.full((2,), 4.0))
    assert resume.select_resume(str(tmp_path), None, lambda saved: None).path.name.startswith("step-00000004")
    with pytest.raises(FileExistsError, match="never overwritten"):
        save(tmp_path, 4)


def test_rotation_and_latest_consider_only_this_run(tmp_path):
    """Item 1: a higher-numbered checkpoint of an earlier run neither rotates ours away nor is resumed."""
    earlier = save(tmp_path, 100, run_id="bbbbbbbbbbbb")
    ours = [save(tmp_path, step, keep=1) for step in (1, 2)]
    assert earlier.exists() and ours[1].exists() and not ours[0].exists()
    assert resume.select_resume("latest", tmp_path, lambda saved: None).path == ours[1]   # newest written
    # a newer checkpoint of another configuration is passed over, saying why
    other = save(tmp_path, 200, run_id="cccccccccccc",
                 record=RunRecord(RECORD.model, RECORD.data, identity={**IDENTITY, "image_size": 64}))
    chosen = resume.select_resume("latest", tmp_path,
                              lambda saved: None if saved == IDENTITY else "another configuration")
    assert chosen.path == ours[1] and chosen.skipped == [(other, "another configuration")]


def test_latest_falls_back_past_damaged_checkpoints(tmp_path):
    """Item 8: a truncated newest checkpoint is skipped (and named) for the intact older one."""
    good = save(tmp_path, 2, model={"w": torch.arange(1000.0)})
    newest = save(tmp_path, 4, model={"w": torch.arange(1000.0)})
    truncate(newest, 0.5)
    orphan = tmp_path / "step-00000006-aaaaaaaaaaaa.pt"          # written, never committed
    orphan.write_bytes(good.read_bytes())
    chosen = resume.select_resume("latest", tmp_path, lambda saved: None)
    assert chosen.path == good and chosen.checkpoint.record.step == 2
    reasons = dict(chosen.skipped)
    assert "truncated" in reasons[newest] and "no manifest" in reasons[orphan]
    assert newest.name in chosen.report() and orphan.name in chosen.report()
    with pytest.raises(ValueError, match="damaged"):                  # named explicitly: no fallback
        resume.select_resume(str(newest), None, lambda saved: None)
    truncate(good, 0.9)
    with pytest.raises(ValueError, match="no checkpoint .* fits"):
        resume.select_resume("latest", tmp_path, lambda saved: None)


def test_resume_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        resume.select_resume(str(tmp_path), None, lambda saved: None)
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        resume.select_resume(str(tmp_path / "x.pt"), None, lambda saved: None)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot load checkpoint"):
        ck.load_checkpoint(junk)
    torch.save({"weights": 1}, tmp_path / "foreign.pt")
    with pytest.raises(ValueError, match="not an mpi4dl_nb checkpoint"):
        ck.load_checkpoint(tmp_path / "foreign.pt")


def test_checkpoint_dir_is_checked_up_front(tmp_path, monkeypatch):
    """Item 2: creatable, writable, room for one checkpoint, before any step."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        space.prepare_directory(afile / "sub" / "ck", 1000)
    with pytest.raises(ConfigError, match="cannot create|not writable"):
        space.prepare_directory("/proc/mpi4dl-no-such-dir/ck", 1000)
    needed = space.estimate_checkpoint_bytes(2 << 20, tensors=10, optimizer_slots=1)
    assert needed > 4 << 20
    monkeypatch.setattr(space.shutil, "disk_usage", lambda path: shutil_usage(free=3 << 20))
    with pytest.raises(ConfigError, match=r"3\.0 MB free but one checkpoint needs about 4\.\d MB"):
        space.prepare_directory(tmp_path / "ck", needed)
    monkeypatch.setattr(space.shutil, "disk_usage", lambda path: shutil_usage(free=10 << 20))
    assert space.prepare_directory(tmp_path / "ck" / "run", needed) == tmp_path / "ck" / "run"
    assert not (tmp_path / "ck").exists()          # checked, and the folders made for it gone (a refusal leaves none)
    (tmp_path / "ck").mkdir()
    space.prepare_directory(tmp_path / "ck", needed)
    assert (tmp_path / "ck").is_dir() and list((tmp_path / "ck").iterdir()) == []    # kept; the write probe is gone


def shutil_usage(free: int):
    import shutil

    return shutil._ntuple_diskusage(free * 2, free, free)


def run_serial(capsys, argv: list[str]) -> dict:
    assert cli.main(SERIAL + MODEL + argv) == 0
    return json_record(capsys.readouterr().out)


def final_state(folder: Path, step: int = 6) -> dict:
    (path,) = [e.path for e in ck.list_checkpoints(folder) if e.step == step]
    return ck.load_checkpoint(path)


def copy_checkpoint(source: Path, folder: Path) -> None:
    """A checkpoint (data and manifest) copied into ``folder``, as a run stopped there leaves it."""
    folder.mkdir(exist_ok=True)
    for path in (source, ck.manifest_path(source)):
        (folder / path.name).write_bytes(path.read_bytes())


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
    assert half["steps"] == 3 and Path(half["checkpoint"]).name == f"step-00000003-{half['run_id']}.pt"
    resumed = run_serial(capsys, ["--steps", "6", "--checkpoint-dir", str(tmp_path / "b"),
                                  "--resume", "latest"])
    assert resumed["start_step"] == 3 and resumed["steps_run"] == 3
    assert resumed["losses"] == straight["losses"][3:] and resumed["run_id"] == half["run_id"]
    a, b = final_state(tmp_path / "a"), final_state(tmp_path / "b")
    assert_same_training(a, b, rtol=0.0)          # same process layout: bit for bit
    # a different model refuses the checkpoint, naming what changed and the way out
    with pytest.raises(SystemExit):
        cli.main(SERIAL + MODEL + ["--num-filters", "8", "--steps", "6",
                                   "--resume", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert "model: --num-filters 4 -> 8" in err and "--allow-config-change model" in err


def test_mpi_resume_equals_straight_run_and_moves_layouts(mpirun, tmp_path, capsys):
    """3 ranks (SP+PP): resuming the step-3 checkpoint to step 6 == 6 straight steps; the
    checkpoint also resumes in one process."""
    common = [*MODEL, *PARALLEL, "--checkpoint-every", "3"]
    mpirun(3, "mpi4dl_nb", "train", *common, "--steps", "6", "--checkpoint-dir",
           str(tmp_path / "a"), module=True, timeout=300)
    # the straight run's step-3 checkpoint is what a run stopped after 3 steps leaves
    (half_checkpoint,) = [e.path for e in ck.list_checkpoints(tmp_path / "a") if e.step == 3]
    copy_checkpoint(half_checkpoint, tmp_path / "b")
    result = mpirun(3, "mpi4dl_nb", "train", *common, "--steps", "6", "--checkpoint-dir",
                    str(tmp_path / "b"), "--resume", "latest", module=True, timeout=300)
    record = json_record(result.stdout)
    assert record["start_step"] == 3 and record["steps"] == 6
    assert_same_training(final_state(tmp_path / "a"), final_state(tmp_path / "b"), rtol=0.0)
    # the parallel checkpoint resumes in one process (another layout; same 2 micro-batches,
    # as BatchNorm sees each micro-batch) to the same weights
    copy_checkpoint(half_checkpoint, tmp_path / "c")
    run_serial(capsys, ["--steps", "6", "--checkpoint-dir", str(tmp_path / "c"),
                        "--resume", "latest", "--parts", "2"])
    assert_same_training(final_state(tmp_path / "a"), final_state(tmp_path / "c"), rtol=1e-9)


@pytest.mark.mpi
def test_killed_rank_ends_job_and_checkpoint_survives(tmp_path):
    folder = tmp_path / "ck"
    log = open(tmp_path / "log.txt", "w")
    job = start_mpi(3, "mpi4dl_nb", "train", *MODEL, *PARALLEL, "--steps", "100000", "--checkpoint-every", "1",
                    "--checkpoint-dir", folder, module=True, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while len([e for e in ck.list_checkpoints(folder) if e.problem is None]) < 2:
            assert job.poll() is None, (tmp_path / "log.txt").read_text()
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.5)
        ranks = [pid for pid in descendants(job.pid) if "mpi4dl_nb" in command_line(pid)]
        assert len(ranks) == 3, ranks
        os.kill(ranks[-1], signal.SIGKILL)
        killed_at = time.monotonic()
        job.wait(timeout=60)
        assert job.returncode != 0
        survivors, _ = wait_gone(ranks, 60)      # the launcher's kill lands
        assert not survivors, f"ranks {survivors} still alive 60 s after one was killed"
        print(f"\n[batch-jobs table] a killed rank: job ended {time.monotonic() - killed_at:.1f} s "
              f"after the kill, exit code {job.returncode}")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        log.close()
    latest = ck.latest_checkpoint(folder)
    data = ck.load_checkpoint(latest)
    assert data["step"] >= 1 and data["model"] and data["optimizer"]


def format_2(payload: dict) -> dict:
    """A current checkpoint's payload in the layout format 2 wrote (the run's flags flat under "run")."""
    record = RunRecord.from_payload(payload, "x.pt")
    old = {k: v for k, v in payload.items() if k not in ("record", "format_version", "step", "run_id", "identity")}
    old.update(epoch=0, step_in_epoch=record.step, batch_size=record.data.batch_size, data_seed=record.seed,
               config=dict(record.config), run=record.summary_fields())
    return old


def test_format_2_checkpoints_still_evaluate_infer_and_resume(tmp_path, capsys, monkeypatch):
    """A checkpoint in the old layout (format 2, a flat "run" dict) reads as the same record, and evaluate,
    infer and --resume use it as they use a current one."""
    run_serial(capsys, ["--steps", "3", "--checkpoint-dir", str(tmp_path / "new")])
    (new,) = [e.path for e in ck.list_checkpoints(tmp_path / "new")]
    payload = ck.load_checkpoint(new)
    monkeypatch.setattr(ck, "FORMAT_VERSION", 2)
    old = ck.save_checkpoint(tmp_path / "old", 3, format_2(payload), run_id=str(payload["run_id"]),
                             identity=payload["identity"])
    monkeypatch.undo()
    assert ck.load_checkpoint(old)["format_version"] == 2 and "record" not in ck.load_checkpoint(old)
    was, now = read_checkpoint(old).record, read_checkpoint(new).record
    later = replace(now, training=None, best=None, param_groups=())   # how it trains, its best, its optimizer groups:
    # no format-2 field holds them
    assert was == later, (was, later)               # nothing lost (no --datapath: None in both)
    assert was.class_names == now.class_names      # numbered in both
    one = ["--split-size", "1", "--spatial-size", "0", "--all-data", "--num-samples", "16"]
    figures = []
    for folder in ("old", "new"):
        assert evaluate_cmd.main(["--checkpoint", str(tmp_path / folder), *one]) == 0
        figures.append(json_record(capsys.readouterr().out, '{"checkpoint"'))
    for record in figures:
        record.pop("seconds"), record.pop("checkpoint")
    assert figures[0] == figures[1] and figures[0]["model"].startswith("resnet v1 8 layers x 4 filters, 10 classes")
    layers, description = load_layers(tmp_path / "old", dtype=torch.float64)
    assert description.image_size == 32 and description.step == 3 and len(layers) > 2
    resumed = [run_serial(capsys, ["--steps", "5", "--checkpoint-dir", str(tmp_path / folder), "--resume", "latest"])
               for folder in ("old", "new")]
    assert resumed[0]["start_step"] == 3 and resumed[0]["losses"] == resumed[1]["losses"]
    assert resumed[0]["run_id"] == payload["run_id"]         # the lineage continues
