"""Issue 81 item 4: the messages a new user met, each saying what is wrong and the way out: the bad ``--model-args``
value named (and a misspelt key's closest), a resume naming the model flag that changed (``--lora-rank``), a
single-page tiled TIFF beside its GeoJSON trained as a slide, a 2-block weights file told to add ``depth=2``, a
refused ``--resume latest`` (or data) leaving no folder, a label volume's ``scl_slope`` named."""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from mpi4dl_nb.errors import ConfigError
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip
from tests.support.segmentation_data import write_pairs
from tests.support.train_in_process import run_train

VIT = ["--model", "timm:vit_tiny_patch16_224", "--model-args", "depth=1,embed_dim=32,num_heads=2", "--num-classes",
       "2", "--batch-size", "2", "--num-samples", "4", "--steps", "1", "--split-size", "1", "--spatial-size", "0",
       "--no-progress", "--image-size", "32"]
SCALING_OFFSET = 112          # NIfTI-1 header: scl_slope, then scl_inter (float32 each)
UNET = ["--task", "segmentation", "--model", "unet", "--num-layers", "2", "--num-filters", "4", "--split-size", "1",
        "--spatial-size", "0", "--no-progress"]


def needs_timm() -> None:
    require_or_skip(missing_modules("timm"), "timm's vision transformers", MODELS_EXTRA)


def built(model: str, args: str) -> str:
    """The ConfigError ``--model model --model-args args`` is refused with."""
    from mpi4dl_nb.models.model_args import parse_model_args
    from mpi4dl_nb.models.spec import ModelSpec

    with pytest.raises(ConfigError) as caught:
        ModelSpec.of(model, num_classes=2, model_args=parse_model_args(args)).build(32)
    return str(caught.value)


def test_a_model_argument_names_the_bad_value_and_a_misspelt_key_its_closest():
    needs_timm()
    value = built("timm:vit_tiny_patch16_224", "depth=two")
    assert value.startswith("--model-args: depth=two: timm:vit_tiny_patch16_224 wants a number, not the name in "
                            "depth's value 'two'") and "give depth a number" in value, value
    key = built("timm:vit_tiny_patch16_224", "dept=2")
    assert key == "--model-args: dept=2: timm:vit_tiny_patch16_224 does not take dept; did you mean depth?", key


def test_a_weights_file_of_fewer_blocks_says_which_depth_to_build():
    needs_timm()
    import timm

    from mpi4dl_nb.models.model_args import parse_model_args
    from mpi4dl_nb.models.spec import ModelSpec
    from mpi4dl_nb.models.weights import load_weights

    torch.manual_seed(0)
    narrow = {"embed_dim": 16, "num_heads": 2}
    shallow = timm.create_model("vit_tiny_patch16_224", num_classes=2, img_size=32, depth=2, **narrow).state_dict()
    layers = ModelSpec.of("timm:vit_tiny_patch16_224", num_classes=2,
                          model_args=parse_model_args("embed_dim=16,num_heads=2")).build(32)
    with pytest.raises(ConfigError) as caught:
        load_weights(layers, shallow, model="timm:vit_tiny_patch16_224")
    text = str(caught.value)
    assert "missing blocks.2." in text and text.endswith("; the file holds 2 transformer blocks, the model 12: add "
                                                         "--model-args depth=2"), text


def test_a_weights_file_of_another_depth_is_refused_before_the_model_is_built(tmp_path, capsys, monkeypatch):
    """Issue 91: ``train --weights`` of a 2-block file for a 12-block ViT is refused in one line (naming depth=2)
    having built the model on the meta device only; a file that fits trains, the real build drawing the weights the
    seed draws (the meta build draws nothing)."""
    needs_timm()
    import timm

    from mpi4dl_nb.models.spec import ModelSpec

    torch.manual_seed(0)
    shallow = timm.create_model("vit_tiny_patch16_224", num_classes=2, img_size=32, depth=2, embed_dim=16,
                                num_heads=2).state_dict()
    torch.save(shallow, tmp_path / "shallow.pt")
    devices: list[str] = []
    build = ModelSpec.build

    def recorded(self, *args, **keywords):
        devices.append(str(torch.empty(0).device))
        return build(self, *args, **keywords)

    monkeypatch.setattr(ModelSpec, "build", recorded)
    flags = ["--model", "timm:vit_tiny_patch16_224", "--num-classes", "2", "--batch-size", "2", "--num-samples", "4",
             "--steps", "1", "--split-size", "1", "--spatial-size", "0", "--no-progress", "--image-size", "32"]
    code, _, err = run_train([*flags, "--model-args", "embed_dim=16,num_heads=2", "--weights",
                              str(tmp_path / "shallow.pt")], capsys)
    assert code == 2 and devices == ["meta"], (devices, err)
    assert len(err.strip().splitlines()) == 1 and "add --model-args depth=2" in err, err
    devices.clear()
    code, _, err = run_train([*flags, "--model-args", "embed_dim=16,num_heads=2,depth=2", "--weights",
                              str(tmp_path / "shallow.pt")], capsys)
    assert code == 0 and devices[:2] == ["meta", "cpu"], (devices, err)


def test_a_resume_with_another_lora_rank_is_refused_naming_it(tmp_path, capsys):
    needs_timm()
    folder = str(tmp_path / "ck")
    code, _, err = run_train([*VIT, "--lora-rank", "2", "--checkpoint-dir", folder], capsys)
    assert code == 0, err
    code, out, err = run_train([*VIT, "--lora-rank", "4", "--checkpoint-dir", folder, "--resume", "latest",
                                "--steps", "2"], capsys)
    assert code == 2 and not out and "model: --lora-rank 2 -> 4" in err, err
    assert "--num-filters" not in err and "--allow-config-change model" in err, err


