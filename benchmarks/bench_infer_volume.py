"""Dense volume inference side by side: ``dl.infer_volume`` with a 3-D U-Net (or ``--model swinunetr3d``: one window,
the whole volume split over the ranks) on 1 and 2 ranks vs MONAI's 3-D ``sliding_window_inference`` (overlap 0.25,
Gaussian blending), same weights, same volume.

Per run: voxels/s and the seam error, the largest difference of the per-voxel probabilities to
the reference (the U-Net on the whole volume in one process): ours is float round-off, MONAI's
comes from ROIs that pad at their own edges, blended. MONAI runs in its own venv (``--monai-venv``,
made on first use as for bench_infer_dense.py: ``benchmarks/support/monai_peer.py``). Our runs
are ``mpiexec -n R`` of this script's ``--internal ours`` part (the window cut 1x1xR); the U-Net
is built in Python (seeded weights, drawn BatchNorm statistics) and saved once, so every part
loads the same weights.

    python benchmarks/bench_infer_volume.py --size 48,96,96 --window 48,48,48 --ranks 1 2
    python benchmarks/bench_infer_volume.py --model swinunetr3d --size 32,64,64 --window 32,32,32 --ranks 1 2
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from support.launch import run_job
from support.machine import REPO, Footer
from support.monai_peer import MONAI_ROW, MONAI_SPEC, child_environment, monai_result, print_side_by_side

CLASSES = 3


def sides(text: str) -> tuple[int, int, int]:
    d, h, w = (int(v) for v in text.split(","))
    return (d, h, w)


MODELS = ("unet3d", "swinunetr3d")
DEFAULT_WIDTH = {"unet3d": 4, "swinunetr3d": 6}      # swinunetr3d's feature size is a multiple of 3


def layers(model: str, depth: int, width: int, dtype: str):
    """The 3-D U-Net (BatchNorm, trilinear up-sampling; ``depth`` levels) or the swinunetr3d (``depth`` Swin stages,
    feature size ``width``) with seeded weights, the U-Net's running statistics drawn."""
    import torch

    from mpi4dl_nb.models.swinunetr3d import swinunetr3d
    from mpi4dl_nb.models.unet3d import unet3d

    torch.manual_seed(0)
    if model == "swinunetr3d":
        return [layer.to(getattr(torch, dtype)).eval() for layer in swinunetr3d(depth, width, CLASSES)]
    built = unet3d(depth, width, CLASSES, in_channels=1)
    with torch.no_grad():
        for module in torch.nn.Sequential(*built).modules():
            if isinstance(module, torch.nn.BatchNorm3d):
                module.running_mean.uniform_(-0.2, 0.2)
                module.running_var.uniform_(0.5, 1.5)
    return [layer.to(getattr(torch, dtype)).eval() for layer in built]


def fcn(model: str, depth: int, width: int, dtype: str):
    """The network with its softmax, as inference runs it (a swinunetr3d as one window over the whole volume)."""
    from mpi4dl_nb.infer.fully_conv import fully_convolutional
    from mpi4dl_nb.infer.whole_volume import whole_volume_network

    if model == "swinunetr3d":
        return whole_volume_network(layers(model, depth, width, dtype))
    return fully_convolutional(layers(model, depth, width, dtype), None, channels=1)


