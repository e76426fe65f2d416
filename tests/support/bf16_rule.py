"""The rule a bf16 run on tiles must meet against serial training under the same autocast (images and volumes).

The tiles' convolutions sum the same products in another blocking than the whole image's, so a bf16 rounding
(2^-8 relative) of a layer output can differ by one unit, and these differences grow through the layers and
steps exactly like bf16's own rounding error does. So each tensor of the state must be as close to serial bf16
as serial fp32 is to it (at most NOISE_FACTOR times that distance, + STATE_FLOOR): measured 0.3-1.4x on 2-D,
largest on BatchNorm biases whose few-step values are mostly rounding noise (relative 0.2-0.6 for both). The
losses must be within LOSS_TOLERANCE relative (measured ~1e-3).

The rule holds for oneDNN's AVX2 and AVX-512 (with or without native bf16 dot products) convolutions; bf16 runs
cap oneDNN below AMX (``pin_bf16_kernels``, called before the first convolution): with AMX tiles, serial bf16 came
3-10x closer to fp32 than on the other kernels (a whole image's weight gradient accumulated in float32 and rounded
once, where each tile rounds its share), while the tiles' distance to fp32 stayed what the other kernels give both
(measured 2026-11-27 on a Xeon with AMX-BF16: the first conv's weight 1.2e-1 from fp32 on tiles, 4.4e-2 serial).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch

LOSS_TOLERANCE = 1e-2
NOISE_FACTOR = 2.0
STATE_FLOOR = 1e-3


BF16_KERNELS = ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")   # the newest oneDNN ISA below AMX


def pin_bf16_kernels() -> None:
    """oneDNN's kernels capped below AMX for this process (unless the environment sets a cap already): the rule
    above is measured there. Call it before the process's first convolution (oneDNN reads the cap once)."""
    os.environ.setdefault(*BF16_KERNELS)


def bf16_loss_error(losses: Sequence[float], want: Sequence[float]) -> float:
    """The worst relative error of the bf16 ``losses`` against serial bf16's; raises past LOSS_TOLERANCE."""
    err = max(abs(a - b) / abs(b) for a, b in zip(losses, want, strict=True))
    if err > LOSS_TOLERANCE:
        raise AssertionError(f"bf16 losses {list(losses)} vs serial bf16 {list(want)}")
    return err


def bf16_state_error(state: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor],
                     fp32: Mapping[str, torch.Tensor]) -> float:
    """The worst ratio of a state tensor's distance from serial bf16 (``want``) to serial fp32's (``fp32``);
    raises when one is past NOISE_FACTOR times that distance + STATE_FLOOR."""
    worst = 0.0
    for key, expected in want.items():
        if not expected.is_floating_point():
            continue
        scale = max(expected.abs().max().item(), 1e-6)
        par = (state[key].double() - expected.double()).abs().max().item() / scale
        noise = (fp32[key].double() - expected.double()).abs().max().item() / scale
        if par > NOISE_FACTOR * noise + STATE_FLOOR:
            raise AssertionError(f"bf16 {key}: {par:.2e} from serial bf16, while serial fp32 is {noise:.2e} from it")
        worst = max(worst, par / max(noise, STATE_FLOOR))
    return worst
