"""Volumes on 3-D tile grids: the three-phase halo exchange (forward = slicing the padded volume, edges and
corners included; <Fx, y> = <x, F*y>; message counts as the geometry says) and every 3-D layer (Conv3d
kernels 1/3/5 strides 1/2, MaxPool3d / AvgPool3d ceil_mode both ways, BatchNorm3d, GroupNorm, InstanceNorm3d,
ConvTranspose3d, Upsample nearest/trilinear with align_corners both ways, adaptive avg/max pools to 1,
dropout and dropout3d with the serial mask, functional norms in a custom forward), two small 3-D
networks and ``swinunetr3d`` (shifted windows across tile seams, patch merging; on 2x2x2, 1x1x4 and 4x1x1), float64,
equal to one process within 1e-10: output, input gradient, every parameter gradient and buffer.

Usage (8 ranks, one launch): python -m tests.mpi.spatial3d. Grids: 2x2x2 on all ranks, the uneven 3x2x1 on
ranks 0-5, 1x1x4 on ranks 0-3 while 4x1x1 runs on ranks 4-7 (both at once). The halo is checked on the
``mpi`` and ``gloo`` planes on 2x2x2, the layers on ``mpi``. Named checks: ``check_names()``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.models.swinunetr3d import swinunetr3d
from mpi4dl_nb.spatial.geometry import KernelAxis, LayerHalo, TileGrid
from mpi4dl_nb.spatial.halo import HaloExchange
from tests.support.checks import Checks, run_checks
from tests.support.exactness import check_spatial_exact

WORLD = 8
# grid (depth, rows, cols) -> its ranks; grids in the same step run at once on disjoint ranks
STEPS: list[list[tuple[tuple[int, int, int], list[int]]]] = [
    [((2, 2, 2), list(range(8)))],
    [((3, 2, 1), list(range(6)))],
    [((1, 1, 4), list(range(4))), ((4, 1, 1), list(range(4, 8)))],
]
SIZES = (12, 11, 13)   # the volume (D, H, W): uneven on every grid here
STACK_SIZES = (16, 12, 16)   # the conv stack's input: its smallest activation still has 4 positions per axis
DECODER_SIZES = (12, 8, 10)   # even (the decoder's up path restores the size)
HALOS = [(3, 1, 1), (5, 2, 2), (1, 2, 0), (2, 2, 0)]   # (kernel, stride, padding) on every axis
PLANES = {(2, 2, 2): ("mpi", "gloo")}
# grid -> the volume swinunetr3d (2 stages, feature size 6) runs on there. 2x2x2: windows of 4 (shifted by 2) over
# 8^3 tokens, each unshifted window inside a tile, then one window over all tiles; 1x1x4: 24 then 12 columns of
# tokens (tiles of 6 and 3: shifted windows straddle seams, the second merge gathers groups across tiles); 4x1x1: the
# same along the depth
SWIN_SIZES = {(2, 2, 2): (16, 16, 16), (1, 1, 4): (8, 8, 48), (4, 1, 1): (48, 8, 8)}


def layers() -> dict[str, nn.Module]:
    """Every 3-D layer case, float64 (seeded, so equal on every rank)."""
    torch.manual_seed(5)
    cases: dict[str, nn.Module] = {}
    for kernel in (1, 3, 5):
        for stride in (1, 2):
            cases[f"Conv3d k{kernel} s{stride}"] = nn.Conv3d(2, 3, kernel, stride, kernel // 2)
    cases["Conv3d (3,1,3) s(1,2,1) dilation 2 groups 2"] = nn.Conv3d(2, 4, (3, 1, 3), (1, 2, 1), (2, 0, 2), 2, 2)
    cases["Conv3d 'same' k4 no bias"] = nn.Conv3d(2, 2, 4, padding="same", bias=False)
    for ceil in (False, True):
        cases[f"MaxPool3d k3 s2 p1 ceil={ceil}"] = nn.MaxPool3d(3, 2, 1, ceil_mode=ceil)
        cases[f"MaxPool3d k2 ceil={ceil}"] = nn.MaxPool3d(2, ceil_mode=ceil)
        cases[f"AvgPool3d k3 s2 p1 ceil={ceil}"] = nn.AvgPool3d(3, 2, 1, ceil_mode=ceil)
        cases[f"AvgPool3d k3 s2 p1 ceil={ceil} no pad count"] = nn.AvgPool3d(3, 2, 1, ceil_mode=ceil,
                                                                             count_include_pad=False)
        cases[f"AvgPool3d k2 ceil={ceil}"] = nn.AvgPool3d(2, ceil_mode=ceil)
        for pool in (nn.MaxPool3d, nn.AvgPool3d):   # kernels 1 and 5 (3 above), strides 2 and 1
            cases[f"{pool.__name__} k1 s2 ceil={ceil}"] = pool(1, 2, ceil_mode=ceil)
            cases[f"{pool.__name__} k5 s2 p2 ceil={ceil}"] = pool(5, 2, 2, ceil_mode=ceil)
            cases[f"{pool.__name__} k3 s1 p1 ceil={ceil}"] = pool(3, 1, 1, ceil_mode=ceil)
    cases["AvgPool3d k3 s1 divisor 5"] = nn.AvgPool3d(3, 1, 1, divisor_override=5)
    cases["BatchNorm3d"] = nn.BatchNorm3d(2)
    cases["GroupNorm 2 groups"] = nn.GroupNorm(2, 2)
    cases["GroupNorm 1 group no affine"] = nn.GroupNorm(1, 2, affine=False)
    cases["InstanceNorm3d"] = nn.InstanceNorm3d(2)
    cases["InstanceNorm3d affine running stats"] = nn.InstanceNorm3d(2, affine=True, track_running_stats=True)
    for kernel in (1, 3, 5):
        for stride in (1, 2):
            cases[f"ConvTranspose3d k{kernel} s{stride} p{kernel // 2} output_padding {stride - 1}"] = \
                nn.ConvTranspose3d(2, 3, kernel, stride, kernel // 2, stride - 1, bias=kernel != 5)
    cases["ConvTranspose3d k2 s2"] = nn.ConvTranspose3d(2, 3, 2, 2)
    cases["ConvTranspose3d (3,1,5) s(2,1,2) p(1,0,2) op(1,0,0) groups 2"] = nn.ConvTranspose3d(
        2, 4, (3, 1, 5), (2, 1, 2), (1, 0, 2), (1, 0, 0), groups=2)
    cases["Upsample nearest x2"] = nn.Upsample(scale_factor=2)
    cases["Upsample nearest size"] = nn.Upsample(size=(17, 15, 20))
    cases["Upsample nearest-exact x(1.5,2,2.5)"] = nn.Upsample(scale_factor=(1.5, 2, 2.5), mode="nearest-exact")
    for corners in (False, True):
        cases[f"Upsample trilinear x2 align_corners={corners}"] = nn.Upsample(
            scale_factor=2, mode="trilinear", align_corners=corners)
        cases[f"Upsample trilinear size align_corners={corners}"] = nn.Upsample(
            size=(19, 14, 21), mode="trilinear", align_corners=corners)
    cases["AdaptiveAvgPool3d(1)"] = nn.AdaptiveAvgPool3d(1)
    cases["AdaptiveMaxPool3d((1,1,1))"] = nn.AdaptiveMaxPool3d((1, 1, 1))
    cases["functional norms (F.group_norm, F.instance_norm, F.batch_norm, F.prelu)"] = FunctionalNorms(2)
    cases["Dropout p0.3"] = nn.Dropout(0.3)
    cases["Dropout3d p0.5"] = nn.Dropout3d(0.5)
    return {name: layer.double() for name, layer in cases.items()}


class Residual(nn.Module):
    """A custom forward: a residual add on tiles (the guard checks it in 3-D)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv3d(channels, channels, 3, padding=1, bias=False)   # (a bias before BN: gradient 0)
        self.bn = nn.BatchNorm3d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn(self.conv(x)))


