"""MPI (2 ranks): a layer that raises on rank 1 only must end the whole job, not hang it."""

from __future__ import annotations

import torch
from torch import nn

import mpi4dl_nb as dl


class Explode(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("deliberate failure in stage 1")


def main() -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    layers = [nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), Explode()]
    cfg = dl.ParallelConfig(split_size=2, spatial_size=0, balance=(2, 1))
    engine = dl.HybridEngine(layers, cfg, ctx, loss_fn=nn.CrossEntropyLoss())
    engine.train_step(torch.randn(2, 3, 4, 4), torch.zeros(2, dtype=torch.long))
    print("unreachable: the step finished", flush=True)


if __name__ == "__main__":
    main()
