"""The time model of ViT layers: one process's step and a ring member's stage against the engine measured in the same
run, both by the planner's clock (a thread's CPU seconds on one thread: another process's load does not move it;
shared caches and memory still may, and only ever add time: the fastest of up to five attempts on each side, as
bench_planner.py keeps the faster of two passes, or one attempt's back-to-back pair), and the ring's messages hidden
behind each step's block compute."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from mpi4dl_nb import ParallelConfig, planner
from mpi4dl_nb.comm.handles import Group
from mpi4dl_nb.planner.attention import exposed_ring_seconds
from mpi4dl_nb.planner.clock import work_clock
from mpi4dl_nb.planner.device import LayerTime
from mpi4dl_nb.planner.fake_world import FakeComm, FakeWorld, SizeOracle
from mpi4dl_nb.planner.layer_timer import LayerTimer
from mpi4dl_nb.planner.step_time import step_model
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.planner.recording import RecordingDevice, flops
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

NODE = planner.Node(cores=None, copy_bandwidth=1e10)
ATTEMPTS = 5


def cut_vit(size: int, depth: int = 1) -> list[nn.Module]:
    """A timm ViT-S/16 of ``depth`` blocks built for ``size`` px, cut as the engine cuts it (``token_pieces``)."""
    require_or_skip(missing_modules("timm"), "planner times of ViTs", MODELS_EXTRA)
    import timm

    from mpi4dl_nb.models.vit import token_pieces

    torch.manual_seed(0)
    return token_pieces(timm.create_model("vit_small_patch16_224", img_size=size, num_classes=2, depth=depth))


def one_thread_seconds(run: Callable[[], object], repeats: int = 5) -> float:
    """Fewest seconds of ``run`` over ``repeats`` on one torch thread, by the clock the planner's timer reads there
    (this thread's CPU seconds: ``planner.clock.work_clock``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        found = []
        for _ in range(repeats):
            start = work_clock("cpu")
            run()
            found.append(work_clock("cpu") - start)
        return min(found)
    finally:
        torch.set_num_threads(before)


def fastest_ratio(predict: Callable[[], float], measure: Callable[[], float]) -> tuple[float, list[float], list[float]]:
    """Prediction over measurement, attempts alternating until within 15% (at most ``ATTEMPTS``): the fastest of
    each side, or one attempt's pair (taken back to back, so under the same load: on a shared host the load moved
    both sides by 1.8x between attempts of one clean-clone run, and the fastest of each fell in different ones)."""
    predicted: list[float] = []
    measured: list[float] = []
    ratios: list[float] = []
    for _ in range(ATTEMPTS):
        predicted.append(predict())
        measured.append(measure())
        ratios += [min(predicted) / min(measured), predicted[-1] / measured[-1]]
        if any(abs(r - 1) < 0.15 for r in ratios):
            break
    return min(ratios, key=lambda r: abs(r - 1)), predicted, measured


def test_one_process_vit_step_time_within_15_percent_of_measured():
    """ViT-S/16 (patch embedding, one block, head) at 128 px, batch 2: the predicted step against the engine's."""
    from mpi4dl_nb.pipeline.engine import HybridEngine

    layers = cut_vit(128)
    cfg = ParallelConfig(split_size=1, spatial_size=0)
    engine = HybridEngine(layers, cfg, FakeWorld(1).comm(0, "cpu"), loss_fn=nn.CrossEntropyLoss(),
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), image_size=128)
    images, labels = torch.randn(2, 3, 128, 128), torch.tensor([0, 1])
    engine.train_step(images, labels)

    def predict() -> float:
        return planner.predict_step_time(layers, cfg, 128, 2, timer=LayerTimer("cpu", repeats=3), node=NODE,
                                         network=planner.Network()).seconds

    ratio, predicted, measured = fastest_ratio(predict, lambda: one_thread_seconds(
        lambda: engine.train_step(images, labels)))
    assert abs(ratio - 1) < 0.15, (predicted, measured)


def test_a_ring_member_s_stage_time_is_what_the_engine_computes_on_its_tile():
    """ViT-S/16 at 256 px on 1x2 tiles, the embedding and a block on the spatial stage: the planner's forward +
    backward of tile 0 (the ring member holding the class token; its block timed through spatial.ring_attention on
    a FakeComm ring) against the engine's spatialized stage on that tile, nothing delivered (the wire is costed
    apart), within 15%."""
    from mpi4dl_nb.spatial.convert import spatialize

    layers = cut_vit(256)
    cfg = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical", balance=(2, 1))
    comm = FakeComm(0, None, torch.device("cpu"), world_size=2,
                    sizes=SizeOracle(1, 2, frozenset({(256, 256), (16, 16)})))
    stage = spatialize(nn.Sequential(*copy.deepcopy(layers[:2])), TileGrid(1, 2), comm, Group((0, 1)),
                       image_size=(256, 256))
    tile = torch.randn(1, 3, 256, 128)

    def engine_step() -> None:
        stage(tile).sum().backward()

    engine_step()

    def predict() -> float:
        model = step_model(layers, cfg, 256, 1, timer=LayerTimer("cpu", repeats=3), node=NODE,
                           network=planner.Network())
        forward, _, backward, _ = model.costs.stage(0, 0)
        return forward + backward

    ratio, predicted, measured = fastest_ratio(predict, lambda: one_thread_seconds(engine_step))
    assert abs(ratio - 1) < 0.15, (predicted, measured)


class RingBlockDevice(RecordingDevice):
    """Layer times from sizes (``flops``), every layer's ring block taking ``block`` seconds."""

    block: float = 0.0

    def time_layers(self, pending, repeats, threads):
        return [LayerTime(flops(r).forward, flops(r).backward, ring_block=(self.block, self.block)) for r, _ in pending]


@pytest.mark.parametrize("block", [0.0, 1.0])
def test_ring_messages_hide_behind_each_step_s_block_compute(block):
    """1x4 tiles, two blocks on the spatial stage: forward, each block's 3 key/value messages cost what the wire
    takes beyond a block's attention (all of it with no compute, none behind a long one); backward, a key/value
    block and a gradient accumulator per step, and the accumulator's last hop after the last block."""
    layers = cut_vit(256, depth=2)
    cfg = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, slice_method="vertical", balance=(3, 1))
    device = RingBlockDevice()
    device.block = block
    network = planner.Network(latency=1e-3, bandwidth=1e9)
    model = step_model(layers, cfg, 256, 1, timer=LayerTimer(device), node=NODE, network=network)
    costs = model.costs
    _, forward_wire, _, backward_wire = costs.stage(0, 0)
    expected_forward = expected_backward = 0.0
    for index in (1, 2):
        fp = costs.layer_time(0, index, 0)[1]
        sent, received = fp.forward_traffic, fp.backward_traffic
        assert (sent.messages, received.messages) == (3, 6) and sent.message_bytes > 0   # 3 blocks, 3 hops
        expected_forward += exposed_ring_seconds(3, network.message(sent.message_bytes / 3), block)
        per = received.message_bytes / 6
        expected_backward += exposed_ring_seconds(3, network.message(2 * per), block, network.message(per))
    assert forward_wire == pytest.approx(expected_forward) and backward_wire == pytest.approx(expected_backward)
    assert (forward_wire == 0.0) == (block == 1.0) and backward_wire > 0.0
