"""CPU floats as accelerators compute them: subnormal numbers flushed to zero on the rank's thread."""

from __future__ import annotations

import os

import torch

KEEP_ENV = "MPI4DL_KEEP_SUBNORMALS"   # set to 1 to leave the CPU's handling of subnormal numbers as it is


def flush_subnormals() -> bool:
    """Flush subnormal floats to zero on this thread (x86 FTZ/DAZ, ``torch.set_flush_denormal``; threads it starts
    later inherit the setting); True if applied.

    A CPU computes with a subnormal (a float32 below 1.2e-38) 10-100x slower than with any other number, and a Swin
    window's attention across a shifted region meets millions: ``exp(s - 100)`` of its -100 mask. The tile that
    attends those windows then runs its attention 1.5x longer than the others, which wait for it at the next
    exchange. GPUs' attention kernels flush them already; float64 has none above 2.2e-308 (its exact runs are
    unchanged); a float32 or bfloat16 result moves by less than 1.2e-38 where one was flushed. Set
    ``MPI4DL_KEEP_SUBNORMALS=1`` to skip."""
    if os.environ.get(KEEP_ENV) == "1":
        return False
    return bool(torch.set_flush_denormal(True))
