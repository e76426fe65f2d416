"""The count of windowed attention's exchanges (spatial/windows/traffic.py) against the geometry's plans.

Pure counts (interval overlaps) equal what ``spatial/windows/plan.py``'s gathers move, tile by tile (tokens x channels x
bytes): Swin-T's stage 1 at 224 and 1024 px on 2x2 tiles, unshifted and shifted, its merges (odd grids on 1x4), a
3-D grid. At 1024 px a shifted block sends, forward and backward, under 5% of a tile's activations (issue 53's
bound; the block's activations counted by ``LiveBytes`` on ``meta``, one process's over the 4 tiles). A Swin-T forward
spatialized on 4 simulated ranks (``FakeWorld``) sends what the planner counts, and ``swin_cost`` of the model is
its stages' sum. MaxViT's partition moves equal ``owners.partition_plan``'s; the ring's and LiteMLA's costs. About 15 s
of CPU.
"""

from __future__ import annotations

import pytest

from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.windows.plan import ShiftedWindows, TokenBoxes, WindowLayout, plan_merge
from mpi4dl_nb.spatial.windows.traffic import (
    block_traffic,
    merge_traffic,
    partition_cost,
    partition_moves,
    stage_traffic,
    swin_cost,
    swin_stages,
)
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

CHANNELS, FLOAT32 = 96, 4   # Swin-T's stage 1
TOKEN = CHANNELS * FLOAT32
BLOCKS = [  # tile grid, token grid, window, shift
    ((2, 2), (56, 56), (7, 7), (0, 0)), ((2, 2), (56, 56), (7, 7), (3, 3)),
    ((2, 2), (256, 256), (7, 7), (0, 0)), ((2, 2), (256, 256), (7, 7), (3, 3)),
    ((1, 4), (7, 7), (7, 7), (0, 0)), ((2, 1, 2), (6, 5, 7), (3, 3, 3), (1, 1, 2)),
]
IDS = [f"{'x'.join(map(str, g))}-tokens-{'x'.join(map(str, n))}-shift-{s[0]}" for g, n, _, s in BLOCKS]


@pytest.mark.parametrize("shape,sizes,window,shift", BLOCKS, ids=IDS)
def test_block_bytes_are_what_the_window_gathers_move(shape, sizes, window, shift):
    grid = TileGrid(*shape)
    counted = block_traffic(grid, sizes, window, shift, CHANNELS, FLOAT32)
    layout = WindowLayout(ShiftedWindows(sizes, window, shift), TokenBoxes(grid, sizes))
    planned = [(g.tokens_sent * TOKEN, g.tokens_received * TOKEN) for g in layout.into_windows()]
    returned = [(g.tokens_sent * TOKEN, g.tokens_received * TOKEN) for g in layout.out_of_windows()]
    assert [(t.sent, t.received) for t in counted.into] == planned
    assert [(t.sent, t.received) for t in counted.back] == returned
    assert [t.held for t in counted.into] == [g.size * TOKEN for g in layout.into_windows()]
    assert [counted.sent_backward(t) for t in range(grid.num_tiles)] == \
        [(into[1] + back[1]) for into, back in zip(planned, returned)]


def test_windows_inside_tiles_send_nothing_and_straddling_ones_do():
    grid = TileGrid(2, 2)
    inside = block_traffic(grid, (56, 56), (7, 7), (0, 0), CHANNELS, FLOAT32)   # 28 = 4 windows per tile
    assert [inside.sent_forward(t) for t in range(4)] == [0, 0, 0, 0]
    assert inside.largest_held() == 28 * 28 * TOKEN
    shifted = block_traffic(grid, (56, 56), (7, 7), (3, 3), CHANNELS, FLOAT32)
    assert min(shifted.sent_forward(t) for t in range(4)) > 0


@pytest.mark.parametrize("shape,sizes", [((2, 2), (56, 56)), ((2, 2), (14, 14)), ((1, 4), (14, 14)),
                                         ((1, 4), (28, 28)), ((2, 2), (7, 9)), ((2, 1, 2), (5, 6, 7))])