def test_a_changed_layer_decay_or_lora_alpha_is_named_by_its_flag():
    """``--layer-decay`` enters the optimizer's identity, LoRA's alpha the model's (no tensor's shape changes)."""
    from mpi4dl_nb.models.lora import LoraSpec
    from mpi4dl_nb.models.spec import ModelSpec
    from mpi4dl_nb.pipeline.optim import OptimizerSpec
    from mpi4dl_nb.run.identity import FLAGS, RunIdentity, describe_changes, identity_flags

    spec = ModelSpec.of("timm:vit_tiny_patch16_224", num_classes=2, lora=LoraSpec(4))
    adamw = OptimizerSpec.of("adamw", 1e-3)

    def identity(model: ModelSpec, optimizer: OptimizerSpec) -> RunIdentity:
        return RunIdentity({"model": "timm:vit [ab]", "optimizer": optimizer.describe(),
                            FLAGS: identity_flags(model, optimizer)})

    saved = identity(spec, adamw)
    decayed = identity(spec, OptimizerSpec.of("adamw", 1e-3, layer_decay=0.75)).changes_from(saved)
    assert describe_changes(decayed) == "optimizer: --layer-decay none -> 0.75"
    alpha = identity(ModelSpec.of("timm:vit_tiny_patch16_224", num_classes=2, lora=LoraSpec(4, 16.0)), adamw)
    assert describe_changes(alpha.changes_from(saved)) == "model: --lora-alpha 8 -> 16"
    assert identity(spec, adamw).changes_from(saved) == []
    older = RunIdentity({k: v for k, v in saved.fields.items() if k != FLAGS})     # a checkpoint without flags
    assert alpha.changes_from(older) == []


def test_a_refused_resume_or_data_check_leaves_no_folder(tmp_path, capsys):
    missing = tmp_path / "runs" / "ck"
    data = write_pairs(tmp_path / "pairs", count=4, size=32)
    flags = [*UNET, "--datapath", str(data), "--num-classes", "3", "--image-size", "32", "--batch-size", "2",
             "--steps", "1"]
    code, out, err = run_train([*flags, "--checkpoint-dir", str(missing), "--resume", "latest"], capsys)
    assert code == 2 and not out and f"--resume: latest: --checkpoint-dir '{missing}': does not exist" in err, err
    assert "drop --resume to start a new run there" in err and not missing.parent.exists()
    missing.mkdir(parents=True)
    code, out, err = run_train([*flags, "--checkpoint-dir", str(missing), "--resume", "latest"], capsys)
    assert code == 2 and "holds no checkpoint (step-*.pt) to continue" in err, err
    missing.rmdir()
    from PIL import Image

    Image.fromarray(np.full((32, 32), 5, np.uint8)).save(data / "masks" / "tile1.png")   # refused by the data check
    logs = tmp_path / "logs"
    code, out, err = run_train([*flags, "--checkpoint-dir", str(missing), "--log-dir", str(logs)], capsys)
    assert code == 2 and "holds label(s) 5 outside 0..2" in err, err
    assert not missing.exists() and not logs.exists()


def test_a_single_page_tiled_tiff_beside_its_geojson_trains_segmentation(tmp_path):
    """The documented layout, ``S.tif`` (one tiled page, as tifffile writes it) with ``S.geojson``: a slide, trained
    by a real one-process command line."""
    import tifffile

    from mpi4dl_nb.data.files import folder_files

    folder = tmp_path / "slides"
    folder.mkdir()
    pixels = np.random.default_rng(0).integers(60, 200, (128, 128, 3), dtype=np.uint8)
    tifffile.imwrite(folder / "s1.tif", pixels, tile=(64, 64), photometric="rgb")
    polygon = [[[10, 10], [100, 20], [90, 110], [15, 100], [10, 10]]]
    feature = {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": polygon},
               "properties": {"objectType": "annotation", "classification": {"name": "tumor"}}}
    (folder / "s1.geojson").write_text(json.dumps({"type": "FeatureCollection", "features": [feature]}))
    assert folder_files(folder) == ([folder / "s1.tif"], True)
    done = subprocess.run([sys.executable, "-m", "mpi4dl_nb", "train", *UNET, "--datapath", str(folder), "--classes",
                           "background,tumor", "--image-size", "32", "--batch-size", "2", "--steps", "1",
                           "--min-tissue", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["steps_run"] == 1, done.stdout


def test_a_label_volume_scaled_by_its_header_is_refused_naming_the_slope(tmp_path):
    nibabel = pytest.importorskip("nibabel")
    from mpi4dl_nb.data.volume.dataset import check_volume_pair, label_volumes
    from tests.support.volume_data import write_volume_pairs

    root = write_volume_pairs(tmp_path / "v")
    labels = nibabel.load(root / "masks" / "b.nii.gz")
    plain = root / "masks" / "b.nii"
    nibabel.save(nibabel.Nifti1Image(np.asarray(labels.dataobj), labels.affine), plain)
    (root / "masks" / "b.nii.gz").unlink()
    header = bytearray(plain.read_bytes())
    struct.pack_into("<ff", header, SCALING_OFFSET, 2.0, 0.0)        # scl_slope 2, scl_inter 0 as a scanner writes
    plain.write_bytes(bytes(header))
    assert nibabel.load(plain).dataobj.slope == 2.0
    label_volumes.cache_clear()
    problem = check_volume_pair(root / "images" / "b.nii.gz", (6, 8, 8), 3, None)
    assert problem is not None and "scl_slope 2 and scl_inter 0" in problem and "set scl_slope 1" in problem, problem
