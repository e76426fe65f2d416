"""Swin, MaxViT and EfficientViT through the commands (issue 66): ``train`` on 2x2 tiles + a layer rank equals one
process in float64 and ``evaluate`` runs on the checkpoints with that layout and in one process, to the same loss
(tests/mpi/transformer_families_cli.py, a job of the shared 5-rank launch; Swin and MaxViT at sizes other than the
224 px they are named for);
``layout`` prints the configuration of each family, Swin-T at 224 px as the acceptance names it and at 448 px; a
size the model cannot take is refused in one line before work."""
from __future__ import annotations

import pytest

from mpi4dl_nb.cli import layout_cmd, train_cmd
from tests.mpi import transformer_families_cli
from tests.support.battery import shared_job
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip
from tests.support.train_in_process import run_command

SWIN = "timm:swin_tiny_patch4_window7_224"
MISSING = missing_modules("timm")
JOB = None if MISSING else shared_job(5, "transformer_families_cli", timeout=400)
LAYOUT = ["--num-classes", "2", "--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "4"]


@pytest.fixture(autouse=True)
def _libraries() -> None:
    require_or_skip(MISSING, "timm's Swin, MaxViT and EfficientViT", MODELS_EXTRA)


def test_each_family_trains_on_tiles_as_one_process_and_evaluates_alike(shared_launch):
    assert JOB is not None
    shared_launch(JOB).require_clean(transformer_families_cli.check_names())


@pytest.mark.parametrize(("flags", "first", "last"), [
    # Swin-T's stochastic depth in every stage keeps its stages on one (tests/models/test_swin_cut.py)
    (["--model", SWIN, "--image-size", "224"], "patch_embed .. layers.3", "norm .. head.flatten"),
    (["--model", SWIN, "--image-size", "448"], "patch_embed .. layers.3", "norm .. head.flatten"),
    (["--model", "timm:maxvit_tiny_rw_224", "--model-args", "depths=(1,1,1,1)", "--image-size", "224"],
     "stem.conv1 ..", ".. head"),
    (["--model", "timm:efficientvit_b0", "--image-size", "128"], "stem.in_conv", "24-24   head"),
])
def test_layout_prints_the_configuration_of_each_family(capsys, flags, first, last):
    code, out, err = run_command(layout_cmd.main, [*flags, *LAYOUT], capsys)
    assert code == 0, err
    assert "world size: 5 ranks" in out and "balance: " in out, out
    stages = [line for line in out.splitlines() if line.startswith(("0      spatial", "1      layer"))]
    assert len(stages) == 2 and first in stages[0] and "0-3" in stages[0] and last in stages[1], out


@pytest.mark.parametrize(("command", "flags", "message"), [
    (train_cmd.main, ["--model", SWIN, "--image-size", "258", "--split-size", "1", "--spatial-size", "0",
                      "--num-spatial-parts", "1", "--no-progress"],
     "--image-size: 258: timm:swin_tiny_patch4_window7_224 cuts images into 4x4-pixel patches, so the side must be "
     "a multiple of 4: use 256 or 260"),
    (layout_cmd.main, ["--model", SWIN, "--image-size", "224", "--num-classes", "2", "--split-size", "2",
                       "--spatial-size", "1", "--num-spatial-parts", "3", "--slice-method", "vertical"],
     "--image-size: TileGrid(rows=1, cols=3) would cut a patch: image width 224 over 3 tile(s) of the "
     "SwinTransformer's 4-pixel patches"),
    (layout_cmd.main, ["--model", "timm:maxvit_tiny_rw_224", "--image-size", "100", *LAYOUT],
     "--image-size: 100: timm:maxvit_tiny_rw_224 cannot take 100x100 images (height (25) must be divisible by "
     "window (3)); it was made for 224x224 ones"),
    (layout_cmd.main, ["--model", "timm:maxvit_tiny_rw_224", "--model-args", "embed_dim=(16,16,32,32)",
                       "--image-size", "224", *LAYOUT],
     "--model-args: embed_dim=(16,16,32,32): timm:maxvit_tiny_rw_224 does not take them (attn dim should be "
     "divisible by head_dim)"),
])
def test_what_a_family_cannot_take_is_refused_in_one_line(capsys, command, flags, message):
    code, out, err = run_command(command, flags, capsys)
    errors = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(errors) == 1 and message in err and "Traceback" not in err, err
    assert "step 1" not in err and "losses" not in out
