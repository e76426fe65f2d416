"""--zero-stage from the command line (issue 80): a level-2 run on 2x2 tiles + a layer rank with --clip-grad-norm equals
one process (float64, 1e-9), its tile ranks keep less state, its config.toml records the clipping, and its checkpoint
resumes on 2 tiles with the uninterrupted run's losses."""

from __future__ import annotations

import shutil

import pytest

from mpi4dl_nb.checkpoint import files as ck
from mpi4dl_nb.cli import train_cmd as cli
from tests.support.summary import json_record

MODEL = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4", "--image-size", "32",
         "--batch-size", "4", "--num-samples", "16", "--num-classes", "3", "--dtype", "float64", "--seed", "3",
         "--optimizer", "adamw", "--no-progress"]
TILES4 = ["--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "4"]
TILES2 = ["--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "2", "--slice-method", "vertical"]
CLIP = ["--clip-grad-norm", "0.05"]   # below the gradient's norm: every step clips (the norm over the shards)
RTOL = 1e-9


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= RTOL * abs(b) for a, b in zip(got, want))


@pytest.mark.mpi
def test_zero_stage_2_equals_one_process_and_resumes_on_two_tiles(mpirun, tmp_path, capsys):
    assert cli.main([*MODEL, "--split-size", "1", "--spatial-size", "0", "--steps", "4"]) == 0
    unclipped = json_record(capsys.readouterr().out)
    assert cli.main([*MODEL, *CLIP, "--split-size", "1", "--spatial-size", "0", "--steps", "4"]) == 0
    serial = json_record(capsys.readouterr().out)
    assert not close(serial["losses"][1:], unclipped["losses"][1:])   # the clipping changed the run
    sharded = json_record(mpirun(5, "mpi4dl_nb", "train", *MODEL, *CLIP, *TILES4, "--zero-stage", "2", "--steps", "4",
                                 "--checkpoint-every", "2", "--checkpoint-dir", str(tmp_path / "a"), module=True,
                                 timeout=300).stdout)
    assert close(sharded["losses"], serial["losses"]), (sharded["losses"], serial["losses"])
    assert sharded["config"]["zero_stage"] == 2 and sharded["steps_run"] == 4
    assert "\nclip-grad-norm = 0.05\n" in (tmp_path / "a" / "config.toml").read_text()   # the run's recorded flags
    tiles, layer = sharded["state_bytes"][:4], sharded["state_bytes"][4]
    assert max(tiles) < layer      # the tiles' stage is sharded 4 ways; the layer rank holds its stage alone
    (half,) = [e.path for e in ck.list_checkpoints(tmp_path / "a") if e.step == 2]
    (tmp_path / "b").mkdir()
    for path in (half, ck.manifest_path(half)):
        shutil.copy(path, tmp_path / "b" / path.name)
    resumed = json_record(mpirun(3, "mpi4dl_nb", "train", *MODEL, *CLIP, *TILES2, "--zero-stage", "2", "--steps", "4",
                                 "--checkpoint-dir", str(tmp_path / "b"), "--resume", "latest", module=True,
                                 timeout=300).stdout)
    assert resumed["start_step"] == 2 and resumed["steps_run"] == 2
    assert close(resumed["losses"], serial["losses"][2:]), (resumed["losses"], serial["losses"])