def test_merge_bytes_are_what_the_merge_gather_moves(shape, sizes):
    grid = TileGrid(*shape)
    counted = merge_traffic(grid, sizes, CHANNELS, FLOAT32)
    planned = plan_merge(TokenBoxes(grid, sizes))
    assert [(t.sent, t.received, t.held) for t in counted] == \
        [(g.tokens_sent * TOKEN, g.tokens_received * TOKEN, g.size * TOKEN) for g in planned]


def test_swin_stages_are_timms_blocks():
    """Swin-T at 224 and 448 px: every block's grid, window, shift and width as timm builds them."""
    pytest.importorskip("timm")
    import timm
    import torch

    for size in (224, 448):
        with torch.device("meta"):
            model = timm.create_model("swin_tiny_patch4_window7_224", img_size=size)
        stages = swin_stages((size // 4, size // 4), (2, 2, 6, 2), (96, 192, 384, 768), 7)
        built = [[(tuple(b.input_resolution), tuple(b.window_size), tuple(b.shift_size), b.dim)
                  for b in layer.blocks] for layer in model.layers]
        expected = [[(s.sizes, s.window, (0, 0) if i % 2 == 0 else s.shift, s.channels) for i in range(s.depth)]
                    for s in stages]
        assert built == expected
        assert [(s.merged_from, s.merged_channels) for s in stages] == [(None, 0)] + [
            (tuple(layer.input_resolution), layer.dim) for layer in model.layers[1:]]


def test_a_shifted_block_at_1024_px_sends_under_5_percent_of_a_tiles_activations():
    require_or_skip(missing_modules("timm"), "timm's Swin block", MODELS_EXTRA)
    import torch
    from timm.models.swin_transformer import SwinTransformerBlock

    from mpi4dl_nb.planner.live_bytes import LiveBytes

    with torch.device("meta"):
        block = SwinTransformerBlock(CHANNELS, (256, 256), num_heads=3, window_size=7, shift_size=3)
        x = torch.empty(1, 256, 256, CHANNELS, requires_grad=True)
    with LiveBytes() as live:
        out = block(x)
        tile_activations = live.current / 4   # the output and what the block saves for backward
        del out
    stage = swin_stages((256, 256), (2,), (CHANNELS,), 7)[0]
    traffic = stage_traffic(TileGrid(2, 2), stage, FLOAT32)
    shifted = traffic.blocks[1]
    sent = max(shifted.sent_forward(t) + shifted.sent_backward(t) for t in range(4))
    assert 0 < sent < 0.05 * tile_activations
    assert traffic.blocks[0] != shifted and traffic.merge == ()


@pytest.mark.parametrize("shape", [(2, 2), (1, 4)])
def test_a_swin_forward_on_simulated_tiles_sends_what_the_planner_counts(shape):
    """Swin-T (two blocks a stage) spatialized on 4 simulated ranks at 224 px (stage 4 one window over all tiles,
    merges straddling tiles): every rank's point-to-point bytes (``FakeWorld``) are the planner's forward sum."""
    require_or_skip(missing_modules("timm"), "timm's Swin", MODELS_EXTRA)
    import timm
    import torch

    from mpi4dl_nb.planner.fake_world import FakeWorld, run_ranks
    from mpi4dl_nb.spatial.convert import spatialize

    world, grid, depths = FakeWorld(4), TileGrid(*shape), (2, 2, 2, 2)
    with torch.device("meta"):
        model = timm.create_model("swin_tiny_patch4_window7_224", num_classes=10, depths=depths)
    comms = [world.comm(rank) for rank in range(4)]

    def body(rank: int) -> None:
        tile = grid.tile_of_size(rank, 224, 224)
        spatialize(model, grid, comms[rank])(torch.empty(1, 3, *tile, device="meta"))

    run_ranks(world, body)
    stages = [stage_traffic(grid, stage, FLOAT32) for stage in swin_stages((56, 56), depths, (96, 192, 384, 768), 7)]
    assert [comm.traffic.message_bytes for comm in comms] == \
        [sum(stage.sent_forward(tile) for stage in stages) for tile in range(4)]
    sent = [comm.traffic.message_bytes for comm in comms]
    model_cost = swin_cost(model, grid, (224, 224), FLOAT32)   # each exchange's busiest tile, summed
    assert max(sent) <= model_cost.sent <= sum(sent)


PARTITIONS = [((2, 2), (16, 16), (4, 4), True), ((2, 2), (16, 16), (4, 4), False), ((1, 4), (8, 8), (2, 2), True),
              ((1, 4), (8, 8), (2, 2), False), ((2, 2), (7, 7), (7, 7), True), ((2, 1), (12, 6), (3, 2), False)]


@pytest.mark.parametrize("shape,sizes,size,block", PARTITIONS)
def test_partition_moves_are_the_partition_plans(shape, sizes, size, block):
    from mpi4dl_nb.spatial.windows.owners import PartitionKind, WindowPartition, partition_plan

    grid = TileGrid(*shape)
    partition = WindowPartition(PartitionKind.BLOCK if block else PartitionKind.GRID, size, sizes)
    plans = [partition_plan(partition, grid, tile) for tile in range(grid.num_tiles)]
    sent, received, held = partition_moves(grid, sizes, size, block)
    assert sent == [sum(int(v.numel()) for t, v in plan.moves.take.items() if t != plan.moves.tile) for plan in plans]
    assert received == [sum(int(v.numel()) for t, v in plan.moves.put.items() if t != plan.moves.tile)
                        for plan in plans]
    assert held == [plan.moves.size_out for plan in plans]


def test_partition_cost_of_maxvit_blocks():
    """Block windows inside tiles move nothing; grid windows move most tokens, there and back."""
    require_or_skip(missing_modules("timm"), "timm's MaxViT", MODELS_EXTRA)
    from timm.models.maxxvit import MaxxVitTransformerCfg, PartitionAttentionCl

    cfg = MaxxVitTransformerCfg(window_size=(4, 4), grid_size=(4, 4))
    block, grid_attention = (PartitionAttentionCl(32, kind, cfg) for kind in ("block", "grid"))
    tiles = TileGrid(2, 2)
    assert partition_cost(block, tiles, (16, 16), FLOAT32).sent == 0
    assert partition_cost(block, tiles, (16, 16), FLOAT32).held == 64 * 32 * FLOAT32
    moved = partition_cost(grid_attention, tiles, (16, 16), FLOAT32)
    assert moved.sent == moved.received == 2 * 48 * 32 * FLOAT32   # 3/4 of a tile's 64 tokens, there and back
    assert partition_cost(grid_attention, TileGrid(1, 1), (16, 16), FLOAT32).sent == 0


def test_linear_cost_is_one_all_reduce_of_the_key_value_sums():
    require_or_skip(missing_modules("timm"), "timm's LiteMLA", MODELS_EXTRA)
    from timm.models.efficientvit_mit import LiteMLA

    from mpi4dl_nb.spatial.windows.linear import linear_cost

    attention = LiteMLA(64, 64, dim=16, scales=(5,))   # 4 heads, 2 scales
    sums = 8 * 16 * 17 * 4   # float32 or wider
    assert linear_cost(attention, TileGrid(2, 2), (14, 14), 8).held == 8 * 16 * 17 * 8
    cost = linear_cost(attention, TileGrid(2, 2), (14, 14), FLOAT32)
    assert (cost.sent, cost.received, cost.held) == (3 * sums // 2, 3 * sums // 2, sums)
    assert linear_cost(attention, TileGrid(1, 1), (14, 14), FLOAT32).sent == 0


def test_ring_cost_is_the_ring_schedules_traffic():
    require_or_skip(missing_modules("timm"), "timm's ViT attention", MODELS_EXTRA)
    from timm.models.vision_transformer import Attention

    from mpi4dl_nb.planner.attention import ring_cost as planner_ring_cost
    from mpi4dl_nb.spatial.tokens.traffic import attention_ring_cost, member_tokens

    attention = Attention(96, num_heads=4)
    grid = TileGrid(2, 2)
    tokens = member_tokens(grid, (7, 9))
    assert tokens == (20, 16, 15, 12)
    cost = attention_ring_cost(attention, grid, (7, 9), FLOAT32)
    members = [planner_ring_cost(tokens, m, 96, 4, FLOAT32) for m in range(4)]
    assert cost.sent == max(m.sent_forward for m in members)
    assert cost.held == max(m.in_flight_forward for m in members)
    assert cost.received == cost.sent   # each member receives what its predecessor passes on: same totals
    assert attention_ring_cost(attention, TileGrid(1, 1), (7, 9), FLOAT32).sent == 0
