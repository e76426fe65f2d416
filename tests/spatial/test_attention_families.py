"""MaxViT's block and grid windows on tiles and EfficientViT's linear attention (issue 53).

Pure: the window plan moves every token to exactly one window slot, the windows it assembles are timm's
``window_partition`` / ``grid_partition`` (tiles simulated in one process), the way back returns every token, and
each tile attends at most 1.15/P of the windows where the lattice splits into the tiles. One process, four
simulated ranks on ``meta`` (``FakeWorld``): every timm model of the families is spatialized and run, and either
runs (the classes the MPI program checks exact) or is refused with a ConfigError naming its module. Under mpiexec
(tests/mpi/attention_families_exact.py, one 4-rank launch shared with other programs): ``maxvit_tiny_rw_224`` on
2x2 and 1x4, ``efficientvit_b0`` and ConvNeXt-V2's GRN on 2x2 equal one process in float64.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.windows.owners import PartitionKind, WindowPartition, partition_plan
from tests.mpi.attention_families_exact import check_names
from tests.support.battery import shared_job
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

MISSING = missing_modules("timm")
EXACT_JOB = None if MISSING else shared_job(4, "attention_families_exact", timeout=600)

PARTITIONS = [  # (kind, window or grid size, token grid, tile grid)
    (PartitionKind.BLOCK, (7, 7), (56, 56), (2, 2)), (PartitionKind.GRID, (7, 7), (56, 56), (2, 2)),
    (PartitionKind.BLOCK, (7, 7), (7, 7), (2, 2)), (PartitionKind.GRID, (7, 7), (14, 14), (2, 2)),
    (PartitionKind.BLOCK, (7, 7), (14, 14), (1, 4)), (PartitionKind.GRID, (2, 3), (6, 12), (3, 1)),
    (PartitionKind.BLOCK, (2, 3), (6, 12), (3, 2)),
]
IDS = [f"{k.value}{s[0]}x{s[1]}-on-{t[0]}x{t[1]}-tokens-{g[0]}x{g[1]}" for k, s, t, g in PARTITIONS]


def _moved(tiles: list[torch.Tensor], plans: list, back: bool = False) -> list[torch.Tensor]:
    """Every tile's ``(N, C)`` tokens moved as the plans say (the exchange, simulated in one process)."""
    moves = [plan.moves.reversed() if back else plan.moves for plan in plans]
    out = [tiles[0].new_full((m.size_out, tiles[0].shape[-1]), float("nan")) for m in moves]
    for source, m in enumerate(moves):
        for destination, index in m.take.items():
            out[destination][moves[destination].put[source]] = tiles[source][index]
    return out


def _tiles_of(image: torch.Tensor, grid: TileGrid) -> list[torch.Tensor]:
    height, width, channels = image.shape
    return [image[r0:r1, c0:c1].reshape(-1, channels) for r0, r1, c0, c1 in grid.tile_boxes(height, width)]


@pytest.mark.parametrize("kind,size,tokens,shape", PARTITIONS, ids=IDS)
def test_windows_assembled_on_tiles_are_timms_and_every_token_returns(kind, size, tokens, shape):
    pytest.importorskip("timm")
    from timm.models.maxxvit import grid_partition, window_partition

    grid = TileGrid(*shape)
    partition = WindowPartition(kind, size, tokens)
    plans = [partition_plan(partition, grid, tile) for tile in range(grid.num_tiles)]
    image = torch.randn(*tokens, 5, dtype=torch.float64)
    windows = _moved(_tiles_of(image, grid), plans)
    expected = (window_partition if kind is PartitionKind.BLOCK else grid_partition)(image[None], list(size))
    lattice = partition.lattice
    for tile, (r0, r1, c0, c1) in enumerate(grid.tile_boxes(*lattice)):
        mine = [i * lattice[1] + j for i in range(r0, r1) for j in range(c0, c1)]
        assert plans[tile].windows_here == len(mine)
        assert torch.equal(windows[tile].view(-1, *size, 5), expected[mine])
    assert [torch.equal(a, b) for a, b in zip(_moved(windows, plans, back=True), _tiles_of(image, grid))] == \
        [True] * grid.num_tiles


