"""MONAI as the peer of `infer`: its own pinned venv, the shared command line, and our `infer` run beside it."""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Protocol

import numpy as np

from .launch import run_job
from .machine import REPO
from .tables import Table

MONAI_SPEC = "monai==1.6.1"
MONAI_ROW = "MONAI sliding_window_inference (overlap 0.25, gaussian)"


def add_peer_arguments(parser: argparse.ArgumentParser, workdir: str, ranks: list[int]) -> None:
    """The options both MONAI comparisons take, and the hidden ones the script uses to run a part in the peer venv."""
    parser.add_argument("--ranks", type=int, nargs="+", default=ranks)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--workdir", type=Path, default=REPO / "out" / workdir)
    parser.add_argument("--monai-venv", type=Path, default=REPO / ".bench-venv",
                        help=f"MONAI's own environment ({MONAI_SPEC}; made on first use)")
    parser.add_argument("--skip-monai", action="store_true")
    parser.add_argument("--internal", choices=("monai", "reference"), help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--slide", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)


def peer_python(venv: Path) -> Path:
    """The MONAI venv's python: created on first use, the project's packages seen through a .pth, MONAI pinned."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)], check=True)
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        ours_site = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True).stdout.strip()
        Path(site, "mpi4dl_project.pth").write_text(f"{ours_site}\n{REPO}\n")
    if subprocess.run([str(python), "-c", "import monai"], capture_output=True).returncode:
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", MONAI_SPEC], check=True)
    return python


def ours(ranks: int, checkpoint: Path, slide: Path, out: Path, window: int, dtype: str,
         extra: tuple[str, ...] = ()) -> dict[str, object]:
    """``python -m mpi4dl_nb infer`` on ``ranks`` ranks (one window split over them); its JSON summary."""
    method = "square" if math.isqrt(ranks) ** 2 == ranks else "vertical"
    argv = [sys.executable, "-m", "mpi4dl_nb", "infer", "--checkpoint", str(checkpoint), "--slide", str(slide),
            "--output", str(out), "--num-spatial-parts", str(ranks), "--slice-method", method, "--window",
            str(window), "--dtype", dtype, "--overwrite", "--no-progress", *extra]
    result: dict[str, object] = json.loads(run_job(ranks, argv).stdout.strip().splitlines()[-1])
    return result


def max_difference(result: Path, reference: np.ndarray) -> float:
    """Largest absolute difference of a saved (classes, H, W) map to the reference, over the reference's extent."""
    values = np.load(result)
    height, width = reference.shape[1:]
    return float(np.nanmax(np.abs(values[:, :height, :width].astype(np.float64) - reference)))


class PeerParts(Protocol):
    """A comparison script's two parts that run in a child process: MONAI's run and the whole-slide reference."""

    def monai_run(self, checkpoint: Path, slide: Path, out: Path, roi: int, dtype: str) -> dict[str, float]: ...

    def reference(self, checkpoint: Path, slide: Path, out: Path, dtype: str) -> None: ...


def ran_internal_part(args: argparse.Namespace, parts: PeerParts, roi: int) -> bool:
    """Run the part ``--internal`` names (MONAI's run prints its JSON); whether one ran."""
    if args.internal == "monai":
        print(json.dumps(parts.monai_run(args.checkpoint, args.slide, args.out, roi, args.dtype)))
    elif args.internal == "reference":
        parts.reference(args.checkpoint, args.slide, args.out, args.dtype)
    return args.internal is not None


def child_environment() -> dict[str, str]:
    """This environment with one thread per process and the repository importable."""
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def monai_result(venv: Path, argv: list[str], out: Path, env: dict[str, str]) -> dict[str, float]:
    """Run the script's ``--internal monai`` part in MONAI's venv, writing ``out``; the JSON line it printed."""
    done = subprocess.run([str(peer_python(venv)), *argv, "--internal", "monai", "--out", str(out)],
                          check=True, env=env, capture_output=True, text=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def print_side_by_side(rows: list[tuple[str, int, float, float]], rate: str, rate_format: str, difference: str) -> None:
    """The (method, ranks, rate, max difference) rows as one table, each rate also against ours on one rank."""
    base = next((row[2] for row in rows if row[1] == 1 and row[0].startswith("mpi4dl")), rows[0][2])
    table = Table(["method", ">ranks", f">{rate}", ">vs ours on 1 rank", f">{difference}"])
    for name, ranks, value, diff in rows:
        table.add(name, ranks, format(value, rate_format), f"{value / base:.2f}x", f"{diff:.2e}")
    print(table.markdown())
