"""Issue 81 through the command line: ``train --model virchow2`` (cut to one narrow block) records its card's ImageNet
mean and std without ``--normalize``; under ``--layer-decay`` metrics.jsonl holds each group's ``lr/<group>`` and
the checkpoint the optimizer's groups; ``export`` writes beside the weights the preprocessing a timm user needs, with
which timm's own model gives the checkpoint's outputs; a given ``--normalize`` is said to override the card."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mpi4dl_nb.checkpoint.record import read_checkpoint
from mpi4dl_nb.cli import export_cmd, train_cmd
from mpi4dl_nb.evaluation.log import read_metrics
from mpi4dl_nb.infer.model import load_layers
from mpi4dl_nb.models.normalize import IMAGENET
from tests.support.train_in_process import run_command, run_train

timm = pytest.importorskip("timm")
safetensors_torch = pytest.importorskip("safetensors.torch")

TINY = ["--model", "virchow2", "--model-args", "depth=1,embed_dim=32,num_heads=2", "--image-size", "28"]
RUN = ["--num-classes", "2", "--batch-size", "2", "--num-samples", "4", "--no-progress", "--split-size", "1",
       "--spatial-size", "0", "--dtype", "float64"]
LR, DECAY = 0.1, 0.5


@pytest.fixture(scope="module")
def decayed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two steps of the cut Virchow2 with ``--layer-decay``, its checkpoints and log in the returned folder."""
    folder = tmp_path_factory.mktemp("virchow2")
    code = train_cmd.main([*TINY, *RUN, "--steps", "2", "--lr", str(LR), "--layer-decay", str(DECAY),
                           "--lr-schedule", "cosine", "--checkpoint-dir", str(folder / "ck"),
                           "--log-dir", str(folder / "log")])
    assert code == 0
    return folder


def test_the_card_s_mean_and_std_are_recorded_and_each_group_s_rate_logged(decayed):
    record = read_checkpoint(next((decayed / "ck").glob("*.pt"))).record
    assert record.model.normalize == IMAGENET                     # without --normalize: the card's
    assert record.model.preprocessing is not None and record.model.preprocessing.card.endswith("paige-ai/Virchow2")
    names, scales = ["embedding", "block.0", "head"], [DECAY ** 2, DECAY, 1.0]
    steps = [r for r in read_metrics(decayed / "log") if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2] and steps[0]["lr"] != steps[1]["lr"]      # cosine: rates move
    for line in steps:
        assert {k: v for k, v in line.items() if k.startswith("lr/")} == {
            f"lr/{name}": pytest.approx(line["lr"] * scale) for name, scale in zip(names, scales, strict=True)}
    assert [(g.name, g.lr_scale) for g in record.param_groups] == list(zip(names, scales, strict=True))
    assert [g.lr for g in record.param_groups] == [pytest.approx(steps[-1]["lr"] * s) for s in scales]


def documented_reload() -> str:
    """The python block of docs/your-own-model.md that reloads an export in timm."""
    text = (Path(__file__).parents[2] / "docs" / "your-own-model.md").read_text()
    block = text.split("```python\nimport json, timm\n", 1)[1].split("```", 1)[0]
    return "import json, timm\n" + block


