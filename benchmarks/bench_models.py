"""ResNet and AmoebaNet-D: images/s and per-rank peak memory of LP, SP+LP and SP+PP next to serial, in one run.

Each configuration is a real batch job (``mpiexec -n N python -m mpi4dl_nb train ...``, one
after another, same machine, same model, same global batch and image size); the table gives
every job's throughput and largest per-rank peak memory as ratios to the serial job.

    python benchmarks/bench_models.py --image-size 512 --batch-size 2 --steps 5

Memory is counted, not RSS (CPU): parameters + gradients + optimizer state + the peak of
bytes autograd keeps for backward (CUDA: the allocator peak). Images/s excludes the first
(warm-up) step. Configurations (override with --spatial-parts/--slice-method/--parts):
  serial   1 rank                split 1
  LP       2 ranks               split 2
  SP+LP    P+1 ranks             split 2, spatial 1, P tiles
  SP+PP    P+1 ranks             split 2, spatial 1, P tiles, --parts m micro-batches
"""
from __future__ import annotations

import argparse
import json
import sys

from support.launch import last_json, run_job
from support.machine import REPO, Footer
from support.tables import Table


def model_flags(args: argparse.Namespace, model: str) -> list[str]:
    if model == "resnet":
        return ["--model", "resnet", "--resnet-version", str(args.resnet_version),
                "--num-layers", str(args.resnet_depth), "--num-filters", str(args.resnet_width)]
    return ["--model", "amoebanet", "--num-layers", str(args.amoeba_layers),
            "--num-filters", str(args.amoeba_filters)]


def configurations(args: argparse.Namespace) -> list[tuple[str, int, list[str]]]:
    spatial = ["--split-size", "2", "--spatial-size", "1", "--num-spatial-parts",
               str(args.spatial_parts), "--slice-method", args.slice_method]
    return [("serial", 1, ["--split-size", "1", "--spatial-size", "0"]),
            ("LP", 2, ["--split-size", "2", "--spatial-size", "0"]),
            ("SP+LP", args.spatial_parts + 1, spatial),
            (f"SP+PP(m={args.parts})", args.spatial_parts + 1, spatial + ["--parts", str(args.parts)])]


def train_job(ranks: int, flags: list[str], timeout: float) -> dict:
    """One ``python -m mpi4dl_nb train`` job; its JSON summary."""
    done = run_job(ranks, [sys.executable, "-m", "mpi4dl_nb", "train", *flags], timeout=timeout, cwd=str(REPO))
    return last_json(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="resnet,amoebanet")
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="steps per job (first is warm-up)")
    parser.add_argument("--spatial-parts", type=int, default=2)
    parser.add_argument("--slice-method", default="vertical")
    parser.add_argument("--parts", type=int, default=2, help="micro-batches of SP+PP")
    parser.add_argument("--resnet-version", type=int, default=2)
    parser.add_argument("--resnet-depth", type=int, default=29)
    parser.add_argument("--resnet-width", type=int, default=16)
    parser.add_argument("--amoeba-layers", type=int, default=6)
    parser.add_argument("--amoeba-filters", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", action="store_true", help="also print every job's summary")
    args = parser.parse_args()

    common = ["--image-size", str(args.image_size), "--batch-size", str(args.batch_size),
              "--steps", str(args.steps), "--num-samples", str(args.batch_size * args.steps),
              "--no-progress"]
    footer = Footer()
    print(f"image {args.image_size}^2, global batch {args.batch_size}, {args.steps} steps per job (1 warm-up)")
    table = Table(["model", "config", ">ranks", ">img/s", ">x serial", ">peak MB", ">x serial", ">comm %"])
    for model in args.models.split(","):
        base = None
        for name, ranks, flags in configurations(args):
            record = train_job(ranks, model_flags(args, model) + flags + common, args.timeout)
            peak = max(record["peak_memory_bytes"])
            comm = sum(record["comm_seconds"]) / max(1e-12, sum(record["train_seconds"]))
            if base is None:
                base = record["images_per_s"], peak
            table.add(model, name, ranks, f"{record['images_per_s']:.3f}", f"{record['images_per_s'] / base[0]:.2f}",
                      f"{peak / 2**20:.1f}", f"{peak / base[1]:.2f}", f"{100 * comm:.1f}%")
            print(f"  {model} {name}: done", file=sys.stderr, flush=True)
            if args.json:
                print(json.dumps(record))
    print(table.markdown())
    print("peak MB: largest per-rank peak; comm %: share of step time in communication "
          "(incl. waiting), over all ranks")
    footer.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
