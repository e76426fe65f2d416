"""Issue 91 item 3: ``--zero-stage`` says in one line what it shards when that is little or nothing: one process
(nothing), a pipeline whose stages have one holder each, a frozen base (LoRA's), with the bytes; a configuration that
shards most of the parameters says nothing."""
from __future__ import annotations

import pytest
import torch

from mpi4dl_nb.config import ParallelConfig
from mpi4dl_nb.models.lora import LoraSpec
from mpi4dl_nb.models.model_args import parse_model_args
from mpi4dl_nb.models.spec import ModelSpec
from mpi4dl_nb.run.zero_share import StageShare, stage_shares, zero_note
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip
from tests.support.train_in_process import run_train

MB = 2 ** 20


def resnet_layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return ModelSpec.of("resnet", num_classes=10, num_layers=8, num_filters=4, resnet_version=1).build(32)


def test_zero_stage_3_on_one_process_says_it_shards_nothing(capsys):
    code, _, err = run_train(["--zero-stage", "3", "--steps", "1", "--no-progress", "--split-size", "1",
                              "--spatial-size", "0", "--num-samples", "4", "--batch-size", "2", "--model", "resnet",
                              "--num-layers", "8", "--resnet-version", "1", "--num-filters", "4", "--image-size", "32"],
                             capsys)
    assert code == 0, err
    layers = resnet_layers()
    total = sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())
    said = [line for line in err.splitlines() if "--zero-stage" in line]
    assert said == [f"mpi4dl_nb train: --zero-stage 3 shards nothing of the model's {total / MB:.3f} MB of "
                    f"parameters (with their gradients and optimizer state): one process holds every stage, so there "
                    f"is no other holder to shard over"], err


def test_stages_of_one_holder_each_and_a_shared_spatial_stage():
    layers = resnet_layers()
    pipeline = ParallelConfig(split_size=2, spatial_size=0, zero_stage=2)
    shares = stage_shares(pipeline, layers, 32)
    assert [s.holders for s in shares] == [1, 1] and all(s.frozen == 0 for s in shares)
    total = sum(s.trained for s in shares)
    assert zero_note(pipeline, shares) == (f"--zero-stage 2 shards nothing of the model's {total / MB:.3f} MB of "
                                           f"parameters (with their gradients and optimizer state): stages 0, 1 are "
                                           f"held by one rank ({total / MB:.3f} MB kept whole)")
    replicas = ParallelConfig(split_size=2, spatial_size=0, zero_stage=1, data_parallel=2)
    assert zero_note(replicas, stage_shares(replicas, layers, 32)) is None              # every stage 2 holders
    assert zero_note(replicas.with_(zero_stage=0), stage_shares(replicas, layers, 32)) is None


def test_numbers_of_a_tile_group_beside_a_layer_stage():
    cfg = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, zero_stage=3)
    mostly_sharded = [StageShare(0, 4, 3 * MB, 0), StageShare(1, 1, 1 * MB, 0)]
    assert zero_note(cfg, mostly_sharded) is None
    little = [StageShare(0, 4, MB // 4, 0), StageShare(1, 1, 3 * MB, 0)]
    assert zero_note(cfg, little) == ("--zero-stage 3 shards 0.250 MB of the model's 3.250 MB of parameters (with "
                                      "their gradients and optimizer state): stage 1 is held by one rank (3.000 MB "
                                      "kept whole)")


def test_a_frozen_lora_base_is_said_never_to_be_sharded():
    require_or_skip(missing_modules("timm"), "timm's vision transformers", MODELS_EXTRA)
    spec = ModelSpec.of("timm:vit_tiny_patch16_224", num_classes=2, lora=LoraSpec(2),
                        model_args=parse_model_args("depth=2,embed_dim=32,num_heads=2"))
    torch.manual_seed(0)
    layers = spec.build(32, adapters=False)
    spec.with_adapters(layers)
    cfg = ParallelConfig(split_size=1, spatial_size=0, data_parallel=2, zero_stage=3)
    shares = stage_shares(cfg, layers, 32)
    (share,) = shares
    assert share.holders == 2 and share.frozen > 3 * share.trained > 0
    note = zero_note(cfg, shares)
    assert note is not None and note.startswith(f"--zero-stage 3 shards {share.trained / MB:.3f} MB of the model's")
    assert note.endswith(f": frozen parameters are never sharded ({share.frozen / MB:.3f} MB: a LoRA base, frozen "
                         f"blocks)")


@pytest.mark.parametrize("world", [1])
def test_level_0_says_nothing(world):
    assert zero_note(ParallelConfig(split_size=1, spatial_size=0), [StageShare(0, world, MB, 0)]) is None