def test_export_writes_the_preprocessing_with_which_timm_gives_the_checkpoint_s_outputs(decayed, tmp_path, capsys,
                                                                                     monkeypatch):
    """The export's config.json holds model_args as a JSON object, with which the documented timm reload (run as
    the docs write it) gives the checkpoint's outputs."""
    output = tmp_path / "model.safetensors"
    code, out, err = run_command(export_cmd.main, ["--checkpoint", str(decayed / "ck"), "--output-file",
                                                   str(output)], capsys)
    assert code == 0, err
    assert "--merge-lora" not in err                                # no adapters: nothing to say
    written = Path(json.loads(out.strip().splitlines()[-1])["preprocessing"])
    assert written == tmp_path / "model.config.json"
    config = json.loads(written.read_text())
    cfg = config["pretrained_cfg"]
    assert (cfg["mean"], cfg["std"], cfg["input_size"]) == (list(IMAGENET.mean), list(IMAGENET.std), [3, 28, 28])
    assert config["model_args"] == {"mlp_layer": "SwiGLUPacked", "act_layer": "silu", "reg_tokens": 4,
                                    "init_values": 1e-5, "mlp_ratio": 5.3375, "depth": 1, "embed_dim": 32,
                                    "num_heads": 2}
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {}
    torch.set_default_dtype(torch.float64)                          # the float64 run's weights kept whole
    try:
        exec(documented_reload(), scope)                            # noqa: S102 - the docs' own block
    finally:
        torch.set_default_dtype(torch.float32)
    model = scope["model"]
    assert isinstance(model, torch.nn.Module)
    model = model.double().eval()
    data = timm.data.resolve_data_config(model=model)
    assert [tuple(data[k]) for k in ("mean", "std", "input_size")] == [IMAGENET.mean, IMAGENET.std, (3, 28, 28)]
    images = torch.rand(2, 3, 28, 28, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mean, std = (torch.tensor(data[k], dtype=torch.float64).reshape(3, 1, 1) for k in ("mean", "std"))
    layers, _ = load_layers(decayed / "ck", dtype=torch.float64)
    with torch.no_grad():
        expected = torch.nn.Sequential(*layers).eval()(images)        # the checkpoint normalises as its first step
        got = model((images - mean) / std)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    code, _, err = run_command(export_cmd.main, ["--checkpoint", str(decayed / "ck"), "--output-file",
                                                 str(tmp_path / "model.pt")], capsys)
    assert code == 2 and "model.config.json exists; pass --force" in err


def test_an_unmerged_lora_export_says_timm_will_not_load_it_and_names_merge_lora(tmp_path, capsys):
    folder = tmp_path / "ck"
    code, _, err = run_train([*TINY, *RUN, "--steps", "1", "--lora-rank", "2", "--checkpoint-dir", str(folder)],
                             capsys)
    assert code == 0, err
    code, _, err = run_command(export_cmd.main, ["--checkpoint", str(folder), "--output-file",
                                                 str(tmp_path / "adapted.pt")], capsys)
    said = [line for line in err.splitlines() if "--merge-lora" in line]
    assert code == 0 and len(said) == 1 and "lora_a, lora_b keys" in said[0] and "does not load" in said[0], err
    code, _, err = run_command(export_cmd.main, ["--checkpoint", str(folder), "--output-file",
                                                 str(tmp_path / "merged.pt"), "--merge-lora"], capsys)
    assert code == 0 and "--merge-lora" not in err, err


def test_a_given_normalize_is_said_to_override_the_card(tmp_path, capsys):
    code, _, err = run_train([*TINY, *RUN, "--steps", "1", "--normalize", "none"], capsys)
    assert code == 0, err
    said = [line for line in err.splitlines() if "overrides the card's" in line]
    assert len(said) == 1 and "--normalize none (pixels in [0, 1]) overrides the card's imagenet" in said[0], err


@pytest.mark.parametrize("model, said, recorded", [
    ("virchow2", "mean (0.485, 0.456, 0.406), std (0.229, 0.224, 0.225): the card's "
                 "(https://huggingface.co/paige-ai/Virchow2)", 'normalize = "imagenet"'),
    ("h-optimus-0", "mean (0.707223, 0.578729, 0.703617), std (0.211883, 0.230117, 0.177517): the card's "
                    "(https://huggingface.co/bioptimus/H-optimus-0)",
     'normalize = "0.707223,0.578729,0.703617,0.211883,0.230117,0.177517"'),
])
def test_train_says_the_normalisation_it_applies_and_config_toml_records_it_resolved(tmp_path, capsys, model, said,
                                                                                     recorded):
    """Issue 91: one line of the mean, std and where they come from (``--normalize auto``: the card's), and the
    run's config.toml holds the values auto resolved to, which run the same job again."""
    flags = [*TINY[2:], "--model", model, *RUN, "--steps", "1"]
    code, _, err = run_train([*flags, "--checkpoint-dir", str(tmp_path / "a")], capsys)
    assert code == 0, err
    lines = [line for line in err.splitlines() if "input normalised" in line]
    assert lines == [f"mpi4dl_nb train: input normalised as (x - mean) / std with {said}"], err
    written = (tmp_path / "a" / "config.toml").read_text()
    assert recorded in written.splitlines() and "normalize = \"auto\"" not in written
    code, _, err = run_train(["--config", str(tmp_path / "a" / "config.toml"), "--checkpoint-dir",
                              str(tmp_path / "b")], capsys)
    assert code == 0 and "overrides the card's" not in err, err
    assert recorded in (tmp_path / "b" / "config.toml").read_text().splitlines()