class FunctionalNorms(nn.Module):
    """Norms called in a custom forward on volume tiles (as timm's BatchNormAct does on images)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(channels) + 0.5)
        self.bias = nn.Parameter(torch.randn(channels))
        self.slope = nn.Parameter(torch.full((channels,), 0.2))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.group_norm(x, 2, self.weight, self.bias)
        x = F.instance_norm(x * x, weight=self.weight)
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, 0.3)
        return F.prelu(x, self.slope)


class SkipDecoder(nn.Module):
    """A U-Net's decoder level in 3-D: transposed conv up, concatenated with the skip, GroupNorm, dropout;
    a trilinear upsampling branch added; a global pool head."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Sequential(nn.Conv3d(2, 4, 3, 2, 1), nn.InstanceNorm3d(4, affine=True), nn.ReLU())
        self.up = nn.ConvTranspose3d(4, 2, 2, 2)
        self.resample = nn.Upsample(scale_factor=2, mode="trilinear", align_corners=False)
        self.squeeze = nn.Conv3d(4, 2, 1)
        self.mix = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Dropout(0.2))
        self.head = nn.Sequential(nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = self.down(x)
        up = self.up(low) + self.resample(self.squeeze(low))
        return self.head(self.mix(torch.cat([x, up], dim=1)))


def conv_stack() -> nn.Module:
    """A small 3-D network: conv, BN, ReLU, ceil-mode max pool, residual block, strided conv, avg pool."""
    torch.manual_seed(9)
    return nn.Sequential(nn.Conv3d(2, 4, 3, padding=1, bias=False), nn.BatchNorm3d(4), nn.ReLU(),
                         nn.MaxPool3d(3, 2, 1, ceil_mode=True), Residual(4),
                         nn.Conv3d(4, 3, 3, stride=2, padding=1), nn.AvgPool3d(3, 1, 1)).double()


def grid_name(shape: tuple[int, int, int]) -> str:
    return "x".join(map(str, shape))


def check_names() -> list[str]:
    names = []
    for step in STEPS:
        for shape, _ in step:
            for plane in PLANES.get(shape, ("mpi",)):
                names += [f"{grid_name(shape)} {plane}: halo k{k} s{s} p{p}" for k, s, p in HALOS]
            names += [f"{grid_name(shape)}: {name}" for name in layers()]
            names.append(f"{grid_name(shape)}: conv stack")
            names.append(f"{grid_name(shape)}: skip decoder")
            if shape in SWIN_SIZES:
                names.append(f"{grid_name(shape)}: swinunetr3d")
    return names


def check_halo(ctx: Context, grid: TileGrid, group, ranks: list[int], tile: int, spec: tuple[int, int, int]) -> None:
    kernel, stride, padding = spec
    geometry = LayerHalo.for_axis_windows(grid, SIZES, [KernelAxis(kernel, stride, 1, padding, padding)] * 3,
                                          name=f"k{kernel}s{stride}p{padding}")
    exchange = HaloExchange(geometry, tile, ranks, ctx, pad_value=0.0)
    full = torch.randn(2, 3, *SIZES, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    view = geometry.tile(tile)
    owned = tuple(slice(*r) for r in view.owned_extent)
    x = full[(Ellipsis, *owned)].clone().requires_grad_(True)
    y = exchange(x)
    padded = F.pad(full, (padding,) * 6)
    needed = tuple(slice(a + padding, b + padding) for a, b in view.needed_extent)
    assert torch.equal(y.detach(), padded[(Ellipsis, *needed)]), f"rank {ctx.rank}: forward values"
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(100 + tile), dtype=torch.float64)
    sent = exchange.messages_sent
    y.backward(w)
    both = torch.stack([(y.detach() * w).sum(), (x.detach() * x.grad).sum()])
    ctx.all_reduce(both, group=group)
    assert abs(both[0] - both[1]) <= 1e-12 * abs(both[0]), f"adjoint: {both[0].item()} vs {both[1].item()}"
    mine = [m for m in geometry.messages() if m.src == tile]
    assert sent == len(mine), f"rank {ctx.rank}: sent {sent} messages, the geometry says {len(mine)}"


def run_grid(check: Checks, ctx: Context, plane: str, shape: tuple[int, int, int], ranks: list[int], group) -> None:
    grid = TileGrid(depth=shape[0], rows=shape[1], cols=shape[2])
    tile = ranks.index(ctx.rank)
    for spec in HALOS:
        with check(f"{grid_name(shape)} {plane}: halo k{spec[0]} s{spec[1]} p{spec[2]}"):
            check_halo(ctx, grid, group, ranks, tile, spec)
    if plane != "mpi":
        return
    x = torch.randn(2, 2, *SIZES, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for name, layer in layers().items():
        with check(f"{grid_name(shape)}: {name}") as result:
            errors = check_spatial_exact(layer, grid, x, ctx, group, what=name, forward_seed=7)
            result.detail = f"max rel err {max(errors.values()):.1e}"
    with check(f"{grid_name(shape)}: conv stack") as result:
        volume = torch.randn(2, 2, *STACK_SIZES, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        errors = check_spatial_exact(conv_stack(), grid, volume, ctx, group, what="conv stack", grad_floor=1e-6)
        result.detail = f"max rel err {max(errors.values()):.1e}"
    with check(f"{grid_name(shape)}: skip decoder") as result:
        volume = torch.randn(2, 2, *DECODER_SIZES, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
        torch.manual_seed(8)
        errors = check_spatial_exact(SkipDecoder().double(), grid, volume, ctx, group, what="skip decoder",
                                     forward_seed=7, grad_floor=1e-6)
        result.detail = f"max rel err {max(errors.values()):.1e}"
    if shape in SWIN_SIZES:
        with check(f"{grid_name(shape)}: swinunetr3d") as result:
            result.detail = check_swinunetr3d(ctx, grid, group, SWIN_SIZES[shape])


def check_swinunetr3d(ctx: Context, grid: TileGrid, group, sizes: tuple[int, int, int]) -> str:
    """swinunetr3d on the grid's tiles equals one process: output, input gradient, every parameter gradient."""
    torch.manual_seed(12)   # 2 input channels: with one, the input block's 1x1 shortcut before its InstanceNorm has
    net = nn.Sequential(*swinunetr3d(2, 6, 2, in_channels=2)).double()   # a gradient of 0 (rounding noise only)
    volume = torch.randn(2, 2, *sizes, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    errors = check_spatial_exact(net, grid, volume, ctx, group, what="swinunetr3d", grad_floor=1e-6)
    grads = sum(name.startswith("grad ") for name in errors)
    assert grads == sum(1 for _ in net.parameters()), f"{grads} parameter gradients compared"
    return f"{'x'.join(map(str, sizes))} volume, {grads} parameter gradients, max rel err {max(errors.values()):.1e}"


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    for plane in ("mpi", "gloo"):
        ctx = Context(backend=plane)
        assert ctx.world_size == WORLD, f"run with {WORLD} ranks"
        groups = {shape: (ranks, ctx.new_group(ranks) if len(ranks) < WORLD else None)
                  for step in STEPS for shape, ranks in step}   # every rank creates every group, in order
        for step in STEPS:
            for shape, _ in step:
                ranks, group = groups[shape]
                if ctx.rank in ranks and plane in PLANES.get(shape, ("mpi",)):
                    run_grid(check, ctx, plane, shape, ranks, group)
            ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
