"""The rows of ``benchmarks/gpu_check.sh`` and which of them run on this node: NCCL refuses two ranks on one GPU, so
with fewer GPUs than ranks a row on the nccl plane is skipped (saying why) and the mpi plane's rows run with ranks
sharing GPUs round-robin.

``python -m benchmarks.support.gpu_rows --device cuda --gpus 1`` prints the plan the script runs, one row a line:
kind, name, ranks, skip reason (``-``: runs), the row's environment variables (``NAME=VALUE``, shell-quoted; ``-``:
none) and the command's arguments (shell-quoted), separated by tabs.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

NO_REASON = "-"
NO_ENV = "-"
# torch's collective flight recorder keeps ~1 KB per collective of the torch plane (gloo, nccl) until its ring of 2000
# is full: on a tile rank (~11 collectives a step) the soak's heap grows ~8 KB/step for its first ~180 steps, torch's
# bounded record, not the package's. The soak on the torch plane runs with the recorder off, measuring the package,
# for 500 steps: the heap still warms up on gloo (torch 2.11, recorder off: 114-253 B/step over steps 40-300 against
# the soak's limit of 256, 94-145 over steps 40-500).
NO_FLIGHT_RECORDER = (("TORCH_FR_BUFFER_SIZE", "0"),)
SOAK_STEPS = 500
SPATIAL_MODELS = "resnet_classifier,avgpool3_s2_excl,maxpool3_s2_p1,bn_relu_conv"
TRAIN = ("python", "-m", "mpi4dl_nb", "train", "--model", "resnet", "--resnet-version", "1", "--num-layers", "8",
         "--num-filters", "8", "--image-size", "64", "--batch-size", "4", "--num-samples", "8", "--split-size", "2",
         "--spatial-size", "1", "--num-spatial-parts", "4", "--parts", "2", "--steps", "3", "--dtype", "float64",
         "--no-progress", "-v")


class RowKind(Enum):
    """How the script runs a row: an MPI test program counting named checks, a command judged by its exit
    status, or the comparison of the two train CLI runs (no launch of its own)."""

    CHECKS = "checks"
    COMMAND = "command"
    TRAIN_COMPARE = "train-compare"


@dataclass(frozen=True)
class Row:
    """One row of the table: its name, its ranks, the data planes it uses and what it runs."""

    kind: RowKind
    name: str
    ranks: int
    planes: tuple[str, ...]          # "mpi" and/or the torch plane ("nccl" on CUDA, "gloo" on CPU)
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()    # variables set for every rank of the row

    def line(self, reason: str | None) -> str:
        """The row as the script reads it (tab-separated; ``-``: no reason to skip, no variables)."""
        env = shlex.join(f"{name}={value}" for name, value in self.env) or NO_ENV
        return "\t".join([self.kind.value, self.name, str(self.ranks), reason or NO_REASON, env, shlex.join(self.args)])


def torch_plane(device: str) -> str:
    """The torch plane the check uses on ``device``: nccl on CUDA, gloo (its CPU stand-in) elsewhere."""
    return "nccl" if device == "cuda" else "gloo"


def rows(device: str) -> list[Row]:
    """Every row of the check, in table order, for ``device`` ("cuda", or "cpu" to check the script)."""
    plane = torch_plane(device)
    table = [Row(RowKind.CHECKS, f"spatial exactness 2x2 ({p})", 4, (p,),
                 ("tests.mpi.spatial_exactness", "2", "2", p, SPATIAL_MODELS)) for p in ("mpi", plane)]
    for p in ("mpi", plane):
        table += [Row(RowKind.CHECKS, f"engine exactness 5 ranks ({p})", 5, (p,),
                      ("tests.mpi.engine_exact", f"--backend={p}", "sp_lp_square", "sp_pp", "sp_gems_pp")),
                  Row(RowKind.CHECKS, f"engine exactness 3 ranks GEMS 1F1B ({p})", 3, (p,),
                      ("tests.mpi.engine_exact", f"--backend={p}", "gems3_1f1b_m2", "lp3"))]
    table += [Row(RowKind.CHECKS, f"{name} plane on {device} tensors, {n} ranks", n, (backend,),
                  ("tests.mpi.comm_planes", f"--device={device}", f"--plane={side}"))
              for side, name, backend in (("mpi", "mpi", "mpi"), ("torch", plane, plane)) for n in (2, 4)]
    table += [Row(RowKind.CHECKS, f"soak: trace and memory flat ({plane})", 5, (plane,),
                  ("tests.mpi.soak", "sp_lp", str(SOAK_STEPS), f"--backend={plane}"), NO_FLIGHT_RECORDER),
              Row(RowKind.COMMAND, "p2p benchmark", 2, ("mpi", plane),
                  ("python", "benchmarks/bench_p2p.py", "--device", device, "--repeats", "20")),
              Row(RowKind.COMMAND, "train CLI 5 ranks (torch plane)", 5, (plane,),
                  (*TRAIN, "--device", device, "--backend", plane)),
              Row(RowKind.COMMAND, "train CLI 5 ranks (mpi)", 5, ("mpi",),
                  (*TRAIN, "--device", device, "--backend", "mpi")),
              Row(RowKind.TRAIN_COMPARE, "train CLI: torch-plane loss == mpi loss", 5, ("mpi", plane))]
    return table


def skip_reason(row: Row, device: str, gpus: int) -> str | None:
    """Why ``row`` cannot run with ``gpus`` GPUs on this node (None: it runs). NCCL needs a GPU of its own for
    every rank; the mpi plane and gloo run with ranks sharing GPUs (or on CPU)."""
    if device == "cuda" and "nccl" in row.planes and row.ranks > gpus:
        return f"needs one GPU per rank ({row.ranks} ranks, {gpus} GPU{'' if gpus == 1 else 's'} here)"
    return None


def plan(device: str, gpus: int) -> list[tuple[Row, str | None]]:
    """Every row with the reason it is skipped (None: it runs)."""
    return [(row, skip_reason(row, device, gpus)) for row in rows(device)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--gpus", type=int, required=True, help="GPUs visible on this node")
    args = parser.parse_args(argv)
    for row, reason in plan(args.device, args.gpus):
        print(row.line(reason))


if __name__ == "__main__":
    main()