@pytest.mark.parametrize("tokens,expected", [((56, 56), [16, 16, 16, 16]), ((28, 28), [4, 4, 4, 4]),
                                             ((14, 14), [1, 1, 1, 1]), ((7, 7), [1, 0, 0, 0]),
                                             ((256, 256), [16 * 16] * 4)])
def test_grid_windows_spread_evenly_over_the_tiles(tokens, expected):
    """MaxViT at 224 px (token grids 56..7, 7 x 7 grids) and at 1024 px (stage 1: 256 x 256 tokens, 8 x 8 grids):
    each of 4 tiles attends 1/4 of the grid windows (its tokens' worth), except a last stage of one window."""
    grid = TileGrid(2, 2)
    size = (8, 8) if tokens[0] == 256 else (7, 7)
    plans = [partition_plan(WindowPartition(PartitionKind.GRID, size, tokens), grid, t) for t in range(4)]
    assert [p.windows_here for p in plans] == expected
    total = tokens[0] * tokens[1]
    if len(set(expected)) == 1:
        assert max(p.moves.size_out for p in plans) <= 1.15 * total / 4


def test_block_windows_inside_tiles_stay_there():
    grid = TileGrid(2, 2)
    plan = partition_plan(WindowPartition(PartitionKind.BLOCK, (7, 7), (28, 28)), grid, 1)
    assert [int(index.numel()) for t, index in sorted(plan.moves.take.items()) if t != 1] == [0, 0, 0]
    assert plan.moves.take[1].numel() == 14 * 14 == plan.moves.size_out


def test_a_grid_that_does_not_split_into_windows_is_not_fit():
    assert not WindowPartition(PartitionKind.GRID, (7, 7), (15, 14)).fits()
    assert WindowPartition(PartitionKind.BLOCK, (7, 7), (14, 21)).fits()


# ------------------------------------------------------------------ every timm model of the families
FAMILIES = ("coatnet*", "coatnext*", "maxvit*", "maxxvit*", "efficientvit*", "levit*")
FULL_SWEEP = os.environ.get("MPI4DL_FAMILY_SWEEP") == "1"   # every model timm lists (minutes); else one per variant
NAMED = re.compile(r"layer '[^']+' \(\w+[,)]")   # the module's name and class (and the knob: "(Dropout, p=...)")
# one model per variant of the families (the others differ in widths and depths only): what it does on 2x2 tiles
VARIANTS = {
    "coatnet_nano_rw_224": "layer 'stages.2.blocks.0.attn' (Attention2d)",
    "coatnet_0_224": "layer 'stages.2.blocks.0.attn' (Attention2d)",
    "coatnet_bn_0_rw_224": "layer 'stages.2.blocks.0.attn' (Attention2d)",
    "coatnet_rmlp_nano_rw_224": "layer 'stages.2.blocks.0.attn' (Attention2d)",
    "coatnext_nano_rw_224": "layer 'stages.2.blocks.0.attn' (Attention2d)",
    "maxvit_pico_rw_256": "ran",
    "maxvit_rmlp_pico_rw_256": "layer 'stages.0.blocks.0.attn_block.attn.rel_pos.mlp.drop1' (Dropout, p=0.125)",
    "maxvit_tiny_tf_224": "layer 'stages.0.blocks.0.conv.shortcut.pool' (AvgPool2dSame)",
    "maxvit_tiny_pm_256": "layer 'stages.0.blocks.0.attn' (ParallelPartitionAttention)",
    "maxxvit_rmlp_nano_rw_256": "layer 'stages.0.blocks.0.attn_block.attn.rel_pos.mlp.drop1' (Dropout, p=0.125)",
    "maxxvitv2_nano_rw_256": "ran",
    "efficientvit_b0": "ran",
    "efficientvit_l1": "ran",
    "efficientvit_m0": "layer 'head.bn' (BatchNorm1d)",
    "levit_128": "layer 'stages.0.blocks.0.attn.qkv.bn' (BatchNorm1d)",
    "levit_conv_128": "layer 'head.bn' (BatchNorm1d)",
}
# the variants that run on tiles, each checked exact under MPI (tests/mpi/attention_families_exact.py)
EXACT_VARIANTS = re.compile(r"maxvit_(rmlp_)?\w+_rw_\d+|maxxvitv2_(rmlp_)?\w+_rw_\d+|efficientvit_[bl]\d")


