"""What ``evaluate`` settles from the checkpoint's record before work (one process): a model built for one image size
refuses another ``--image-size`` in one line naming the trained size; a split recorded by slide is rebuilt by slide."""
from __future__ import annotations

import pytest
from torch import nn

from mpi4dl_nb.checkpoint.record import SplitRecord
from mpi4dl_nb.cli import evaluate_cmd, train_cmd
from mpi4dl_nb.data.groups import BY_SLIDE
from mpi4dl_nb.run.evaluate_run import recorded_grouping
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip
from tests.support.train_in_process import run_command

VIT = ["--model", f"{__name__}:small_vit", "--num-classes", "2", "--batch-size", "2", "--num-samples", "2",
       "--split-size", "1", "--spatial-size", "0"]


def small_vit(num_classes: int) -> nn.Module:
    """timm's ViT built for 32 px images, one block of width 16: its checkpoint stays cheap."""
    import timm

    model: nn.Module = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=1, embed_dim=16, num_heads=1,
                                         num_classes=num_classes)
    return model


def test_a_vit_evaluated_at_another_image_size_is_refused_in_one_line(tmp_path, capsys):
    require_or_skip(missing_modules("timm"), "timm's vision transformers", MODELS_EXTRA)
    code, _, err = run_command(train_cmd.main, [*VIT, "--image-size", "32", "--steps", "1", "--no-progress",
                                                "--checkpoint-dir", str(tmp_path / "c")], capsys)
    assert code == 0, err
    code, out, err = run_command(evaluate_cmd.main, ["--checkpoint", str(tmp_path / "c"), *VIT, "--image-size", "48"],
                                 capsys)
    assert code == 2 and not out and "Traceback" not in err, err
    *before, last = err.strip().splitlines()      # the set-up lines said so far, then the one refusal
    assert all(line.startswith("mpi4dl_nb evaluate: setting up: ") for line in before), err
    assert last == ("mpi4dl_nb evaluate: error: --image-size: 48: the checkpoint's model was trained on 32x32 "
                    "images and takes that size only; give --image-size 32 or leave it out")


def test_evaluate_refuses_bad_data_before_it_loads_the_checkpoint_s_model(tmp_path, capsys, monkeypatch):
    """Issue 91: a --datapath that does not exist is refused having read the checkpoint's record only: its model is
    never built nor its weights loaded."""
    from mpi4dl_nb.infer import model as infer_model

    code, _, err = run_command(train_cmd.main, ["--model", "resnet", "--num-layers", "8", "--resnet-version", "1",
                                                "--num-filters", "4", "--image-size", "16", "--batch-size", "2",
                                                "--num-samples", "4", "--steps", "1", "--no-progress", "--split-size",
                                                "1", "--spatial-size", "0", "--checkpoint-dir", str(tmp_path / "c")],
                               capsys)
    assert code == 0, err
    loaded: list[str] = []
    monkeypatch.setattr(infer_model, "load_trained", lambda *args, **keywords: loaded.append("model"))
    (tmp_path / "empty" / "a").mkdir(parents=True)
    for folder in ("missing", "empty"):          # refused as the record is read, and as the data is opened
        code, out, err = run_command(evaluate_cmd.main, ["--checkpoint", str(tmp_path / "c"), "--app", "medical",
                                                         "--datapath", str(tmp_path / folder), "--split-size", "1",
                                                         "--spatial-size", "0"], capsys)
        assert code == 2 and not out and not loaded, err
        assert err.strip().splitlines()[-1].startswith("mpi4dl_nb evaluate: error: --datapath"), err


@pytest.mark.parametrize(("grouping", "group_by", "rebuilt"), [
    ("slide", None, BY_SLIDE),            # a split by slide (from before TCGA slides were joined into patients)
    ("slide", r"(.+)_\d+", r"(.+)_\d+"),  # the run's own regex
    ("patient", None, None),              # the default grouping, as the run had it
])
def test_the_recorded_split_is_grouped_again_as_it_was(grouping, group_by, rebuilt):
    assert recorded_grouping(SplitRecord(grouping, 0, ("a",), ("b",), 0.5, group_by=group_by)) == rebuilt
