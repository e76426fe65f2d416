"""Declarative parallel-vs-serial exactness check for spatialized modules (float64, under MPI).

``check_spatial_exact(model, grid, x, ctx)`` runs ``model`` serially on the full input and
``dl.spatialize(model)`` on scattered tiles, then compares outputs, input gradients, every
parameter gradient (tile shares summed) and every buffer (BatchNorm running stats), and
optionally an eval-mode forward after the training step. Raises AssertionError naming
the first mismatch; returns the worst relative error per compared quantity.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from mpi4dl_nb.spatial.convert import reduce_tile_gradients, spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.tiles import gather_tiles, scatter_tiles


def relative_error(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-4) -> float:
    """max |a - e| / max(max |e|, floor).

    The floor keeps gradients that are zero in exact arithmetic (a conv bias right before
    BatchNorm: serial gives ~1e-17 noise) from failing on rounding noise.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if expected.numel() == 0:
        return 0.0
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    return diff / max(scale, floor)


def _is_replicated(y_ref: torch.Tensor, grid: TileGrid) -> bool:
    return y_ref.dim() != 4 or y_ref.shape[-2] < grid.rows or y_ref.shape[-1] < grid.cols


def check_spatial_exact(model: nn.Module, grid: TileGrid, x: torch.Tensor, ctx: Any,
                        group: Any = None, *, rtol: float = 1e-10, train: bool = True,
                        eval_after: bool = True, seed: int = 1234, what: str = "",
                        grad_floor: float | None = None, **spatialize_kwargs: Any) -> dict[str, float]:
    """Compare ``spatialize(model)`` on tiles with ``model`` on the full ``x`` (same on all ranks).

    ``grad_floor``: parameter gradients are compared relative to at least this fraction of
    the model's largest serial gradient (a gradient that is zero in exact arithmetic, e.g. a
    conv bias before a norm, is pure rounding noise); None: the fixed floor of relative_error.

    The serial reference runs where ``x`` is (CPU); the tiles run on ``ctx.device`` (a GPU
    when the context has one: what ``benchmarks/gpu_check.sh`` exercises).
    """
    label = what or type(model).__name__
    device = getattr(ctx, "device", x.device)
    reference = copy.deepcopy(model).train(train)
    net = spatialize(copy.deepcopy(model).to(device).train(train), grid, ctx, group,
                     **spatialize_kwargs)
    errors: dict[str, float] = {}

    def compare(name: str, actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-4) -> None:
        err = relative_error(actual, expected, floor)
        errors[name] = err
        if not err <= rtol:
            raise AssertionError(f"rank {ctx.rank}: {label}: {name} relative error {err:.3e} > "
                                 f"{rtol:.1e}")

    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = reference(x_ref)
    generator = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(y_ref.shape, generator=generator, dtype=y_ref.dtype)
    (y_ref * grad_out).sum().backward()

    x_sp = x.detach().to(device, copy=True).requires_grad_(True)
    y_tile = net(scatter_tiles(x_sp, grid, ctx, group))
    replicated = _is_replicated(y_ref, grid)
    y = y_tile if replicated else gather_tiles(y_tile, grid, ctx, group, full_shape=y_ref.shape)
    compare("output", y, y_ref)
    (y * grad_out.to(device)).sum().backward()
    compare("input grad", x_sp.grad, x_ref.grad)
    reduce_tile_gradients(net)
    ref_params = dict(reference.named_parameters())
    floor = 1e-4
    if grad_floor is not None:
        floor = max([floor] + [grad_floor * p.grad.abs().max().item() for p in ref_params.values()
                               if p.grad is not None and p.grad.numel()])
    for name, param in net.named_parameters():
        if ref_params[name].grad is None:
            if param.grad is not None and param.grad.abs().max() > 0:
                raise AssertionError(f"{label}: {name} has a gradient the serial model lacks")
            continue
        if param.grad is None:
            raise AssertionError(f"rank {ctx.rank}: {label}: {name} got no gradient")
        compare(f"grad {name}", param.grad, ref_params[name].grad, floor)
    ref_buffers = dict(reference.named_buffers())
    for name, buf in net.named_buffers():
        compare(f"buffer {name}", buf.double(), ref_buffers[name].double())
    if eval_after:
        reference.eval()
        net.eval()
        with torch.no_grad():
            y_ref = reference(x)
            y_tile = net(scatter_tiles(x.to(device), grid, ctx, group))
            y = y_tile if replicated else gather_tiles(y_tile, grid, ctx, group,
                                                       full_shape=y_ref.shape)
        compare("eval output", y, y_ref)
    return errors
