"""Dense (segmentation) slide inference side by side: ``python -m mpi4dl_nb infer`` with a U-Net on 1 and 4 ranks vs
MONAI's ``sliding_window_inference`` (overlap 0.25, Gaussian blending), same network, same slide.

Per run: megapixels/s and the largest difference of the per-pixel probabilities to the reference,
the U-Net on the whole slide in one process (ours: float round-off; MONAI's: the seam error of
ROIs that pad at their own edges, blended). MONAI runs in its own pinned environment, a venv
(``--monai-venv``, default ``.bench-venv``) made on first use with
``python -m venv DIR`` + ``DIR/bin/pip install --no-deps monai==1.6.1``; it sees the project's
torch 2.14.1 and numpy through a ``.pth`` file and adds only MONAI (the project's venv is never
changed). The benchmark runs MONAI as a subprocess in that venv.

    python benchmarks/bench_infer_dense.py --size 1024 --roi 256 --ranks 1 4
"""
from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from bench_infer import synthetic_slide
from bench_infer_memory import unet_checkpoint
from support.machine import Footer
from support.monai_peer import (
    MONAI_ROW,
    add_peer_arguments,
    child_environment,
    max_difference,
    monai_result,
    ours,
    print_side_by_side,
    ran_internal_part,
)


def network(checkpoint: Path, dtype: str):
    import torch

    from mpi4dl_nb.infer.trained import load_network

    return load_network(str(checkpoint), dtype=getattr(torch, dtype)).net


def whole_slide(slide: Path, align: int) -> np.ndarray:
    from mpi4dl_nb.infer.reader import SlideReader
    from mpi4dl_nb.infer.windows import padded_extent

    reader = SlideReader(slide)
    return reader.read((0, padded_extent(reader.height, align), 0, padded_extent(reader.width, align)))


def reference(checkpoint: Path, slide: Path, out: Path, dtype: str) -> None:
    """The U-Net on the whole slide in one process."""
    import torch

    torch.set_num_threads(1)
    net = network(checkpoint, dtype)
    x = torch.from_numpy(whole_slide(slide, math.lcm(net.shape.stride, net.shape.align))).permute(2, 0, 1)[None]
    with torch.no_grad():
        np.save(out, net(x.to(getattr(torch, dtype)).div_(255.0))[0].numpy())


def monai_run(checkpoint: Path, slide: Path, out: Path, roi: int, dtype: str) -> dict[str, float]:
    """MONAI's sliding window (Gaussian blending, overlap 0.25) of the same U-Net over the whole slide tensor."""
    import torch
    from monai.inferers import sliding_window_inference

    torch.set_num_threads(1)
    net = network(checkpoint, dtype)
    start = time.perf_counter()
    pixels = whole_slide(slide, math.lcm(net.shape.stride, net.shape.align))
    x = torch.from_numpy(pixels).permute(2, 0, 1)[None].to(getattr(torch, dtype)).div_(255.0)
    with torch.no_grad():
        y = sliding_window_inference(x, roi_size=(roi, roi), sw_batch_size=1, predictor=net, overlap=0.25,
                                     mode="gaussian")
    seconds = time.perf_counter() - start
    np.save(out, y[0].numpy())
    return {"seconds": seconds, "megapixels_per_s": pixels.shape[0] * pixels.shape[1] / 1e6 / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024, help="side of the slide (pixels)")
    parser.add_argument("--roi", type=int, default=256, help="our --window and MONAI's ROI side")
    add_peer_arguments(parser, "bench_infer_dense", [1, 4])
    args = parser.parse_args()
    if ran_internal_part(args, sys.modules[__name__], args.roi):
        return
    footer = Footer()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    env = child_environment()
    checkpoint = unet_checkpoint(work / "unet", args.dtype)
    slide = work / f"synthetic-{args.size}.tif"
    if not slide.exists():
        synthetic_slide(slide, args.size)
    me = [str(Path(__file__).resolve()), "--roi", str(args.roi), "--dtype", args.dtype, "--checkpoint",
          str(checkpoint), "--slide", str(slide)]
    ref_path = work / f"reference-{args.size}-{args.dtype}.npy"
    if not ref_path.exists():
        subprocess.run([sys.executable, *me, "--internal", "reference", "--out", str(ref_path)], check=True, env=env)
    ref = np.load(ref_path)
    print(f"U-Net depth 2 x 8, 3 classes; slide {args.size} x {args.size} px, {args.dtype}, window/ROI {args.roi} px; "
          f"reference: the U-Net on the whole slide in one process\n")
    rows = []
    if not args.skip_monai:
        out = work / "monai.npy"
        result = monai_result(args.monai_venv, me, out, env)
        rows.append((MONAI_ROW, 1, float(result["megapixels_per_s"]), max_difference(out, ref)))
    for ranks in args.ranks:
        out = work / f"ours-{ranks}.npy"
        result = ours(ranks, checkpoint, slide, out, args.roi, args.dtype)
        grid = result["grid"]
        assert isinstance(grid, list)
        rows.append((f"mpi4dl_nb infer ({grid[0]}x{grid[1]} ranks per window)", ranks,
                     float(str(result["megapixels_per_s"])), max_difference(out, ref)))
    print_side_by_side(rows, "MP/s", ".3f", "max |p - whole slide|")
    footer.print()


if __name__ == "__main__":
    main()
