"""Per-rank model memory: bytes each rank keeps after HybridEngine releases the stages it does not hold.

Before the release every rank kept the whole model (``model bytes``); now a rank keeps only
the parameters/buffers of its stages (``held``). Also prints each rank's resident set size
(VmRSS) before and after building the engine (after ``malloc_trim``). No training step runs.

    MPIR_CVAR_ENABLE_HEAVY_YIELD=1 OMP_NUM_THREADS=1 mpiexec -n 4 python \
        benchmarks/bench_memory.py --model amoebanet --num-layers 18 --num-filters 416 --split-size 4

(``--spatial-size 1 --num-spatial-parts 4`` etc. are accepted as in the CLI's config keys.)
"""

from __future__ import annotations

import argparse
import ctypes
import gc

import torch
from support.machine import Footer
from support.tables import Table
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.measure.usage import rss_bytes
from mpi4dl_nb.models import build_model


def return_freed_memory() -> None:
    """Ask glibc to hand freed heap pages back to the OS, so RSS shows what was released."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="amoebanet")
    parser.add_argument("--num-layers", type=int, default=18)
    parser.add_argument("--num-filters", type=int, default=416)
    parser.add_argument("--split-size", type=int, default=4)
    parser.add_argument("--spatial-size", type=int, default=0)
    parser.add_argument("--num-spatial-parts", type=int, default=4)
    parser.add_argument("--times", type=int, default=0)
    args = parser.parse_args()
    footer = Footer()
    torch.set_num_threads(1)
    ctx = dl.init()
    cfg = dl.ParallelConfig(split_size=args.split_size, spatial_size=args.spatial_size,
                            num_spatial_parts=args.num_spatial_parts, times=args.times)
    torch.manual_seed(0)
    layers = build_model(args.model, num_layers=args.num_layers, num_filters=args.num_filters)
    model_bytes = sum(t.numel() * t.element_size() for layer in layers
                      for t in [*layer.parameters(), *layer.buffers()])
    return_freed_memory()
    rss_before = rss_bytes() or 0
    engine = dl.HybridEngine(layers, cfg, ctx, loss_fn=nn.CrossEntropyLoss())
    return_freed_memory()
    row = (ctx.rank, engine.held_stages(), engine.held_parameter_bytes(include_buffers=True),
           model_bytes, rss_before, rss_bytes() or 0)
    rows = ctx.gather_object(row, root=0)
    if ctx.rank == 0:
        mib = 2.0 ** 20
        print(f"{args.model} {args.num_layers}x{args.num_filters}, {cfg.world_size} ranks, "
              f"split_size={cfg.split_size} spatial_size={cfg.spatial_size} times={cfg.times}")
        table = Table([">rank", "stages", ">held MiB", ">before (whole model) MiB", ">ratio",
                       ">RSS before -> after engine MiB"])
        for rank, stages, held, whole, before, after in rows:
            table.add(rank, stages, f"{held / mib:.1f}", f"{whole / mib:.1f}", f"{whole / max(held, 1):.2f}",
                      f"{before / mib:.0f} -> {after / mib:.0f}")
        print(table.markdown())
        footer.print()
    ctx.barrier()


if __name__ == "__main__":
    main()
