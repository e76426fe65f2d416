"""Whole-slide inference side by side: ``python -m mpi4dl_nb infer`` on 1, 2, 4 ranks vs MONAI's
``sliding_window_inference`` (overlap 0.25, Gaussian blending), same network, same slide.

Per run: megapixels/s, per-rank peak memory (heap bytes in use above the start, sampled the same
way for both), and the largest difference to the whole-slide reference (the fully convolutional
network run on the whole slide level in one process): ours should be float round-off, MONAI's is
the seam error of tiles that pad at their own edges. ``--big N`` also streams an N x N synthetic
slide end to end (ours only: MONAI holds the whole slide in memory).

MONAI is installed into its own environment (``--monai-venv``, default ``.bench-venv``): a venv
that sees the project's packages through a ``.pth`` file and adds ``monai`` only; the project's
environment is never changed.

    python benchmarks/bench_infer.py --size 2048 --window 256 --ranks 1 2 4 [--big 20000]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from support.machine import Footer
from support.monai_peer import (
    add_peer_arguments,
    child_environment,
    max_difference,
    ours,
    peer_python,
    ran_internal_part,
)
from support.tables import Table


# ----------------------------------------------------------------------------- data
def synthetic_slide(path: Path, size: int, tile: int = 256, seed: int = 0) -> Path:
    """A ``size x size`` pyramidal JPEG TIFF of stained-looking tissue blobs on glass, written tile by tile."""
    import tifffile

    rng = np.random.default_rng(seed)
    cells = max(4, size // 512)
    field = rng.random((cells + 2, cells + 2))
    for _ in range(2):   # smooth blobs
        field = (field + sum(np.roll(field, shift, axis) for shift in (1, -1) for axis in (0, 1))) / 5

    def level_tiles(side: int) -> object:
        scale = size / side
        for y in range(0, side, tile):
            for x in range(0, side, tile):
                ys = (np.arange(y, min(y + tile, side)) * scale / 512.0)[:, None]
                xs = (np.arange(x, min(x + tile, side)) * scale / 512.0)[None, :]
                iy, ix = ys.astype(int), xs.astype(int)
                fy, fx = ys - iy, xs - ix
                blob = (field[iy, ix] * (1 - fy) * (1 - fx) + field[iy + 1, ix] * fy * (1 - fx)
                        + field[iy, ix + 1] * (1 - fy) * fx + field[iy + 1, ix + 1] * fy * fx)
                tissue = np.clip((blob - 0.45) * 8, 0, 1)
                noise = np.random.default_rng(y * 7919 + x + side).random(tissue.shape)
                stain = np.stack([230 - 90 * tissue - 30 * noise * tissue, 230 - 150 * tissue,
                                  235 - 60 * tissue - 40 * noise * tissue], axis=-1)
                yield np.clip(stain, 0, 255).astype(np.uint8)

    sides = [size]
    while sides[-1] > 2048:
        sides.append(sides[-1] // 4)
    with tifffile.TiffWriter(path, bigtiff=size * size * 3 > 2**31) as tw:
        for index, side in enumerate(sides):
            tw.write(level_tiles(side), shape=(side, side, 3), dtype=np.uint8, tile=(tile, tile),
                     compression="jpeg", photometric="rgb", subfiletype=1 if index else 0, metadata=None)
    return path


def make_checkpoint(folder: Path, env: dict[str, str]) -> Path:
    """A small ResNet v1 trained 2 steps on the bundled tissue sample (one process)."""
    if not list(folder.glob("step-*.pt")):
        subprocess.run([sys.executable, "-m", "mpi4dl_nb", "train", "--model", "resnet", "--resnet-version", "1",
                        "--num-layers", "8", "--num-filters", "8", "--image-size", "64", "--batch-size", "4",
                        "--split-size", "1", "--spatial-size", "0", "--app", "medical", "--num-classes", "2",
                        "--steps", "2", "--no-progress", "--checkpoint-dir", str(folder)],
                       check=True, env=env, stdout=subprocess.DEVNULL)
    return folder


# ------------------------------------------------------------------------- the runs
def network(checkpoint: Path, dtype: str):
    import torch

    from mpi4dl_nb.infer.fully_conv import fully_convolutional
    from mpi4dl_nb.infer.model import load_layers

    layers, description = load_layers(checkpoint, dtype=getattr(torch, dtype))
    return fully_convolutional(layers, description.image_size), description


def whole_slide(reader, shape) -> np.ndarray:
    """The slide level zero-extended as ``infer`` sees it."""
    import math

    from mpi4dl_nb.infer.windows import padded_extent

    unit = math.lcm(shape.stride, shape.align)
    height, width = padded_extent(reader.height, unit), padded_extent(reader.width, unit)
    return reader.read((0, height, 0, width))


def reference(checkpoint: Path, slide: Path, out: Path, dtype: str) -> None:
    """The whole-slide FCN output in one process (the exactness reference)."""
    import torch

    from mpi4dl_nb.infer.reader import SlideReader

    torch.set_num_threads(1)
    net, _ = network(checkpoint, dtype)
    pixels = whole_slide(SlideReader(slide), net.shape)
    x = torch.from_numpy(pixels).permute(2, 0, 1)[None].to(getattr(torch, dtype)).div_(255.0)
    del pixels
    with torch.no_grad():
        np.save(out, net(x)[0].numpy())


def monai_run(checkpoint: Path, slide: Path, out: Path, roi: int, dtype: str) -> dict:
    """MONAI's sliding window over the whole slide tensor; the predictor is the same FCN, padded at the
    ROI's bottom/right so its cells line up with the ROI (output = ROI / stride: MONAI's zoom)."""
    import torch
    import torch.nn.functional as F
    from monai.inferers import sliding_window_inference

    from mpi4dl_nb.infer.reader import SlideReader
    from mpi4dl_nb.measure.heap import PeakMeter

    torch.set_num_threads(1)
    net, _ = network(checkpoint, dtype)
    stride, reach = net.shape.stride, net.shape.min_side - net.shape.stride

    def predictor(x: torch.Tensor) -> torch.Tensor:
        return net(F.pad(x, (0, reach, 0, reach)))

    meter = PeakMeter(torch.device("cpu"))
    meter.watch(net.modules())
    meter.start()
    start = time.perf_counter()
    reader = SlideReader(slide)
    pixels = whole_slide(reader, net.shape)
    x = torch.from_numpy(pixels).permute(2, 0, 1)[None].to(getattr(torch, dtype)).div_(255.0)
    del pixels
    meter.sample()
    with torch.no_grad():
        y = sliding_window_inference(x, roi_size=(roi, roi), sw_batch_size=1, predictor=predictor, overlap=0.25,
                                     mode="gaussian")
    meter.sample()
    seconds = time.perf_counter() - start
    np.save(out, y[0].numpy())
    return {"seconds": seconds, "megapixels_per_s": reader.height * reader.width / 1e6 / seconds,
            "peak_memory_bytes": [meter.peak], "stride": stride}


# ----------------------------------------------------------------------------- main
def fmt_mb(values: list[int]) -> str:
    return " / ".join(f"{v / 2**20:.0f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2048, help="side of the comparison slide (pixels)")
    parser.add_argument("--window", type=int, default=256, help="our --window and MONAI's ROI side per rank")
    parser.add_argument("--big", type=int, default=0, help="also stream a BIG x BIG synthetic slide on the most ranks")
    add_peer_arguments(parser, "bench_infer", [1, 2, 4])
    args = parser.parse_args()
    if ran_internal_part(args, sys.modules[__name__], args.window):
        return
    footer = Footer()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    env = child_environment()
    checkpoint = make_checkpoint(work / "ck", env)
    slide = work / f"synthetic-{args.size}.tif"
    if not slide.exists():
        synthetic_slide(slide, args.size)
    ref_path = work / f"reference-{args.size}-{args.dtype}.npy"
    me = [sys.executable, str(Path(__file__).resolve()), "--window", str(args.window), "--dtype", args.dtype,
          "--checkpoint", str(checkpoint), "--slide", str(slide)]
    if not ref_path.exists():
        subprocess.run([*me, "--internal", "reference", "--out", str(ref_path)], check=True, env=env)
    ref = np.load(ref_path)
    print(f"slide {args.size} x {args.size} px, {args.dtype}, window/ROI {args.window} px per rank; "
          f"reference: the FCN on the whole slide in one process, output {tuple(ref.shape)}\n")
    rows = []
    if not args.skip_monai:
        python = peer_python(args.monai_venv)
        out = work / "monai.npy"
        done = subprocess.run([str(python), *me[1:], "--internal", "monai", "--out", str(out)], check=True, env=env,
                              capture_output=True, text=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(("MONAI sliding_window_inference (overlap 0.25, gaussian)", 1, result["megapixels_per_s"],
                     result["peak_memory_bytes"], max_difference(out, ref)))
    for ranks in args.ranks:
        out = work / f"ours-{ranks}.npy"
        result = ours(ranks, checkpoint, slide, out, args.window, args.dtype)
        rows.append((f"mpi4dl_nb infer ({result['grid'][0]}x{result['grid'][1]} ranks per window)", ranks,
                     result["megapixels_per_s"], result["peak_memory_bytes"], max_difference(out, ref)))
    base = next((r[2] for r in rows if r[1] == 1 and r[0].startswith("mpi4dl")), rows[0][2])
    table = Table(["method", ">ranks", ">MP/s", ">vs ours on 1 rank", "peak memory per rank (MB)",
                   ">max abs diff to whole-slide"])
    for name, ranks, rate, peaks, diff in rows:
        table.add(name, ranks, f"{rate:.3f}", f"{rate / base:.2f}x", fmt_mb(peaks), f"{diff:.2e}")
    print(table.markdown())
    if args.big:
        big = work / f"synthetic-{args.big}.tif"
        if not big.exists():
            start = time.perf_counter()
            synthetic_slide(big, args.big)
            print(f"\nwrote {big} in {time.perf_counter() - start:.0f} s")
        ranks = max(args.ranks)
        result = ours(ranks, checkpoint, big, work / "big.tif", args.window * 2, args.dtype, ("--tissue-only",))
        print(f"\n{args.big} x {args.big} px slide, {ranks} ranks, --window {args.window * 2} --tissue-only: "
              f"{result['seconds']:.0f} s, {result['megapixels_per_s']:.2f} MP/s, windows {result['windows']} "
              f"({result['skipped_background']} background skipped), peak memory per rank "
              f"{fmt_mb(result['peak_memory_bytes'])} MB, output {result['output_shape']} -> {work / 'big.tif'}")
    footer.print()


if __name__ == "__main__":
    main()
