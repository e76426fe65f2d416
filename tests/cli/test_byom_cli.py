"""Your own model on the command line (one process): ``--model torchvision:NAME --weights W.pth`` trains from a
1000-class state dict with the classifier replaced (one note), the checkpoint names the model and runs through
``evaluate`` and ``infer`` with no model flags and back into torchvision (``dl.model_state_dict``); a weights file of
another architecture and an unknown model name exit 2 within seconds naming the problem; ``--help`` and
``layout --model`` say what a model is and how it is cut."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

import mpi4dl_nb as dl
from mpi4dl_nb.cli import evaluate_cmd, infer_cmd, layout_cmd
from mpi4dl_nb.cli import train_cmd as cli
from mpi4dl_nb.errors import ConfigError
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip
from tests.support.summary import json_record

MISSING = missing_modules("torchvision", "timm")
ONE_PROCESS = ["--split-size", "1", "--spatial-size", "0", "--no-progress"]
SMALL = ["--image-size", "32", "--batch-size", "2", "--num-samples", "4", "--steps", "1", "--num-classes", "2"]


@pytest.fixture(autouse=True)
def _libraries() -> None:
    require_or_skip(MISSING, "models from torchvision and timm", MODELS_EXTRA)


def command(main, capsys, argv: list[str]) -> tuple[int, str, str, float]:
    """A command's ``main`` in this process: exit code, stdout, stderr, seconds."""
    start = time.monotonic()
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err, time.monotonic() - start


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict[str, Path]:
    """State dicts as published (1000 classes): a ResNet-18's, and a ResNet-50's shapes (zeros)."""
    import torchvision

    root = tmp_path_factory.mktemp("weights")
    torch.manual_seed(3)
    files = {"resnet18": root / "resnet18.pth", "resnet50": root / "resnet50.pth"}
    torch.save(torchvision.models.resnet18().state_dict(), files["resnet18"])
    with torch.device("meta"):
        shapes = torchvision.models.resnet50().state_dict()
    torch.save({k: torch.zeros(v.shape, dtype=v.dtype) for k, v in shapes.items()}, files["resnet50"])
    return files


def test_train_evaluate_infer_and_back_to_torchvision(capsys, tmp_path, weights):
    import torchvision

    ck = tmp_path / "ck"
    code, out, err, _ = command(cli.main, capsys, ["--model", "torchvision:resnet18", "--weights",
                                                   str(weights["resnet18"]), *SMALL, *ONE_PROCESS,
                                                   "--checkpoint-dir", str(ck), "--lr", "1e-12"])
    assert code == 0, err
    assert err.count("the classifier fc has 1000 outputs in the file and 2 here (--num-classes 2); it is "
                     "replaced by a new one") == 1
    summary = json_record(out)
    assert summary["model"] == "torchvision:resnet18" and summary["num_classes"] == 2
    model = torchvision.models.resnet18(num_classes=2)
    model.load_state_dict(dl.model_state_dict(ck), strict=True)
    published = torch.load(weights["resnet18"])
    assert all(torch.allclose(model.state_dict()[k], v, atol=1e-6) for k, v in published.items()
               if not k.startswith("fc.") and not k.endswith(("running_mean", "running_var", "num_batches_tracked")))

    code, out, err, _ = command(evaluate_cmd.main, capsys, ["--checkpoint", str(ck), "--all-data", "--num-samples",
                                                            "4", *ONE_PROCESS[:4]])
    assert code == 0, err
    assert json_record(out, '{"checkpoint"')["model"].startswith(
        "torchvision:resnet18, 2 classes, imagenet normalisation, from ")

    slide = tmp_path / "slide.png"
    from PIL import Image

    Image.fromarray(dl.data.ihc_image()[:96, :128]).save(slide)
    code, out, err, _ = command(infer_cmd.main, capsys, ["--checkpoint", str(ck), "--slide", str(slide), "--output",
                                                         str(tmp_path / "map.npy"), "--no-progress"])
    assert code == 0, err
    probabilities = np.load(tmp_path / "map.npy")
    assert probabilities.shape[0] == 2 and np.allclose(probabilities.sum(axis=0), 1.0)


@pytest.mark.parametrize("argv,message", [
    (["--model", "torchvision:resnet50x"], "--model: torchvision has no model 'resnet50x'; closest: resnet50"),
    (["--model", "timm:resnet5O"], "--model: timm has no model 'resnet5O'; closest: resnet50"),
    (["--model", "no_such_package.nets:build"], "cannot import module 'no_such_package.nets'"),
    (["--model", "torchvision:resnet18", "--weights", "resnet50"],
     "--weights: does not fit torchvision:resnet18 (a state dict of another architecture?): layer1.0.conv1.weight "
     "has shape [64, 64, 1, 1] in the file, [64, 64, 3, 3] in the model"),
    (["--model", "resnet", "--num-layers", "50"], "for the ImageNet ResNet-50 use --model torchvision:resnet50"),
    (["--model", "torchvision:resnet18", "--num-layers", "18"], "--num-layers: sizes this project's"),
    (["--model", "resnet", "--normalize", "imagenet"], "--normalize: applies to named models"),
])
def test_bad_models_exit_2_naming_the_problem(capsys, weights, argv, message):
    argv = [str(weights[a]) if a in weights else a for a in argv]
    code, _, err, seconds = command(cli.main, capsys, [*argv, *SMALL, *ONE_PROCESS])
    assert code == 2 and message in err, err
    assert "Traceback" not in err and seconds < 30


def test_help_says_what_resnet_is(capsys):
    with pytest.raises(SystemExit):
        cli.train_parser().parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "MPI4DL's CIFAR-style ResNet: 3 stages, stride 4" in shown and "torchvision:resnet50" in shown


def test_layout_prints_the_stage_cut_of_a_model(capsys):
    code = layout_cmd.main(["--model", "torchvision:resnet18", "--image-size", "128", "--num-classes", "2",
                            "--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "4"])
    shown = capsys.readouterr().out
    assert code == 0 and "stage cut of torchvision:resnet18:" in shown
    table = shown.split("stage cut of torchvision:resnet18:")[1].split("\nbalance:")[0].splitlines()
    rows = [line.split() for line in table[3:]]
    assert rows[0][:4] == ["0", "spatial", "0-3", "0-" + str(int(rows[1][3].split("-")[0]) - 1)], shown
    assert rows[0][4] == "conv1" and rows[1][1:3] == ["layer", "4"] and rows[-1][-1] == "2", shown
    assert "balance:" in shown and "(10 layers, 128 px images)" in shown


def test_a_python_models_checkpoint_needs_the_model(tmp_path):
    from mpi4dl_nb.checkpoint.files import new_run_id
    from mpi4dl_nb.checkpoint.record import DataRecord, RunRecord, write_checkpoint
    from mpi4dl_nb.data.apps import AppKind
    from mpi4dl_nb.run.python_run import model_record

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(4, 2))
    layers = dl.layer_list(model)
    record = RunRecord(model_record(model, 2), DataRecord(AppKind.SYNTHETIC, 16, 2)).at(1, new_run_id())
    write_checkpoint(tmp_path, record, torch.nn.Sequential(*layers).state_dict(), None)
    with pytest.raises(ConfigError, match=r"built in Python: pass that model .* as model=\.\.\."):
        dl.model_state_dict(tmp_path)
    state = dl.model_state_dict(tmp_path, model=model)
    assert list(state) == list(model.state_dict()) and torch.equal(state["3.weight"], model[3].weight)
