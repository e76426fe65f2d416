"""swinunetr3d (models/swinunetr3d.py, models/swin3d.py): sizes and skips, a forward/backward, the shifted-window mask
and the block's token mixing against brute-force definitions, the refusals, the registration, its tile version on one
tile."""

import itertools

import pytest
import torch
from torch import nn

from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.models import ModelFamily, ModelSpec, build_model, image_multiple
from mpi4dl_nb.models.swin3d import MASKED, SwinBlock3d, fitted_window, partition, relative_index, reverse, shift_mask
from mpi4dl_nb.models.swinunetr3d import (
    SwinBottom,
    SwinInput,
    SwinLevel,
    SwinUp,
    check_windows,
    swinunetr3d,
    swinunetr3d_multiple,
)
from mpi4dl_nb.run.model_choice import ModelChoice
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.windows.swin3d import SpatialPatchMerge, SpatialWindowBlock


def test_layers_skips_and_output_sizes():
    torch.manual_seed(0)
    layers = swinunetr3d(2, 6, 3, in_channels=2)
    assert [type(layer) for layer in layers] == [SwinInput, SwinLevel, SwinLevel, SwinBottom, SwinUp, SwinUp, SwinUp,
                                                 nn.Conv3d]
    state = torch.randn(2, 2, 8, 16, 16)
    shapes = []
    for layer in layers[:4]:
        state = layer(state)
        shapes.append([tuple(t.shape) for t in state])
    assert shapes[-1] == [(2, 24, 1, 2, 2), (2, 6, 8, 16, 16), (2, 6, 4, 8, 8), (2, 12, 2, 4, 4)]
    for layer in layers[4:]:
        state = layer(state)
    assert state.shape == (2, 3, 8, 16, 16)
    heads = [block.attn.heads for level in layers[1:3] for block in level.stage.blocks]
    assert heads == [3, 3, 6, 6] and swinunetr3d_multiple(2) == 8 and swinunetr3d_multiple(4) == 32


def test_a_tiny_network_trains_every_parameter():
    torch.manual_seed(1)
    net = nn.Sequential(*swinunetr3d(1, 3, 2)).double()
    x = torch.randn(2, 1, 4, 8, 8, dtype=torch.float64)
    loss = nn.functional.cross_entropy(net(x), torch.randint(0, 2, (2, 4, 8, 8)))
    loss.backward()
    for name, p in net.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_partition_and_reverse_are_inverse():
    x = torch.randn(2, 4, 8, 6, 5)
    windows = partition(x, (2, 4, 3))
    assert windows.shape == (2 * 2 * 2 * 2, 24, 5)
    assert torch.equal(windows[1], x[0, 0:2, 0:4, 3:6].reshape(24, 5))   # the second window in raster order
    assert torch.equal(reverse(windows, (2, 4, 3), (4, 8, 6)), x)


@pytest.mark.parametrize("grid, window, shift", [((8, 8, 8), (4, 4, 4), (2, 2, 2)), ((6, 9, 4), (3, 3, 4),
                                                                                       (1, 1, 0))])
def test_the_shift_mask_keeps_apart_exactly_the_tokens_the_roll_wrapped(grid, window, shift):
    """Definition: two tokens of a rolled window attend each other iff, along every axis, they were as far apart in
    the grid before the roll as after it (the roll brought neither of them around from the other end)."""
    mask = shift_mask(grid, window, shift, torch.float64)
    coords = partition(torch.stack(torch.meshgrid(*(torch.arange(g) for g in grid), indexing="ij"), -1)[None],
                       window)                                             # rolled coordinates per window token
    p, q = coords[:, :, None, :], coords[:, None, :, :]                   # every pair of a window's tokens
    span, step = torch.tensor(grid), torch.tensor(shift)
    before = (p + step) % span - (q + step) % span
    together = (before == p - q).all(-1)
    assert torch.equal(mask, torch.where(together, 0.0, MASKED).to(torch.float64))
    assert (mask == MASKED).any()


