"""The op families of torchvision/timm CNNs through HybridEngine (issue 34): SP+LP (split 2, spatial 1, 2x2
tiles) of a stage with BatchNormAct2d, a ConvNeXt block, LayerNorm2d and global gates (parameters used in
custom forwards on tiles and on pooled values) trains like one process for two SGD-momentum steps, float64:
the loss, every parameter gradient on every rank, the updated state.

Usage: python -m tests.mpi.families_engine
Named checks: ``CHECKS``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import mpi4dl_nb as dl
from tests.support.checks import Checks, run_checks
from tests.support.exactness import relative_error
from tests.support.spatial_models import BatchNormAct2d, ConvNeXtBlock, GlobalGates, LayerNorm2d

RTOL = 1e-10
CHECKS = ["SP+LP with the op families equals one process"]


def layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), BatchNormAct2d(4),
                          ConvNeXtBlock(4, drop=0.0), LayerNorm2d(4), GlobalGates(4)).double(),
            nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5)).double()]


def compare(ctx: dl.Context) -> str:
    built = layers()
    cfg = dl.ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, slice_method="square",
                            balance=(1, 1))
    serial = nn.Sequential(*copy.deepcopy(built))
    optimizer = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
    engine = dl.HybridEngine(copy.deepcopy(built), cfg, ctx, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    reference = dict(serial.named_parameters())
    generator = torch.Generator().manual_seed(7)
    worst = 0.0

    def check(what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        nonlocal worst
        err = relative_error(actual, expected)
        worst = max(worst, err)
        assert err <= RTOL, f"rank {ctx.rank}: {what}: relative error {err:.2e}"

    for step in range(2):
        x = torch.randn(2, 3, 20, 24, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 5, (2,), generator=generator)
        loss = engine.train_step(x, y)
        optimizer.zero_grad()
        reference_loss = nn.functional.cross_entropy(serial(x), y)
        reference_loss.backward()
        check(f"step {step} loss", torch.tensor(loss, dtype=torch.float64), reference_loss.detach())
        for instance in engine.instances.values():
            for name, param in instance.canonical.named_parameters():
                key = instance.canonical.full_key(name)
                check(f"step {step} grad {key}", param.grad, reference[key].grad)
        optimizer.step()
        state = engine.full_state_dict()
        if ctx.rank == 0:
            for key, value in serial.state_dict().items():
                check(f"step {step} state {key}", state[key].double(), value.double())
    return f"worst rel err {worst:.1e}"


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    with check(CHECKS[0]) as result:
        result.detail = compare(ctx)
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
