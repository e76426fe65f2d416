"""The planner's time of attention models (issue 81, what ``tune`` predicts): a small Swin's and a small ViT's
one-process step, and a Swin's stages on a 2x2 tile, predicted against what the engine then takes, within 25%.

Both sides are read by the planner's clock (a thread's CPU seconds on one thread: another process's load does not
move it; ``tests/planner/test_planner_attention_time.py`` says why, and keeps the fastest of a few attempts on each
side, or one attempt's back-to-back pair). The models are cut as ``layer_list`` cuts them (a Swin at its stages).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpi4dl_nb import ParallelConfig, planner
from mpi4dl_nb.models.cut import layer_list
from mpi4dl_nb.planner.fake_world import FakeComm, FakeWorld, SizeOracle
from mpi4dl_nb.planner.layer_timer import LayerTimer
from mpi4dl_nb.planner.step_time import step_model
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.planner.test_planner_attention_time import NODE, fastest_ratio, one_thread_seconds
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

SIZE = 112
LOW, HIGH = 0.8, 1.25      # predicted / measured


def small(name: str) -> list[nn.Module]:
    """A small timm Swin (a narrow block a stage, 4x4 windows) or ViT (two blocks) built for ``SIZE`` px, cut."""
    require_or_skip(missing_modules("timm"), "planner times of transformers", MODELS_EXTRA)
    import timm

    torch.manual_seed(0)
    if name == "swin":
        return layer_list(timm.create_model("swin_tiny_patch4_window7_224", img_size=SIZE, num_classes=2,
                                            depths=(2, 2, 1, 1), embed_dim=16, num_heads=(1, 1, 2, 2),
                                            window_size=4, drop_path_rate=0.0))
    return layer_list(timm.create_model("vit_tiny_patch16_224", img_size=SIZE, num_classes=2, depth=2))


@pytest.mark.parametrize("name", ["swin", "vit"])
def test_one_process_step_of_a_small_transformer_is_predicted_within_25_percent(name):
    from mpi4dl_nb.pipeline.engine import HybridEngine

    layers = small(name)
    cfg = ParallelConfig(split_size=1, spatial_size=0)
    engine = HybridEngine(layers, cfg, FakeWorld(1).comm(0, "cpu"), loss_fn=nn.CrossEntropyLoss(),
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), image_size=SIZE)
    images, labels = torch.randn(2, 3, SIZE, SIZE), torch.tensor([0, 1])
    engine.train_step(images, labels)

    def predict() -> float:
        return planner.predict_step_time(layers, cfg, SIZE, 2, timer=LayerTimer("cpu", repeats=3), node=NODE,
                                         network=planner.Network()).seconds

    ratio, predicted, measured = fastest_ratio(predict, lambda: one_thread_seconds(
        lambda: engine.train_step(images, labels)))
    assert LOW <= ratio <= HIGH, (ratio, predicted, measured)


def test_a_swin_s_stages_on_a_tile_are_predicted_within_25_percent():
    """The embedding and the first two stages on tile 0 of 2x2 (windows gathered through a FakeComm, nothing
    delivered: the wire is costed apart): the planner's forward + backward against the spatialized stage's."""
    from mpi4dl_nb.comm.handles import Group
    from mpi4dl_nb.spatial.convert import spatialize

    layers = small("swin")
    cfg = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, balance=(3, 3))
    comm = FakeComm(0, None, torch.device("cpu"), world_size=4, sizes=SizeOracle(2, 2, frozenset({(SIZE, SIZE)})))
    stage = spatialize(nn.Sequential(*copy.deepcopy(layers[:3])), TileGrid(2, 2), comm, Group((0, 1, 2, 3)),
                       image_size=(SIZE, SIZE))
    tile = torch.randn(1, 3, SIZE // 2, SIZE // 2)

    def engine_step() -> None:
        stage(tile).sum().backward()

    engine_step()

    def predict() -> float:
        model = step_model(layers, cfg, SIZE, 1, timer=LayerTimer("cpu", repeats=3), node=NODE,
                           network=planner.Network())
        forward, _, backward, _ = model.costs.stage(0, 0)
        return forward + backward

    ratio, predicted, measured = fastest_ratio(predict, lambda: one_thread_seconds(engine_step))
    assert LOW <= ratio <= HIGH, (ratio, predicted, measured)