def _family_models() -> list[str]:
    import timm

    return sorted({name for pattern in FAMILIES for name in timm.list_models(pattern)})


def _short_stages(name: str) -> dict[str, object]:
    """The depth keywords that build ``name`` with one or two blocks per stage (every block class it has, built
    faster; CoAtNet-cc alternates conv and transformer blocks within a stage)."""
    family, variant = name.split("_")[:2]
    if family == "levit" or (family == "efficientvit" and variant.startswith("m")):
        return {"depth": (1, 1, 1)}
    if family == "efficientvit":
        return {"depths": (1,) * (5 if variant.startswith("l") else 4)}
    return {"depths": (2, 2, 2, 2)}


def _on_simulated_tiles(name: str) -> str:
    """``name`` spatialized on 2x2 simulated ranks (meta tensors) and run at its own input size: 'ran' or the
    refusal's message."""
    import timm

    from mpi4dl_nb.errors import ConfigError
    from mpi4dl_nb.planner.fake_world import FakeWorld, run_ranks
    from mpi4dl_nb.spatial.convert import spatialize

    world, grid = FakeWorld(4), TileGrid(2, 2)
    size = int(timm.get_pretrained_cfg(name).input_size[-1])

    with torch.device("meta"):   # one model the ranks share (spatialize copies the containers, shares the rest)
        model = timm.create_model(name, pretrained=False, num_classes=10, **_short_stages(name))

    def body(rank: int) -> None:
        net = spatialize(model, grid, world.comm(rank))
        net(torch.empty(1, 3, size // 2, size // 2, device="meta"))

    try:
        run_ranks(world, body)
    except ConfigError as error:   # the first rank's refusal (the others stopped with it)
        return str(error)
    return "ran"


def test_each_variant_of_the_families_runs_or_is_refused_naming_its_module():
    require_or_skip(MISSING, "the timm model families", MODELS_EXTRA)
    outcomes = {name: _on_simulated_tiles(name) for name in VARIANTS}
    assert {name: VARIANTS[name] for name, outcome in outcomes.items() if VARIANTS[name] not in outcome} == {}
    assert all(EXACT_VARIANTS.fullmatch(name) for name, outcome in outcomes.items() if outcome == "ran")


@pytest.mark.skipif(not FULL_SWEEP, reason="every timm model of the families takes minutes: MPI4DL_FAMILY_SWEEP=1")
def test_every_model_of_the_families_runs_or_is_refused_naming_its_module():
    outcomes = {name: _on_simulated_tiles(name) for name in _family_models()}
    assert {name for name, outcome in outcomes.items() if outcome == "ran" and not EXACT_VARIANTS.fullmatch(name)} \
        == set()
    assert {name: outcome[:200] for name, outcome in outcomes.items() if outcome != "ran" and
            not NAMED.search(outcome)} == {}


def test_maxvit_and_efficientvit_equal_one_process_on_tiles(shared_launch):
    require_or_skip(MISSING, "MaxViT and EfficientViT on tiles", MODELS_EXTRA)
    assert EXACT_JOB is not None
    shared_launch(EXACT_JOB).require(check_names())