def synthetic_volume(path: Path, size: tuple[int, int, int]) -> None:
    """Blobs on a noisy background (a smooth field thresholded), in [0, 1]."""
    rng = np.random.default_rng(0)
    coarse = rng.random(tuple(max(2, s // 8) for s in size))
    field = coarse.repeat(8, 0).repeat(8, 1).repeat(8, 2)[:size[0], :size[1], :size[2]]
    np.save(path, (0.7 * field + 0.3 * rng.random(size))[None])


def as_input(volume: np.ndarray, dtype: str):
    import torch

    return torch.from_numpy(volume)[None].to(getattr(torch, dtype))


def reference(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    with torch.no_grad():
        out = fcn(args.model, args.depth, args.width, args.dtype)(as_input(np.load(args.volume), args.dtype))
    np.save(args.out, out[0].double().numpy())


def monai_run(args: argparse.Namespace) -> dict[str, float]:
    """MONAI's sliding window over the whole volume tensor, ROI = our window, Gaussian blending."""
    import torch
    from monai.inferers import sliding_window_inference

    torch.set_num_threads(1)
    net = fcn(args.model, args.depth, args.width, args.dtype)
    start = time.perf_counter()
    volume = np.load(args.volume)
    with torch.no_grad():
        y = sliding_window_inference(as_input(volume, args.dtype), roi_size=args.window, sw_batch_size=1,
                                     predictor=net, overlap=0.25, mode="gaussian")
    seconds = time.perf_counter() - start
    np.save(args.out, y[0].double().numpy())
    return {"seconds": seconds, "voxels_per_s": volume[0].size / seconds}


def ours_run(args: argparse.Namespace) -> None:
    """One rank of ``mpiexec -n R``: ``dl.infer_volume`` on a 1x1xR grid; rank 0 saves the probabilities."""
    import nibabel
    import torch

    import mpi4dl_nb as dl

    torch.set_num_threads(1)
    ctx = dl.init()
    ranks = ctx.world_size
    d, h, w = args.window
    network = layers(args.model, args.depth, args.width, args.dtype)
    summary = dl.infer_volume(network, np.load(args.volume), args.out / "seg.nii", ctx=ctx, num_spatial_parts=ranks,
                              slice_method=f"1x1x{ranks}", window=(d, h, max(1, w // ranks)), dtype=args.dtype,
                              probability_dtype=args.dtype, overwrite=True)
    if summary is not None:
        probs = np.stack([np.asarray(nibabel.load(str(args.out / f"seg_prob{k}.nii")).dataobj).transpose(2, 1, 0)
                          for k in range(CLASSES)])
        np.save(args.out / "probabilities.npy", probs.astype(np.float64))
        print(json.dumps(summary), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=sides, default=(48, 96, 96), help="D,H,W of the volume (voxels)")
    parser.add_argument("--window", type=sides, default=(48, 48, 48),
                        help="D,H,W: our window's input (split over the ranks along W) and MONAI's ROI")
    parser.add_argument("--model", choices=MODELS, default="unet3d",
                        help="unet3d (streamed in windows) or swinunetr3d (one window: the whole volume)")
    parser.add_argument("--depth", type=int, help="U-Net levels (default 1) or Swin stages (default 2)")
    parser.add_argument("--width", type=int, help="U-Net channels of the first level (default 4) or swinunetr3d's "
                                                  "feature size (default 6)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--workdir", type=Path, default=REPO / "out" / "bench_infer_volume")
    parser.add_argument("--monai-venv", type=Path, default=REPO / ".bench-venv",
                        help=f"MONAI's own environment ({MONAI_SPEC}; made on first use)")
    parser.add_argument("--skip-monai", action="store_true")
    parser.add_argument("--internal", choices=("monai", "reference", "ours"), help=argparse.SUPPRESS)
    parser.add_argument("--volume", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.depth = args.depth or (2 if args.model == "swinunetr3d" else 1)
    args.width = args.width or DEFAULT_WIDTH[args.model]
    if args.internal == "monai":
        print(json.dumps(monai_run(args)))
        return
    if args.internal == "reference":
        reference(args)
        return
    if args.internal == "ours":
        ours_run(args)
        return
    footer = Footer()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    env = child_environment()
    size = "x".join(map(str, args.size))
    volume = work / f"volume-{size}.npy"
    if not volume.exists():
        synthetic_volume(volume, args.size)
    me = [str(Path(__file__).resolve()), "--window", ",".join(map(str, args.window)), "--dtype", args.dtype,
          "--model", args.model, "--depth", str(args.depth), "--width", str(args.width), "--volume", str(volume)]
    ref_path = work / f"reference-{args.model}-{size}-{args.dtype}-{args.depth}x{args.width}.npy"
    if not ref_path.exists():
        subprocess.run([sys.executable, *me, "--internal", "reference", "--out", str(ref_path)], check=True, env=env)
    ref = np.load(ref_path)
    voxels = int(np.prod(args.size))
    network = (f"swinunetr3d {args.depth} Swin stages, feature size {args.width}" if args.model == "swinunetr3d"
               else f"3-D U-Net depth {args.depth} x {args.width}")
    print(f"{network}, {CLASSES} classes; volume {size} voxels ({voxels / 1e6:.2f} "
          f"M), {args.dtype}, window/ROI {'x'.join(map(str, args.window))}; reference: the network on the whole "
          f"volume in one process\n")
    rows = []
    if not args.skip_monai:
        out = work / f"monai-{args.model}.npy"
        result = monai_result(args.monai_venv, me, out, env)
        rows.append((MONAI_ROW, 1, float(result["voxels_per_s"]), float(np.abs(np.load(out) - ref).max())))
    for ranks in args.ranks:
        out = work / f"ours-{args.model}-{ranks}"
        out.mkdir(exist_ok=True)
        result = json.loads(run_job(ranks, [sys.executable, *me, "--internal", "ours", "--out", str(out)],
                                    extra_env=env).stdout.strip().splitlines()[-1])
        grid = "x".join(map(str, result["grid"]))
        rows.append((f"mpi4dl_nb infer_volume ({grid} ranks per window, {result['windows']} windows)", ranks,
                     float(result["voxels_per_s"]), float(np.abs(np.load(out / "probabilities.npy") - ref).max())))
    print_side_by_side(rows, "voxels/s", ",.0f", "max |p - whole volume|")
    footer.print()


if __name__ == "__main__":
    main()
