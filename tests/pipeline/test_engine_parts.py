"""Single-process pieces of the engine: hand-off join/split, payload headers, BN replay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpi4dl_nb.comm.messages import decode_header, encode_header
from mpi4dl_nb.pipeline.bn_replay import RunningStatsLedger, merge_terms
from mpi4dl_nb.pipeline.handoff import input_tile, join_tiles, split_grad
from mpi4dl_nb.spatial.geometry import TileGrid


@pytest.mark.parametrize("shape,sizes", [((2, 2), (7, 9)), ((1, 4), (6, 10)), ((3, 1), (8, 5)),
                                         ((2, 2, 2), (5, 7, 9)), ((3, 2, 1), (7, 4, 5)), ((1, 1, 4), (3, 4, 9))])
def test_join_and_split_are_inverse_and_adjoint(shape, sizes):
    grid = TileGrid.of_shape(shape)   # images (rows, cols) and volumes (depth, rows, cols), uneven tiles
    full = torch.randn(2, 3, *sizes, dtype=torch.float64)
    pair = (full, full * 2)
    tiles = [input_tile(pair, grid, t) for t in range(grid.num_tiles)]
    joined, boxes = join_tiles(tiles, grid)
    assert torch.equal(joined[0], full) and torch.equal(joined[1], full * 2)
    # split_grad is the adjoint of join: <join(tiles), g> == sum_t <tile_t, split(g)_t>
    g = [torch.randn_like(full), torch.randn_like(full)]
    lhs = sum((j * gi).sum() for j, gi in zip(joined, g))
    rhs = sum((a * b).sum() for t in range(grid.num_tiles)
              for a, b in zip(tiles[t], split_grad(g, boxes, t)))
    assert torch.allclose(lhs, rhs, rtol=1e-12)


def test_volume_tiles_cut_images_and_label_volumes_on_their_last_three_dims():
    grid = TileGrid(depth=2, rows=1, cols=2)
    volumes, labels = torch.randn(2, 1, 5, 3, 4), torch.randint(0, 3, (2, 5, 3, 4))
    assert grid.extent(3, (5, 3, 4)) == ((3, 5), (0, 3), (2, 4))
    assert torch.equal(input_tile(volumes, grid, 3), volumes[..., 3:5, 0:3, 2:4])
    assert torch.equal(input_tile(labels, grid, 3, leading=1), labels[..., 3:5, 0:3, 2:4])
    assert torch.equal(input_tile(labels, grid, 3), labels)   # (N, D, H, W) as images: too few dims, whole
    with pytest.raises(ValueError, match="balanced tile split"):   # a tile of the wrong depth
        join_tiles([torch.zeros(1, 1, d, 3, 2) for d in (2, 3, 3, 3)], grid)


def test_join_takes_a_replicated_tensor_once_and_refuses_differing_copies_and_wrong_tiles():
    grid = TileGrid(1, 2)
    pooled = torch.randn(2, 5)
    joined, boxes = join_tiles([pooled, pooled.clone()], grid)
    assert torch.equal(joined, pooled) and boxes == [None]
    grad = torch.randn(2, 5)
    assert all(split_grad([grad], boxes, t)[0] is grad for t in range(2))   # whole to every tile
    with pytest.raises(ValueError, match="global pool"):
        join_tiles([torch.zeros(2, 5), torch.ones(2, 5)], grid)
    with pytest.raises(ValueError, match="balanced tile split"):
        join_tiles([torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 4)], grid)


def test_header_round_trip():
    payload = (torch.zeros(2, 3, 4, 5), torch.ones(7, dtype=torch.int64), torch.zeros((), dtype=torch.float16))
    tag, is_tuple, specs = decode_header(encode_header(payload, torch.device("cpu"), tag=7))
    assert tag == 7 and is_tuple and specs == [(torch.float32, (2, 3, 4, 5)), (torch.int64, (7,)),
                                  (torch.float16, ())]
    tag, single, specs = decode_header(encode_header(torch.zeros(3, dtype=torch.float64), torch.device("cpu")))
    assert tag == 0 and not single and specs == [(torch.float64, (3,))]
    with pytest.raises(TypeError, match="tensors"):
        encode_header((torch.zeros(1), None), torch.device("cpu"))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_stats_replay_equals_serial_order(momentum):
    torch.manual_seed(0)
    chunks = [torch.randn(3, 4, 5, 5, dtype=torch.float64) * (i + 1) + i for i in range(5)]
    serial = nn.BatchNorm2d(4, momentum=momentum).double()
    for x in chunks:
        serial(x)
    # two holders, each running some chunks in a scrambled order
    holders = [nn.BatchNorm2d(4, momentum=momentum).double() for _ in range(2)]
    ledgers = [RunningStatsLedger(h) for h in holders]
    for ledger in ledgers:
        ledger.begin_step()
    for holder, ledger, mine in zip(holders, ledgers, ([3, 0, 4], [2, 1])):
        for c in mine:
            with ledger.chunk(c):
                out = holder(chunks[c])
            out.sum().backward()            # autograd's saved tensors were not disturbed
    merged = merge_terms([ledger.terms for ledger in ledgers])
    for holder, ledger in zip(holders, ledgers):
        ledger.replay(merged)
        torch.testing.assert_close(holder.running_mean, serial.running_mean, rtol=1e-13, atol=0)
        torch.testing.assert_close(holder.running_var, serial.running_var, rtol=1e-13, atol=0)
        assert int(holder.num_batches_tracked) == int(serial.num_batches_tracked) == 5
    # control: replaying in the wrong order gives different statistics (momentum 0.1 case)
    if momentum is not None:
        backwards = {4 - c: t for c, t in merged.items()}
        ledgers[0].replay(backwards)
        assert not torch.allclose(holders[0].running_mean, serial.running_mean, rtol=1e-6)


def test_a_step_s_actions_read_no_device_value_into_python(monkeypatch):
    """The losses stay on the device until the step's end (on a GPU, a ``float()`` per micro-batch would wait for
    its kernels and stall the host's queue); their float64 sum is the loss ``train_step`` returns."""
    import mpi4dl_nb as dl
    from tests.support.models import build

    ctx = dl.init()
    torch.manual_seed(0)
    engine = dl.HybridEngine(build("resnet"), dl.ParallelConfig(split_size=1, spatial_size=0, parts=4,
                                                                schedule="1f1b"), ctx,
                             loss_fn=nn.CrossEntropyLoss(reduction="mean"))
    x, y = torch.randn(8, 3, 16, 16, dtype=torch.float64), torch.randint(0, 5, (8,))
    engine.train_step(x, y)                  # first step: buffers and caches made
    reads: list[str] = []

    def reading(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)
        return read

    for name in ("item", "__float__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, reading(name))
    engine.start_step(x, y)
    while engine.advance() is not None:
        pass
    assert reads == []
    losses = [float(loss) for loss in engine._started().state.losses]
    loss = engine.finish_step()
    assert len(losses) == 4 and loss == pytest.approx(sum(losses) / 4, rel=1e-12)


def test_the_engine_hands_the_heap_s_free_pages_back_every_n_steps():
    """``release_heap_every=N``: the N-th, 2N-th, ... finished steps release the heap's free pages (issue 54's
    soak: fragmentation kept RSS creeping with the bytes in use flat); None releases nothing."""
    import mpi4dl_nb as dl
    from tests.support.models import build

    ctx = dl.init()
    x, y = torch.randn(4, 3, 16, 16, dtype=torch.float64), torch.randint(0, 5, (4,))
    for every, wanted in ((2, [2, 4]), (None, [])):
        engine = dl.HybridEngine(build("resnet"), dl.ParallelConfig(split_size=1, spatial_size=0), ctx,
                                 loss_fn=nn.CrossEntropyLoss(), release_heap_every=every)
        at: list[int] = []

        def release(engine: dl.HybridEngine = engine, at: list[int] = at) -> bool:
            at.append(engine.heap.steps)
            return True

        engine.heap.release = release
        for _ in range(5):
            engine.train_step(x, y)
        assert at == wanted and engine.heap.releases == len(wanted)
    with pytest.raises(ValueError, match="release_heap_every=-1"):   # before any set-up: even a bad layout waits
        dl.HybridEngine(build("resnet"), dl.ParallelConfig(split_size=3, spatial_size=0), ctx,
                        loss_fn=nn.CrossEntropyLoss(), release_heap_every=-1)
