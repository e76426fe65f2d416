"""Foundation models on the command line (one process): ``--model-args`` builds the published layer choices and the
checkpoint keeps them (evaluate rebuilds the network without them); a headless state dict (``num_classes=0``)
trains a new head, said in one line; a pickled model is refused in one line naming what to save instead."""
from __future__ import annotations

import pytest
import torch

import mpi4dl_nb as dl
from mpi4dl_nb.cli import evaluate_cmd, layout_cmd, train_cmd
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip
from tests.support.summary import json_record
from tests.support.train_in_process import run_command

ARGS = "embed_dim=48,num_heads=2,depth=2,mlp_layer=swiglu_packed,act_layer=silu,reg_tokens=4,init_values=1e-5"
VIT = ["--model", "timm:vit_tiny_patch16_224", "--num-classes", "2", "--batch-size", "2", "--num-samples", "4",
       "--steps", "1", "--split-size", "1", "--spatial-size", "0", "--no-progress", "--dtype", "float64",
       "--image-size", "32"]


@pytest.fixture(autouse=True)
def _libraries() -> None:
    require_or_skip(missing_modules("timm"), "timm's vision transformers", MODELS_EXTRA)


def test_model_args_build_the_network_and_the_checkpoint_rebuilds_it(tmp_path, capsys):
    import timm

    code, out, err = run_command(train_cmd.main, [*VIT, "--model-args", ARGS, "--checkpoint-dir", str(tmp_path)],
                                 capsys)
    assert code == 0, err
    state = dl.model_state_dict(tmp_path)
    model = timm.create_model("vit_tiny_patch16_224", num_classes=2, img_size=32, embed_dim=48, num_heads=2, depth=2,
                              mlp_layer=timm.layers.SwiGLUPacked, act_layer="silu", reg_tokens=4, init_values=1e-5)
    model.double().load_state_dict(state, strict=True)         # the published layers, under timm's own keys
    assert state["reg_token"].shape == (1, 4, 48) and "blocks.1.ls1.gamma" in state
    code, out, err = run_command(evaluate_cmd.main, ["--checkpoint", str(tmp_path), "--split-size", "1",
                                                     "--spatial-size", "0", "--num-samples", "4"], capsys)
    assert code == 0 and json_record(out, "{\"checkpoint\"")["count"] == 4, err


def test_a_headless_state_dict_trains_a_new_head(tmp_path, capsys):
    import timm

    torch.manual_seed(0)
    trunk = timm.create_model("vit_tiny_patch16_224", num_classes=0, img_size=32, depth=2)
    torch.save(trunk.state_dict(), tmp_path / "trunk.pth")
    code, out, err = run_command(train_cmd.main, [*VIT, "--model-args", "depth=2", "--weights",
                                                  str(tmp_path / "trunk.pth"), "--checkpoint-dir",
                                                  str(tmp_path / "c"), "--train-blocks", "0"], capsys)
    assert code == 0, err
    assert "no classifier in the file (a headless trunk, saved with num_classes=0): a new head is drawn for " \
           "--num-classes 2" in err
    state = dl.model_state_dict(tmp_path / "c")
    assert torch.equal(state["blocks.1.attn.qkv.weight"], trunk.state_dict()["blocks.1.attn.qkv.weight"].double())
    assert state["head.weight"].shape == (2, 192)


def test_a_pickled_model_is_refused_in_one_line(tmp_path, capsys):
    torch.save(torch.nn.Linear(2, 2), tmp_path / "model.pt")
    code, out, err = run_command(train_cmd.main, [*VIT, "--weights", str(tmp_path / "model.pt")], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and not out and len(lines) == 1, err
    assert "holds pickled Python objects" in err and "torch.save(model.state_dict(), path)" in err
    assert "\x1b[" not in err


@pytest.mark.parametrize(("flags", "message"), [
    (["--model", "timm:vit_tiny_patch16_224", "--model-args", "foo=1"],
     "--model-args: foo=1: timm:vit_tiny_patch16_224 does not take foo"),
    (["--model", "resnet", "--model-args", "depth=2"], "--model-args: passes keyword arguments to a named model's"),
    (["--model", "timm:vit_tiny_patch16_224", "--model-args", "mlp_layer=bogus"], "use one of mlp, swiglu"),
])
def test_model_args_a_model_cannot_take_are_refused_in_layout(capsys, flags, message):
    code, out, err = run_command(layout_cmd.main, [*flags, "--image-size", "32", "--split-size", "1",
                                                   "--spatial-size", "0", "--num-spatial-parts", "1"], capsys)
    assert code == 2 and message in err, err
