"""Tiny helpers for MPI test scripts: relative error, and a check that names the rank."""

from __future__ import annotations

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max(max |e|, tiny)."""
    actual = actual.detach().double()
    expected = expected.detach().double()
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    scale = expected.abs().max().item() if expected.numel() else 0.0
    return (actual - expected).abs().max().item() / max(scale, 1e-300) if expected.numel() else 0.0


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str,
                 rank: int | None = None) -> None:
    """Raise with the rank and the error when ``actual`` differs from ``expected``."""
    err = rel_err(actual, expected)
    if not err <= rtol:
        where = f"rank {rank}: " if rank is not None else ""
        raise AssertionError(f"{where}{what}: relative error {err:.3e} > {rtol:.1e}")
