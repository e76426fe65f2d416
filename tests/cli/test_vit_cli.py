"""Vision transformers on the command line (one process): ``--model timm:NAME`` trains at the run's image size with
a timm state dict of another token grid (a line says its position embeddings were resampled) and ``--train-blocks``
(a line says what trains; the checkpoint records it, and its size: evaluate rebuilds it without model flags);
refused before work, naming the fix: an image side the patches do not tile, ``--train-blocks`` above the depth or
with a model without blocks; what a ViT's spatial stage cannot run (a tile that cuts a patch, two spatial stages,
the head on tiles); the layout of one that runs."""
from __future__ import annotations

import pytest
import torch

import mpi4dl_nb as dl
from mpi4dl_nb.cli import evaluate_cmd, layout_cmd, train_cmd
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.run.job import TrainJob
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip
from tests.support.summary import json_record
from tests.support.train_in_process import run_command

MISSING = missing_modules("timm")
VIT = ["--model", "timm:vit_tiny_patch16_224", "--num-classes", "2", "--batch-size", "2", "--num-samples", "4",
       "--steps", "1", "--split-size", "1", "--spatial-size", "0", "--no-progress", "--dtype", "float64"]


@pytest.fixture(autouse=True)
def _libraries() -> None:
    require_or_skip(MISSING, "timm's vision transformers", MODELS_EXTRA)


def test_a_vit_trains_from_a_timm_state_dict_of_another_grid_in_its_last_blocks(tmp_path, capsys, monkeypatch):
    import timm

    torch.manual_seed(0)
    weights = tmp_path / "vit.pth"
    torch.save(timm.create_model("vit_tiny_patch16_224").state_dict(), weights)   # 224 px, 1000 classes
    code, out, err = run_command(train_cmd.main, [*VIT, "--image-size", "32", "--weights", str(weights),
                                                  "--train-blocks", "1", "--checkpoint-dir", str(tmp_path / "c")],
                                 capsys)
    assert code == 0, err
    assert "--weights: pos_embed holds a 14x14 token grid, the model 2x2 (--image-size): resampled" in err
    assert "--train-blocks 1: training block 11, the final norm and the head of timm:vit_tiny_patch16_224" in err
    summary = json_record(out)
    assert summary["model"] == "timm:vit_tiny_patch16_224" and len(summary["losses"]) == 1
    state = dl.model_state_dict(tmp_path / "c")
    model = timm.create_model("vit_tiny_patch16_224", num_classes=2, img_size=32).double()
    model.load_state_dict(state, strict=True)
    published = torch.load(weights)
    assert torch.equal(state["blocks.3.attn.qkv.weight"], published["blocks.3.attn.qkv.weight"].double())  # frozen
    assert not torch.equal(state["blocks.11.mlp.fc1.weight"], published["blocks.11.mlp.fc1.weight"].double())
    code, out, err = run_command(evaluate_cmd.main, ["--checkpoint", str(tmp_path / "c"), "--split-size", "1",
                                                     "--spatial-size", "0", "--num-samples", "4"], capsys)
    assert code == 0 and json_record(out, "{\"checkpoint\"")["count"] == 4, err     # rebuilt at its token grid
    evaluate_refuses_two_spatial_stages(tmp_path / "c", monkeypatch, capsys)


def evaluate_refuses_two_spatial_stages(checkpoint, monkeypatch, capsys):
    """``evaluate`` of a ViT checkpoint on a layout its tokens cannot run (two spatial stages) is refused in its
    agreed set-up, before work (``refuse_token_spatial_stage``): the launch's world faked to the layout's 9 ranks,
    this one process rank 0 of them."""
    from mpi4dl_nb.cli import layout_cmd
    from mpi4dl_nb.config import ParallelConfig

    layout = ["--split-size", "3", "--spatial-size", "2", "--num-spatial-parts", "4"]
    ranks = ParallelConfig(split_size=3, spatial_size=2, num_spatial_parts=4).world_size
    monkeypatch.setattr(layout_cmd, "launched_world", lambda: (0, ranks, True))
    code, out, err = run_command(evaluate_cmd.main, ["--checkpoint", str(checkpoint), *layout, "--num-samples", "4"],
                                 capsys)
    assert code == 2 and not out, err
    assert "mpi4dl_nb evaluate: error: --spatial-size: 2: a ViT's tokens run on one spatial stage" in err, err


@pytest.mark.parametrize(("flags", "message"), [
    (["--image-size", "40"], "--image-size: 40: timm:vit_tiny_patch16_224 cuts images into 16x16-pixel patches, so "
                             "the side must be a multiple of 16: use 32 or 48"),
    (["--image-size", "32", "--train-blocks", "13"], "--train-blocks: 13: timm:vit_tiny_patch16_224 has 12 blocks; "
                                                     "use at most 12"),
])
def test_what_a_vit_cannot_run_is_refused_before_the_first_step(capsys, flags, message):
    code, out, err = run_command(train_cmd.main, [*VIT, *flags], capsys)
    assert code == 2 and message in err and not out, err


def test_train_blocks_is_refused_for_a_model_without_blocks_and_below_zero():
    with pytest.raises(ConfigError, match="--train-blocks: freezes all but the last blocks .* --model resnet has none"):
        TrainJob.of(model="resnet", train_blocks=2)
    with pytest.raises(ConfigError, match="--train-blocks: must be a number >= 0, got -1"):
        TrainJob.of(model="timm:vit_tiny_patch16_224", train_blocks=-1)
    with pytest.raises(ConfigError, match="--train-blocks: .*timm:resnet18 is not one"):
        from mpi4dl_nb.models.spec import ModelSpec
        from mpi4dl_nb.models.vit import train_last_blocks

        spec = ModelSpec.of("timm:resnet18", num_classes=2, train_blocks=1)
        train_last_blocks(spec.build(32), 1, spec.label)


def test_layout_shows_a_vit_s_spatial_stage_on_token_tiles(capsys):
    """The embedding and the first blocks on 4 tiles, the rest on a layer stage (trained exactly: byom_exact.py)."""
    code, out, err = run_command(layout_cmd.main, ["--model", "timm:vit_tiny_patch16_224", "--num-classes", "2",
                                                   "--image-size", "64", "--split-size", "2", "--spatial-size", "1",
                                                   "--num-spatial-parts", "4"], capsys)
    assert code == 0, err
    assert "0      spatial  0-3    0-6     patch_embed .. blocks.5" in out and "balance: 7,7 (14 layers" in out, out


SPATIAL = ["--image-size", "64", "--num-spatial-parts", "4"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--image-size", "48", "--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "4"],
     "--image-size: TileGrid(rows=2, cols=2) would cut a patch: image height 48 over 2 tile(s) of the ViT's 16-pixel "
     "patches (sizes that work: multiples of 32, e.g. 32 or 64)"),
    ([*SPATIAL, "--split-size", "3", "--spatial-size", "2"], "--spatial-size: 2: a ViT's tokens run on one spatial "
                                                             "stage"),
    ([*SPATIAL, "--split-size", "1", "--spatial-size", "1"], "--split-size: [14] puts the ViT's head (final norm, "
                                                             "pool, classifier) on the spatial stage; end the spatial "
                                                             "stage before it (--split-size 2)"),
])
def test_what_a_vit_s_spatial_stage_cannot_run_is_refused_naming_the_way_out(capsys, flags, message):
    code, _, err = run_command(layout_cmd.main, ["--model", "timm:vit_tiny_patch16_224", "--num-classes", "2",
                                                 *flags], capsys)
    assert code == 2 and message in err, err
