"""timm's Swin cut at its stages (issue 81): the embedding, each stage and the head as pieces under the model's keys,
a checkpoint of the former two-piece cut loading into them, channels-first maps between the pieces (joined by the
hand-off as any feature map's tiles), the
default cut placing stages on the layer ranks (stochastic depth kept on one stage), and, under mpiexec, training on
2x2 tiles + 2 layer ranks equal to one process in float64 (tests/mpi/swin_cut_exact.py, a job of the 6-rank launch).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpi4dl_nb.config import ParallelConfig
from mpi4dl_nb.models.cut import layer_list
from mpi4dl_nb.pipeline.default_cut import default_balance, draws_in_training
from mpi4dl_nb.pipeline.handoff import FeatureTiles, handoff_of
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.mpi import swin_cut_exact
from tests.support.battery import shared_job
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

MISSING = missing_modules("timm")
JOB = None if MISSING else shared_job(6, "swin_cut_exact", timeout=300)
TINY = {"depths": (1, 1, 1, 1), "embed_dim": 16, "num_heads": (1, 1, 1, 1)}


def tiny_swin(**kwargs: object) -> nn.Module:
    require_or_skip(MISSING, "timm's Swin", MODELS_EXTRA)
    import timm

    torch.manual_seed(0)
    return timm.create_model("swin_tiny_patch4_window7_224", num_classes=3, **{**TINY, **kwargs})


def test_a_swin_is_cut_at_its_stages_under_the_model_s_keys():
    from mpi4dl_nb.models.normalize import IMAGENET, normalized
    from mpi4dl_nb.models.pieces import original_state_dict
    from mpi4dl_nb.models.swin import SwinEmbedding, SwinHead, SwinStagePiece

    model = tiny_swin()
    layers = layer_list(model)
    assert [type(layer) for layer in layers] == [SwinEmbedding, *[SwinStagePiece] * 4, SwinHead]
    assert [layer.paths for layer in layers[1:5]] == [(f"layers.{i}",) for i in range(4)]
    assert layers[-1].paths == ("norm", "head.global_pool", "head.drop", "head.fc", "head.flatten")
    net = nn.Sequential(*layers)
    assert original_state_dict(layers, net.state_dict()).keys() == model.state_dict().keys()
    x = torch.rand(2, 3, 224, 224)
    with torch.no_grad():
        assert torch.equal(net.eval()(x), model.eval()(x))
        first = normalized(layers, IMAGENET)[0]
        assert isinstance(first, SwinEmbedding) and len(first.image_steps()) == 1
        assert torch.equal(first(x), layers[0]((x - torch.tensor(IMAGENET.mean).reshape(3, 1, 1))
                                               / torch.tensor(IMAGENET.std).reshape(3, 1, 1)))
    with pytest.raises(ValueError, match="built for 224x224 images"):
        layers[0](torch.rand(1, 3, 192, 192))


def test_a_checkpoint_of_the_two_piece_cut_loads_into_the_stage_pieces():
    from mpi4dl_nb.models.pieces import recut_state_dict

    model = tiny_swin()
    trunk = ("patch_embed", "layers", "norm")      # the former cut: the trunk (piece 0), the classifier (piece 1)
    old = {f"{0 if key.startswith(trunk) else 1}.{key}": value for key, value in model.state_dict().items()}
    layers = layer_list(tiny_swin(), check=False)   # other weights
    net = nn.Sequential(*layers)
    net.load_state_dict(recut_state_dict(layers, old), strict=True)
    x = torch.rand(1, 3, 224, 224)
    with torch.no_grad():
        assert torch.equal(net.eval()(x), model.eval()(x))
    assert "5.head.fc.weight" in recut_state_dict(layers, old) and "1.head.fc.weight" in old


def test_the_pieces_hand_on_channels_first_maps_that_the_hand_off_joins_as_feature_tiles():
    layers = layer_list(tiny_swin(), check=False)
    x = torch.rand(1, 3, 224, 224)
    with torch.no_grad():
        grids = [layers[0](x)]
        for layer in layers[1:5]:
            grids.append(layer(grids[-1]))
    assert [tuple(g.shape) for g in grids] == [(1, 16, 56, 56), (1, 16, 56, 56), (1, 32, 28, 28), (1, 64, 14, 14),
                                               (1, 128, 7, 7)]
    grid = TileGrid(2, 2)
    handoff = handoff_of(layers[:3], grid)
    assert handoff == FeatureTiles(grid)
    tiles = [grids[2][:, :, r0:r1, c0:c1] for r0, r1, c0, c1 in grid.tile_boxes(28, 28)]
    assert torch.equal(handoff.join_payloads(tiles).payload, grids[2])


def test_the_default_cut_places_stages_on_the_layer_ranks_and_keeps_stochastic_depth_on_one():
    cfg = ParallelConfig(split_size=3, spatial_size=1, num_spatial_parts=4)
    plain = layer_list(tiny_swin(drop_path_rate=0.0), check=False)
    balance = default_balance(plain, cfg, image_size=224)
    assert len(balance) == 3 and balance[1] >= 1 and balance[0] + balance[1] <= 5   # a stage on layer rank 4
    drawing = layer_list(tiny_swin(drop_path_rate=0.2), check=False)
    draws = draws_in_training(drawing)
    assert draws == [False, False, True, True, True, False]   # block 0's rate is 0: linearly up to the last
    balance = default_balance(drawing, cfg, image_size=224)
    ends = [sum(balance[:i]) for i in range(4)]
    holding = [stage for stage in range(3) if any(draws[ends[stage]:ends[stage + 1]])]
    assert len(holding) == 1, balance


def test_a_swin_on_tiles_and_two_layer_ranks_trains_as_one_process(shared_launch):
    assert JOB is not None
    shared_launch(JOB).require_clean(swin_cut_exact.check_names())
