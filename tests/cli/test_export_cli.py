"""``python -m mpi4dl_nb export`` (issue 65): a checkpoint's model as a state dict under the model's own keys, loaded
strictly by the library that made the model and giving the checkpoint's outputs (float64, one process); a layer-list
model's own module keys, said so; outputs never replaced without --force; one JSON line last."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mpi4dl_nb.cli import export_cmd, train_cmd
from mpi4dl_nb.infer.model import load_layers
from tests.support.train_in_process import run_command, run_train

timm = pytest.importorskip("timm")
safetensors_torch = pytest.importorskip("safetensors.torch")

TIMM_NAME = "test_resnet"         # timm's own tiny test network (a ResNet of 0.37 M parameters)
CLASSES = 3
ONE_STEP = ["--num-classes", str(CLASSES), "--batch-size", "2", "--num-samples", "4", "--steps", "1", "--no-progress",
            "--split-size", "1", "--spatial-size", "0", "--dtype", "float64"]


def export(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    return run_command(export_cmd.main, argv, capsys)


@pytest.fixture(scope="module")
def timm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``timm:test_resnet`` run of one step through the CLI (its checkpoint directory)."""
    folder = tmp_path_factory.mktemp("timm") / "ck"
    code = train_cmd.main(["--model", f"timm:{TIMM_NAME}", "--normalize", "none", "--image-size", "32", *ONE_STEP,
                           "--checkpoint-dir", str(folder)])
    assert code == 0
    return folder


def test_a_timm_model_loads_strictly_into_timm_and_gives_the_checkpoints_outputs(timm_checkpoint, tmp_path, capsys):
    output = tmp_path / "model.safetensors"
    code, out, err = export(["--checkpoint", str(timm_checkpoint), "--output-file", str(output)], capsys)
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    state = safetensors_torch.load_file(str(output))
    assert summary == {"model": f"timm:{TIMM_NAME}", "keys": len(state), "own_keys": True,
                       "bytes": output.stat().st_size, "output": str(output),
                       "checkpoint": summary["checkpoint"], "preprocessing": str(tmp_path / "model.config.json")} \
        and summary["checkpoint"].startswith(str(timm_checkpoint))
    config = json.loads((tmp_path / "model.config.json").read_text())      # --normalize none: pixels in [0, 1]
    assert config["pretrained_cfg"] == {"mean": [0.0] * 3, "std": [1.0] * 3, "input_size": [3, 32, 32], "crop_pct": 1}
    model = timm.create_model(TIMM_NAME, num_classes=CLASSES).double()
    model.load_state_dict(state, strict=True)
    assert all(t.dtype == torch.float64 for t in state.values() if t.is_floating_point())
    layers, _ = load_layers(timm_checkpoint, dtype=torch.float64)
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        expected = torch.nn.Sequential(*layers).eval()(images)
        got = model.eval()(images)
    assert expected.shape == (2, CLASSES)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_an_existing_file_is_replaced_only_with_force_and_the_suffix_chooses_the_format(timm_checkpoint, tmp_path,
                                                                                         capsys):
    output = tmp_path / "model.pt"
    output.write_bytes(b"earlier")
    code, out, err = export(["--checkpoint", str(timm_checkpoint), "--output-file", str(output)], capsys)
    assert code == 2 and not out and "exists; pass --force" in err and output.read_bytes() == b"earlier"
    code, out, err = export(["--checkpoint", str(timm_checkpoint), "--output-file", str(tmp_path / "m.bin")], capsys)
    assert code == 2 and "write FILE.safetensors or FILE.pt" in err and not (tmp_path / "m.bin").exists()
    config = tmp_path / "export.toml"                     # the flags from a file, --force on the command line
    config.write_text(f'[export]\ncheckpoint = "{timm_checkpoint}"\noutput-file = "{output}"\n')
    code, out, err = export(["--config", str(config), "--force"], capsys)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["bytes"] == output.stat().st_size > len(b"earlier")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []       # no partial file left
    model = timm.create_model(TIMM_NAME, num_classes=CLASSES)
    model.load_state_dict(torch.load(output, weights_only=True), strict=True)


def test_a_layer_list_model_exports_its_module_keys_and_says_so(tmp_path, capsys):
    folder = tmp_path / "ck"
    code, _, err = run_train(["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4",
                              "--image-size", "16", *ONE_STEP, "--checkpoint-dir", str(folder)], capsys)
    assert code == 0, err
    output = tmp_path / "resnet.safetensors"
    code, out, err = export(["--checkpoint", str(folder), "--output-file", str(output)], capsys)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["own_keys"] is False
    assert "no keys of its own: the keys are those of nn.Sequential(*layers)" in err
    layers, _ = load_layers(folder, dtype=torch.float64)
    torch.nn.Sequential(*layers).load_state_dict(safetensors_torch.load_file(str(output)), strict=True)
