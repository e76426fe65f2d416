"""Declarative parallel-vs-serial exactness check for spatialized modules (float64, under MPI).

``check_spatial_exact(model, grid, x, ctx)`` runs ``model`` serially on the full input and
``dl.spatialize(model)`` on scattered tiles, then compares outputs, input gradients, every
parameter gradient (tile shares summed) and every buffer (BatchNorm running stats), and
optionally an eval-mode forward after the training step. Raises AssertionError naming
the first mismatch; returns the worst relative error per compared quantity.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import torch
from torch import nn

from mpi4dl_nb.spatial.convert import reduce_tile_gradients, spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.tile_marks import is_tiled
from mpi4dl_nb.spatial.tiles import gather_tiles, scatter_tiles

SAME_ON_EVERY_RANK = "gradients and buffers equal on every rank"


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
    axes = grid.ndim   # 2, or 3 for a volume's grid
    return y_ref.dim() != 2 + axes or any(n < count for n, count in zip(y_ref.shape[-axes:], grid.shape))


def check_spatial_exact(model: nn.Module, grid: TileGrid, x: torch.Tensor, ctx: Any,
                        group: Any = None, *, rtol: float = 1e-10, train: bool = True,
                        eval_after: bool = True, seed: int = 1234, what: str = "",
                        grad_floor: float | None = None, forward_seed: int | None = None,
                        reference_rank: int | None = None, **spatialize_kwargs: Any) -> dict[str, float]:
    """Compare ``spatialize(model)`` on tiles with ``model`` on the full ``x`` (same on all ranks).

    ``grad_floor``: parameter gradients are compared relative to at least this fraction of
    the model's largest serial gradient (a gradient that is zero in exact arithmetic, e.g. a
    conv bias before a norm, is pure rounding noise); None: the fixed floor of relative_error.

    The serial reference and the tiles both run on ``ctx.device`` (a GPU when the context has one: what
    ``benchmarks/gpu_check.sh`` exercises): one process on the same device is what tiles must equal, and
    only there do dropout and stochastic depth draw the same masks (a GPU's generator is not the CPU's).

    ``forward_seed``: every forward (serial and spatial) starts from ``torch.manual_seed(forward_seed)``,
    so models that draw random numbers (dropout, stochastic depth) draw the same. ``reference_rank``:
    only that rank runs the serial model and compares (the others run their tiles and check that their
    copies of the gradients and buffers equal every other rank's): for large models.
    """
    label = what or type(model).__name__
    device = getattr(ctx, "device", x.device)
    compares = reference_rank is None or ctx.rank == reference_rank
    # one process on the tiles' device: a GPU draws dropout masks from its own generator, not the CPU's
    reference = copy.deepcopy(model).to(device).train(train) if compares else None
    net = spatialize(copy.deepcopy(model).to(device).train(train), grid, ctx, group,
                     **spatialize_kwargs)
    errors: dict[str, float] = {}
    failures: list[str] = []   # raised at the end: a rank that stopped early would leave the others in a collective

    def compare(name: str, actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-4) -> None:
        try:
            err = relative_error(actual, expected, floor)
        except AssertionError as error:   # shapes differ
            failures.append(f"rank {ctx.rank}: {label}: {name}: {error}")
            return
        errors[name] = err
        if not err <= rtol:
            failures.append(f"rank {ctx.rank}: {label}: {name} relative error {err:.3e} > {rtol:.1e}")

    def seeded() -> None:
        if forward_seed is not None:
            torch.manual_seed(forward_seed)

    y_ref = x_ref = None
    if reference is not None:
        x_ref = x.detach().to(device, copy=True).requires_grad_(True)
        seeded()
        y_ref = reference(x_ref)

    x_sp = x.detach().to(device, copy=True).requires_grad_(True)
    seeded()
    y_tile = net(scatter_tiles(x_sp, grid, ctx, group))
    if reference_rank is None:
        assert y_ref is not None
        replicated = _is_replicated(y_ref, grid)
        full_shape = y_ref.shape
    else:   # the same decision on every rank, without the serial output
        replicated = not is_tiled(y_tile)
        full_shape = None
    y = y_tile if replicated else gather_tiles(y_tile, grid, ctx, group, full_shape=full_shape)
    generator = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(y.shape, generator=generator, dtype=y.dtype, device="cpu")
    (y * grad_out.to(device)).sum().backward()
    reduce_tile_gradients(net)
    if reference is not None:
        assert x_ref is not None and y_ref is not None
        (y_ref * grad_out.to(device)).sum().backward()
        compare("output", y, y_ref)
        compare("input grad", x_sp.grad, x_ref.grad)
        failures += _compare_state(net, reference, compare, label, ctx.rank, grad_floor)
    if reference_rank is not None:
        _same_on_every_rank(net, ctx, group, compare)
    if eval_after:
        net.eval()
        with torch.no_grad():
            seeded()
            y_tile = net(scatter_tiles(x.to(device), grid, ctx, group))
            y = y_tile if replicated else gather_tiles(y_tile, grid, ctx, group, full_shape=y.shape)
            if reference is not None:
                reference.eval()
                seeded()
                compare("eval output", y, reference(x.to(device)))
    if failures:
        raise AssertionError(failures[0] + (f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""))
    return errors


def _compare_state(net: nn.Module, reference: nn.Module, compare: Any, label: str, rank: int,
                   grad_floor: float | None) -> list[str]:
    """Every parameter gradient and buffer of ``net`` against ``reference``'s; what is missing or extra."""
    problems = []
    ref_params = dict(reference.named_parameters())
    floor = 1e-4
    if grad_floor is not None:
        floor = max([floor] + [grad_floor * p.grad.abs().max().item() for p in ref_params.values()
                               if p.grad is not None and p.grad.numel()])
    for name, param in net.named_parameters():
        if ref_params[name].grad is None:
            if param.grad is not None and param.grad.abs().max() > 0:
                problems.append(f"rank {rank}: {label}: {name} has a gradient the serial model lacks")
            continue
        if param.grad is None:
            problems.append(f"rank {rank}: {label}: {name} got no gradient")
            continue
        compare(f"grad {name}", param.grad, ref_params[name].grad, floor)
    ref_buffers = dict(reference.named_buffers())
    for name, buf in net.named_buffers():
        compare(f"buffer {name}", buf.double(), ref_buffers[name].double())
    return problems


def bits_digest(flat: torch.Tensor) -> bytes:
    """16 bytes telling ``flat``'s exact bits apart (BLAKE2b of its bytes)."""
    return hashlib.blake2b(flat.detach().cpu().numpy().tobytes(), digest_size=16).digest()


def _same_on_every_rank(net: nn.Module, ctx: Any, group: Any, compare: Any) -> None:
    """This rank's gradients and buffers equal the mean over the group's ranks (so all ranks agree). Copies with the
    same bits on every rank (the usual case: the tile sum leaves each rank the same sums) are told by a digest of
    their bytes, a gather of 16 bytes a rank instead of a sum of every gradient (hundreds of MB for a ResNet-50 in
    float64); copies that differ are averaged and compared within the tolerance, as before."""
    mine = [p.grad for p in net.parameters() if p.grad is not None] + list(net.buffers())
    flat = torch.cat([t.detach().double().reshape(-1) for t in mine])
    if len(set(ctx.all_gather_object(bits_digest(flat), group=group))) == 1:
        compare(SAME_ON_EVERY_RANK, flat[:0], flat[:0])    # equal bits: no error to weigh
        return
    total = ctx.all_reduce(flat.clone(), group=group)
    ranks = ctx.world_size if group is None else group.size
    compare(SAME_ON_EVERY_RANK, flat, total / ranks)


def exact_and_equal_on_every_rank(model: nn.Module, grid: TileGrid, x: torch.Tensor, ctx: Any, *, what: str,
                                  rtol: float, reference_rank: int, forward_seed: int | None = None) -> str:
    """``check_spatial_exact`` (the serial model on ``reference_rank`` only), then an eval forward on tiles whose
    output must be bitwise the same on every rank (a classifier's logits, a pooled vector); the line to report."""
    errors = check_spatial_exact(model, grid, x, ctx, what=what, rtol=rtol, grad_floor=1e-6,
                                 forward_seed=forward_seed, reference_rank=reference_rank)
    net = spatialize(model.eval(), grid, ctx)
    with torch.no_grad():
        y = net(scatter_tiles(x, grid, ctx))
    spread = ctx.all_reduce((y - ctx.all_reduce(y.clone()) / ctx.world_size).abs().max().reshape(1))
    assert float(spread) == 0.0, f"outputs differ across ranks by {float(spread):.1e}"
    compared = {k: v for k, v in errors.items() if k != SAME_ON_EVERY_RANK}
    return (f"worst rel err {max(compared.values()):.2e} over {len(compared)} tensors (output {errors['output']:.1e})"
            if compared else "compared on another rank; outputs equal on every rank")
