"""The five rows of ``benchmarks/gpu_bench.sh`` and their sizes: the GPU's, or scaled down for a CPU rehearsal.

``python -m benchmarks.support.gpu_bench.rows --device cuda`` prints the plan the script runs, one row a line: name,
ranks, time limit (s) and the module with its arguments (shell-quoted), separated by tabs.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

PACKAGE = "benchmarks.support.gpu_bench"
DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class Scale:
    """The sizes the rows run at on one kind of device."""

    tokens: tuple[int, ...]          # ring blocks: tokens of one attention (ViT-L/16: 16 heads x 64)
    heads: int
    vit: str                         # memory per rank: the timm model, its depth (0: all), the image sides
    vit_depth: int
    vit_sides: tuple[int, ...]
    resnet_side: int                 # engine overhead: ResNet-50's side, ViT-B/16's side and depth (0: all), batch
    vit_b_side: int
    vit_b_depth: int
    batch: int
    megabytes: tuple[int, ...]       # staged MPI: message sizes
    repeats: int                     # timed calls per figure
    note: str                        # how the sizes differ from the GPU's ("" on the GPU)


SCALES = {
    "cuda": Scale(tokens=(4096, 8192, 16384), heads=16, vit="vit_large_patch16_224", vit_depth=0,
                  vit_sides=(1024, 2048), resnet_side=1024, vit_b_side=1024, vit_b_depth=0, batch=4,
                  megabytes=(1, 4, 16, 64, 256), repeats=10, note=""),
    "cpu": Scale(tokens=(256, 512, 1024), heads=4, vit="vit_small_patch16_224", vit_depth=1, vit_sides=(512, 768),
                 resnet_side=64, vit_b_side=64, vit_b_depth=2, batch=1, megabytes=(1, 4, 16), repeats=2,
                 note="cpu scale"),
}


@dataclass(frozen=True)
class BenchRow:
    """One row: its name, ranks, time limit on a GPU and the program (a module of this package) with arguments."""

    name: str
    ranks: int
    limit_s: int
    program: str
    args: tuple[str, ...]

    def line(self, limit_s: int) -> str:
        """The row as the script reads it (tab-separated), with the time limit it runs under."""
        command = ("-m", f"{PACKAGE}.{self.program}", *self.args)
        return "\t".join([self.name, str(self.ranks), str(limit_s), shlex.join(command)])


def _joined(values: Sequence[int]) -> str:
    return ",".join(map(str, values))


def rows(device: str) -> list[BenchRow]:
    """The five rows, in table order, at ``device``'s sizes ("cuda", or "cpu" to rehearse the script)."""
    scale = SCALES[device]
    common = ("--device", device, "--repeats", str(scale.repeats), "--note", scale.note)
    return [
        BenchRow("ring blocks vs fused SDPA", 1, 75, "ring_blocks",
                 (*common, "--tokens", _joined(scale.tokens), "--heads", str(scale.heads))),
        BenchRow("memory per rank vs planner (ViT, token tiles, mpi)", 4, 150, "memory_per_rank",
                 (*common, "--model", scale.vit, "--depth", str(scale.vit_depth), "--sides", _joined(scale.vit_sides))),
        BenchRow("engine overhead vs plain torch (1 rank, bf16)", 1, 100, "engine_overhead",
                 (*common, "--resnet-side", str(scale.resnet_side), "--vit-side", str(scale.vit_b_side),
                  "--vit-depth", str(scale.vit_b_depth), "--batch", str(scale.batch))),
        BenchRow("staged MPI vs pinned copy (2 ranks)", 2, 60, "staged_mpi",
                 (*common, "--megabytes", _joined(scale.megabytes))),
        BenchRow("bitwise rerun (float64, 2 tiles + a layer rank)", 3, 60, "bitwise_rerun", common),
    ]


def row_limit(row: BenchRow, device: str, override: int | None) -> int:
    """The seconds ``row`` may run: ``override`` when given, else its own on a GPU, three times that on a CPU."""
    if override is not None:
        return override
    return row.limit_s if device == "cuda" else 3 * row.limit_s


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=DEVICES, required=True)
    parser.add_argument("--row-timeout", type=int, default=None, help="every row's limit (s; default: its own)")
    args = parser.parse_args(argv)
    for row in rows(args.device):
        print(row.line(row_limit(row, args.device, args.row_timeout)))


if __name__ == "__main__":
    main()
