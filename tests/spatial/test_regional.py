"""Region convs/pools in one process: boxes equal the extended tile's, their scatter is the adjoint, outputs equal.

No messages: ``HaloExchange.rebuild`` builds the extended tile from given strips, and a
replaying ``ForwardLog`` hands the same strips to the region forward.
"""

from __future__ import annotations

import itertools
import random

import torch
import torch.nn.functional as F
from torch import nn

from mpi4dl_nb.spatial.conv import ConvPieces, conv_axis_windows
from mpi4dl_nb.spatial.geometry import KernelAxis, LayerHalo, TileGrid
from mpi4dl_nb.spatial.halo import HaloExchange
from mpi4dl_nb.spatial.kernel_layer import ceil_kernel
from mpi4dl_nb.spatial.pool import PoolPieces, SpatialAvgPool, SpatialMaxPool, pool_axis_windows
from mpi4dl_nb.spatial.region import region_plan
from mpi4dl_nb.spatial.regional import gather_box, plan_for, scatter_box, windowed_by_regions
from mpi4dl_nb.spatial.replay import ForwardLog

GRID = TileGrid(3, 3)


def exchange_and_inputs(rows: KernelAxis, cols: KernelAxis, height: int, width: int, tile: int,
                        pad_value: float, seed: int) -> tuple[HaloExchange, torch.Tensor, list]:
    geometry = LayerHalo.for_windows(GRID, height, width, rows, cols)
    exchange = HaloExchange(geometry, tile, list(range(GRID.num_tiles)), comm=None, pad_value=pad_value)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed)
    r, c = exchange.axes
    h, w = r.owned[1] - r.owned[0], c.owned[1] - c.owned[0]

    def rand(*shape: int) -> torch.Tensor | None:
        return torch.randn(2, 3, *shape, generator=gen, dtype=torch.float64) if min(shape) > 0 else None

    x = rand(h, w)
    strips = [rand(r.recv_prev[1] - r.recv_prev[0], w), rand(r.recv_next[1] - r.recv_next[0], w),
              rand(r.needed_len, c.recv_prev[1] - c.recv_prev[0]), rand(r.needed_len, c.recv_next[1] - c.recv_next[0])]
    for strip in strips[2:]:   # column strips carry the sender's padding rows, as the exchange sends them
        if strip is not None:
            strip[..., :r.pad_before, :] = pad_value
            strip[..., r.needed_len - r.pad_after:, :] = pad_value
    return exchange, x, strips


CASES = [(KernelAxis(3, 2, 1, 1, 1), 0.0), (KernelAxis(7, 2, 1, 3, 3), 0.0), (KernelAxis(2, 2), 0.0),
         (KernelAxis(3, 1, 2, 1, 1), float("-inf")), (KernelAxis(1, 2), 0.0)]


def test_boxes_are_the_extended_tiles_and_scatter_is_their_adjoint():
    rng = random.Random(0)
    for (window, pad), (height, width), tile in itertools.product(CASES, [(31, 29), (40, 37)], range(9)):
        exchange, x, strips = exchange_and_inputs(window, window, height, width, tile, pad, tile)
        extended = exchange.rebuild(x, strips)
        n_rows, n_cols = extended.shape[-2:]
        for _ in range(4):
            r0, c0 = rng.randrange(n_rows), rng.randrange(n_cols)
            box = ((r0, rng.randrange(r0 + 1, n_rows + 1)), (c0, rng.randrange(c0 + 1, n_cols + 1)))
            piece = gather_box(exchange, x, strips, box)
            assert torch.equal(piece, extended[..., box[0][0]:box[0][1], box[1][0]:box[1][1]])
            grad = torch.randn_like(piece).nan_to_num(0.0)
            targets = [torch.zeros_like(x)] + [None if s is None else torch.zeros_like(s) for s in strips]
            scatter_box(exchange, grad, box, targets)
            lhs = (piece.where(piece.isfinite(), 0) * grad).sum()   # padding: no gradient goes there
            rhs = sum((t * s.where(s.isfinite(), 0)).sum() for t, s in zip(targets, [x, *strips]) if t is not None)
            assert torch.allclose(lhs, rhs, rtol=1e-12, atol=1e-12)


def replaying(strips: list):
    """Inside, the next halo exchange takes ``strips`` and sends nothing."""
    log = ForwardLog()
    log.entries = [strips]
    return log.replaying_entries()


def test_region_forward_equals_the_op_on_the_extended_tile():
    torch.manual_seed(0)
    convs = [nn.Conv2d(3, 4, 7, stride=2, padding=3), nn.Conv2d(3, 4, 3, stride=2, padding=1),
             nn.Conv2d(3, 4, 1, stride=2), nn.Conv2d(3, 4, 3, padding=1, dilation=2)]
    pools = [nn.MaxPool2d(3, 2, 1), nn.MaxPool2d(3, 2, 1, ceil_mode=True), nn.AvgPool2d(2, 2),
             nn.AvgPool2d(3, 2, 1, ceil_mode=True)]
    taken = 0
    for module, (height, width), tile in itertools.product(convs + pools, [(45, 41), (38, 50)], range(9)):
        module = module.double()
        if isinstance(module, nn.Conv2d):
            layer, windows, pad = module, conv_axis_windows(module), 0.0
        else:
            windows = pool_axis_windows(module, 2)
            if module.ceil_mode:
                windows = (ceil_kernel(windows[0], height), ceil_kernel(windows[1], width))
            pad = float("-inf") if isinstance(module, nn.MaxPool2d) else 0.0
        exchange, x, strips = exchange_and_inputs(*windows, height, width, tile, pad, tile)
        extended = exchange.rebuild(x, strips)
        if isinstance(module, nn.Conv2d):
            op = ConvPieces(layer)   # reads only the conv's stride, dilation, groups, kernel size
            params = (layer.weight, layer.bias)
            want = F.conv2d(extended, layer.weight, layer.bias, layer.stride, 0, layer.dilation)
        else:
            cls = SpatialMaxPool if isinstance(module, nn.MaxPool2d) else SpatialAvgPool
            spatial = cls.__new__(cls)
            nn.Module.__init__(spatial)
            spatial.windows = pool_axis_windows(module, 2)
            op = PoolPieces(spatial)
            params = ()
            want = spatial.pool_saving(extended, (0, 0))[0]
        plan = plan_for(op, exchange)
        if plan is None:
            continue
        taken += 1
        assert plan == region_plan(exchange.axes, op.spans, op.strides, op.pad_caps)
        with torch.no_grad(), replaying(strips):
            got = windowed_by_regions(x, op, exchange, plan, False, params)
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert taken > 100