def test_relative_index_names_each_offset_in_the_configured_table():
    index = relative_index((2, 3, 1), (4, 4, 4))                          # a window clipped to a short grid
    coords = list(itertools.product(range(2), range(3), range(1)))
    for (i, p), (j, q) in itertools.product(enumerate(coords), repeat=2):
        d, h, w = (a - b + 3 for a, b in zip(p, q))
        assert index[i, j] == (d * 7 + h) * 7 + w


def brute_force_mix(block: SwinBlock3d, tokens: torch.Tensor) -> torch.Tensor:
    """Every token attends the tokens of its (shifted) window, by coordinates: bias by offset, -100 across the wrap."""
    grid = tuple(tokens.shape[1:4])
    window, shift = fitted_window(grid, block.window, block.shifted)
    attn = block.attn
    n, c, heads = tokens.shape[0], tokens.shape[-1], attn.heads
    qkv = attn.qkv(tokens).reshape(n, *grid, 3, heads, c // heads)
    out = torch.zeros(n, *grid, heads, c // heads, dtype=tokens.dtype)
    positions = list(itertools.product(*(range(g) for g in grid)))
    for p in positions:
        rolled_p = [(a - s) % g for a, s, g in zip(p, shift, grid)]
        mates = [q for q in positions if all(((b - s) % g) // w == r // w for b, s, g, w, r in
                                             zip(q, shift, grid, window, rolled_p))]
        keys = torch.stack([qkv[:, q[0], q[1], q[2], 1] for q in mates], 1)     # (N, m, heads, hd)
        values = torch.stack([qkv[:, q[0], q[1], q[2], 2] for q in mates], 1)
        scores = torch.einsum("nhd,nmhd->nhm", qkv[:, p[0], p[1], p[2], 0] * attn.scale, keys)
        for m, q in enumerate(mates):
            rolled_q = [(b - s) % g for b, s, g in zip(q, shift, grid)]
            offset = [a - b for a, b in zip(rolled_p, rolled_q)]
            row = ((offset[0] + 3) * 7 + offset[1] + 3) * 7 + offset[2] + 3
            wrapped = offset != [a - b for a, b in zip(p, q)]
            scores[:, :, m] += attn.bias_table[row] + (MASKED if wrapped else 0.0)
        out[:, p[0], p[1], p[2]] = torch.einsum("nhm,nmhd->nhd", torch.softmax(scores, -1), values)
    return attn.proj(out.reshape(n, *grid, c))


@pytest.mark.parametrize("shifted", [False, True])
def test_a_block_mixes_tokens_as_windows_are_defined(shifted):
    torch.manual_seed(2)
    block = SwinBlock3d(6, 3, (4, 4, 4), shifted).double()
    tokens = torch.randn(2, 8, 4, 2, 6, dtype=torch.float64)    # depth cut in 2 windows (shifted by 2), rows and
    got = block.mix(tokens)                                     # columns one clipped window each (no shift)
    want = brute_force_mix(block, tokens)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert fitted_window((8, 4, 2), (4, 4, 4), shifted) == ((4, 4, 2), ((2, 0, 0) if shifted else (0, 0, 0)))


def test_sizes_that_do_not_cut_into_windows_and_feature_sizes_without_3_heads_are_refused():
    check_windows((8, 16, 16))
    check_windows((16, 64, 8))
    with pytest.raises(ValueError, match="a token grid of 6x8x8 is not cut into windows of 4x4x4"):
        check_windows((24, 32, 32), stages=2)                   # stage 0: 12 tokens deep, stage 1: 6
    with pytest.raises(ValueError, match="token grid of 10x4x4 is not cut into windows"):
        check_windows((40, 16, 16))
    with pytest.raises(ValueError, match="--num-filters 8 .* must be a multiple of 3"):
        swinunetr3d(2, 8)


def test_swinunetr3d_is_registered_with_small_defaults():
    layers = build_model("swinunetr3d", num_classes=2, in_channels=1, image_size=(8, 16, 16))
    assert len(layers) == 2 * 2 + 4 and layers[0].embed.out_channels == 12   # 2 stages, feature size 12
    assert image_multiple("swinunetr3d") == 8 and image_multiple("swinunetr3d", 3) == 16
    with pytest.raises(ValueError, match="every side must be a multiple of 8"):
        build_model("swinunetr3d", image_size=(8, 12, 16))
    with pytest.raises(ValueError, match="token grid of 2x6x6 is not cut into windows"):
        build_model("swinunetr3d", image_size=(8, 24, 24))
    spec = ModelSpec.of("swinunetr3d", num_classes=3, in_channels=1)
    family = ModelFamily.SWINUNETR3D
    assert family.dense and family.volumetric and not family.unet and ModelFamily.UNET3D.unet
    assert (spec.num_layers, spec.num_filters, spec.norm, spec.upsampling) == (2, 12, None, None)
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    assert spec.describe() == "swinunetr3d 2 Swin stages, feature size 12, 3 classes, 1 input channels"


@pytest.mark.parametrize("flag", ["norm", "upsampling"])
def test_u_net_layer_flags_are_refused_for_swinunetr3d(flag):
    with pytest.raises(ConfigError, match=f"--{flag}: sets a U-Net's layers; --model swinunetr3d has its own"):
        ModelChoice(model="swinunetr3d", **{flag: "group" if flag == "norm" else "transposed"})


class OneRank:
    """A world of one process (no MPI): collectives are the identity."""

    rank, world_size = 0, 1

    def all_reduce(self, t: torch.Tensor, group: object = None) -> torch.Tensor:
        return t


def test_on_one_tile_the_spatial_blocks_equal_the_model():
    """The window blocks and merges converted by spatialize (spatial/windows/swin3d.py: windows gathered to their owner,
    merged groups gathered) equal the serial model on a 1x1x1 grid; the multi-tile grids: tests/mpi/spatial3d.py."""
    torch.manual_seed(3)
    net = nn.Sequential(*swinunetr3d(2, 3, 2)).double()
    tiled = spatialize(net, TileGrid(depth=1, rows=1, cols=1), OneRank())
    assert isinstance(tiled[1].stage.blocks[1], SpatialWindowBlock) and isinstance(tiled[1].stage.blocks[1],
                                                                                    SwinBlock3d)
    assert isinstance(tiled[2].stage.merge, SpatialPatchMerge)
    x = torch.randn(1, 1, 16, 8, 16, dtype=torch.float64)
    torch.testing.assert_close(tiled(x), net(x), rtol=1e-12, atol=1e-12)


def test_infer_volume_runs_a_swinunetr3d_checkpoint_as_one_window_and_refuses_sides_it_cannot_take(tmp_path, capsys):
    """Every voxel depends on the whole volume (windows over the whole token grid, InstanceNorm3d): infer --volume
    runs the checkpoint as one window, equal to its forward over the whole volume; a volume whose sides the network
    cannot take is refused before work naming the sides that work (the 1- and 2-rank float64 runs:
    tests/mpi/volume_infer.py)."""
    import json

    import nibabel
    import numpy as np
    import tifffile

    import mpi4dl_nb as dl
    from mpi4dl_nb.checkpoint.record import DataRecord, RunRecord, write_checkpoint
    from mpi4dl_nb.cli import infer_cmd
    from mpi4dl_nb.comm.agreement import SetupFailed
    from mpi4dl_nb.data.apps import AppKind
    from mpi4dl_nb.data.task import Task

    torch.manual_seed(2)
    spec = ModelSpec.of("swinunetr3d", num_layers=1, num_filters=3, num_classes=2, in_channels=1)
    record = RunRecord(spec, DataRecord(AppKind.MEDICAL, 16, 2, "float32", classes=("0", "1")),
                       task=Task.SEGMENTATION)
    layers = spec.build()
    write_checkpoint(tmp_path / "ck", record.at(1, "a0b1c2d3e4f5"), nn.Sequential(*layers).state_dict(), None)
    vol = (np.random.default_rng(1).random((8, 16, 24)) * 255).astype(np.uint8)
    tifffile.imwrite(tmp_path / "vol.tif", vol)
    args = ["--checkpoint", str(tmp_path / "ck"), "--volume", str(tmp_path / "vol.tif"), "--no-progress"]
    assert infer_cmd.main([*args, "--output", str(tmp_path / "seg.nii"), "--dtype", "float64"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["windows"] == 1 and summary["window"] == [8, 16, 24]
    net = nn.Sequential(*[layer.double().eval() for layer in layers], nn.Softmax(dim=1))
    with torch.no_grad():
        want = net(torch.from_numpy(vol[None, None] / 255.0))[0].numpy()
    got = np.asarray(nibabel.load(str(tmp_path / "seg_prob1.nii")).dataobj).transpose(2, 1, 0)
    assert float(np.abs(got - want[1]).max()) < 1e-6           # float32 probabilities of a float64 run
    tifffile.imwrite(tmp_path / "odd.tif", np.zeros((8, 20, 16), np.uint8))
    code = infer_cmd.main(["--checkpoint", str(tmp_path / "ck"), "--volume", str(tmp_path / "odd.tif"),
                           "--output", str(tmp_path / "odd.tif.seg.tif"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "--volume: 8x20x16 voxels" in err and "height 20 (nearest that work: 16 or 24)" in err, err
    assert not (tmp_path / "odd.tif.seg.tif").exists()
    from PIL import Image

    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / "slide.png")
    assert infer_cmd.main(["--checkpoint", str(tmp_path / "ck"), "--slide", str(tmp_path / "slide.png"), "--output",
                           str(tmp_path / "map.png"), "--no-progress"]) == 2
    assert "holds a volume network (3-D layers); run it over a volume with --volume" in capsys.readouterr().err
    with pytest.raises(SetupFailed, match="--volume: 6x16x16 voxels: .* not depth 6 .nearest that work: 4 or 8."):
        dl.infer_volume(tmp_path / "ck", np.zeros((1, 6, 16, 16)), None)


def test_windows_inside_tiles_send_nothing_and_shifted_ones_gather_across_seams():
    """2x2x2 tiles of an 8^3 token grid, windows of 4: unshifted, every window is inside a tile (no message either
    way); shifted by 2, each window straddles tiles and is computed on one of them, every token counted once."""
    from mpi4dl_nb.spatial.layer import SpatialRuntime
    from mpi4dl_nb.spatial.windows.swin3d import volume_window_plan

    grid = TileGrid(depth=2, rows=2, cols=2)
    plans = {}
    for tile in range(8):
        world = type("World", (), {"rank": tile, "world_size": 8})()
        runtime = SpatialRuntime(grid, world)
        plans[tile] = (volume_window_plan(runtime, (8, 8, 8), (4, 4, 4), (0, 0, 0)),
                       volume_window_plan(runtime, (8, 8, 8), (4, 4, 4), (2, 2, 2)))
    assert all(plain.into.plan.is_local and plain.back.plan.is_local and plain.owned == 1 and plain.region_mask is None
               for plain, _ in plans.values())
    shifted = [plan for _, plan in plans.values()]
    assert sum(plan.owned for plan in shifted) == 8 and not all(plan.into.plan.is_local for plan in shifted)
    assert sum(plan.into.plan.tokens_received + len(plan.into.plan.own_targets) for plan in shifted) == 8 ** 3
    assert all(plan.region_mask is not None and plan.region_mask.labels.numel() == plan.owned * 64 for plan in shifted)
