"""Volume inference on spatial ranks == the 3-D U-Net on the whole volume in one process; memory flat in the volume.

Usage: python -m tests.mpi.volume_infer SLICE_METHOD (ranks = its D*R*C). Named checks (every rank), each
``<check> on <grid>``: EXACT (a float64 run over a volume of 4x the window's voxels, NIfTI outputs: probabilities
within 1e-9 of the whole-volume network, labels their argmax, voxel size in the header) and MEMORY (float32 runs
at the same window over that volume and one 4x larger, TIFF outputs: no rank's peak grows more than 1.3x; ImageJ
spacing written, float32 probabilities within 1e-6 of the float64 whole-volume network) and WHOLE (a swinunetr3d,
whose every voxel depends on the whole volume, run as one window split over the grid: float64 probabilities within
1e-10 of one process's forward over the whole volume, labels their argmax).
The serial test (tests/infer/test_volume_infer.py) runs the same checks in one process.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import mpi4dl_nb as dl
from mpi4dl_nb.infer.fully_conv import fully_convolutional
from mpi4dl_nb.models.unet3d import unet3d
from tests.support.checks import Checks, run_checks

EXACT = "a volume of 4x the window's voxels equals the whole-volume network (float64, 1e-9)"
MEMORY = "no rank's peak memory grows more than 1.3x on a 4x larger volume at a fixed window"
WHOLE = "a swinunetr3d runs as one window over the whole volume and equals one process's forward (float64, 1e-10)"
TOLERANCE = 1e-9
WHOLE_TOLERANCE = 1e-10
WHOLE_VOLUME = (16, 16, 32)               # 1x1x2 tiles of 16^3: the shifted windows straddle the seam
GROWTH = 1.3
CLASSES = 3
VOXEL_SIZE = (2.0, 0.5, 0.25)             # µm (z, y, x): anisotropic, so an axis mix-up shows
WINDOW_INPUT = (32, 32, 32)               # a window's input voxels (all ranks): the U-Net's field is 18 voxels
SMALL = (32, 64, 64)                      # 4x the window's voxels
LARGE = (32, 128, 128)                    # 4x the small volume


def network() -> list[torch.nn.Module]:
    """A one-level 3-D U-Net (BatchNorm with random running statistics, transposed up-sampling), float64."""
    torch.manual_seed(0)
    layers = [layer.double().eval() for layer in unet3d(1, 2, CLASSES, in_channels=1, upsampling="transposed")]
    for module in torch.nn.Sequential(*layers).modules():
        if isinstance(module, torch.nn.BatchNorm3d):
            module.running_mean.uniform_(-0.2, 0.2)
            module.running_var.uniform_(0.5, 1.5)
    return layers


def volume(shape: tuple[int, int, int], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((1, *shape))


def whole_volume(vol: np.ndarray) -> np.ndarray:
    """The class probabilities of the network on the whole volume, one process."""
    net = fully_convolutional(network(), None, channels=1)
    with torch.no_grad():
        return net(torch.from_numpy(vol)[None])[0].numpy()


def window_per_rank(grid: tuple[int, int, int]) -> tuple[int, int, int]:
    d, h, w = (size // parts for size, parts in zip(WINDOW_INPUT, grid))
    return (d, h, w)


def run(ctx, slice_method: str, vol: np.ndarray, output: Path, dtype: str) -> dict | None:
    """``dl.infer_volume`` computing in ``dtype`` and storing the probabilities in it."""
    grid = tuple(int(n) for n in slice_method.split("x"))
    return dl.infer_volume(network(), dl_volume(vol), output, ctx=ctx, num_spatial_parts=int(np.prod(grid)),
                           slice_method=slice_method, window=window_per_rank((grid[0], grid[1], grid[2])),
                           dtype=dtype, probability_dtype=dtype, overwrite=True)


def dl_volume(vol: np.ndarray):
    from mpi4dl_nb.infer.volume_source import ArrayVolume

    return ArrayVolume(vol, VOXEL_SIZE, "random volume")


def check_exact(summary: dict, vol: np.ndarray, out: Path) -> str:
    """Rank 0: the NIfTI probabilities and labels of a float64 run against the whole-volume network."""
    import nibabel

    want = whole_volume(vol)
    got = np.stack([np.asarray(nibabel.load(str(out.with_name(f"seg_prob{k}.nii"))).dataobj).transpose(2, 1, 0)
                    for k in range(CLASSES)])
    labels = nibabel.load(str(out))
    err = float(np.abs(got - want).max())
    assert got.shape == want.shape and err <= TOLERANCE, f"max |difference| {err:.2e} (shapes {got.shape})"
    assert np.array_equal(np.asarray(labels.dataobj).transpose(2, 1, 0), want.argmax(0)), "labels are not the argmax"
    zooms = tuple(float(z) for z in labels.header.get_zooms())
    assert zooms == VOXEL_SIZE[::-1] and labels.header.get_xyzt_units()[0] == "micron", zooms
    voxels, window = int(np.prod(vol.shape)), int(np.prod(WINDOW_INPUT))
    assert voxels == 4 * window and summary["windows"] > 1, (voxels, summary["windows"])
    return f"max |diff| {err:.1e} over {summary['windows']} windows {summary['window_grid']}"


def check_tiff(summary: dict, vol: np.ndarray, out: Path) -> None:
    """Rank 0: the TIFF stack of a run (float32 probabilities) and its ImageJ spacing."""
    import tifffile

    want = whole_volume(vol)
    with tifffile.TiffFile(out.with_name("seg_prob1.tif")) as tif:
        got = tif.asarray()
        meta = tif.imagej_metadata or {}
        x_res = tif.pages[0].tags["XResolution"].value
    assert abs(meta.get("spacing", 0) - VOXEL_SIZE[0]) < 1e-12 and meta.get("unit") == "um", meta
    assert abs(x_res[1] / x_res[0] - VOXEL_SIZE[2]) < 1e-6, x_res
    assert got.dtype == np.float32 and float(np.abs(got - want[1]).max()) < 1e-5
    top = np.sort(want, axis=0)
    clear = top[-1] - top[-2] > 1e-5          # float32 may swap near-ties of the float64 reference
    labels = tifffile.imread(out)
    assert np.array_equal(labels[clear], want.argmax(0)[clear]) and clear.mean() > 0.99


def exact_run(ctx, slice_method: str, where: Path) -> str:
    """EXACT: a float64 run over SMALL, NIfTI outputs; its detail (rank 0; "" elsewhere)."""
    small = volume(SMALL, 1)
    summary = run(ctx, slice_method, small, where / "exact" / "seg.nii", "float64")
    if ctx.rank != 0:
        return ""
    assert summary is not None
    return check_exact(summary, small, where / "exact" / "seg.nii")


def memory_run(ctx, slice_method: str, where: Path) -> str:
    """MEMORY: float32 runs (half the time of float64) at one window over SMALL and LARGE, TIFF outputs; per-rank
    peaks compared (rank 0)."""
    small = run(ctx, slice_method, volume(SMALL, 1), where / "small" / "seg.tif", "float32")
    large = volume(LARGE, 2)
    summary = run(ctx, slice_method, large, where / "large" / "seg.tif", "float32")
    if ctx.rank != 0:
        return ""
    assert small is not None and summary is not None and summary["memory_source"] == "heap", summary
    check_tiff(summary, large, where / "large" / "seg.tif")
    small_peaks, peaks = small["peak_memory_bytes"], summary["peak_memory_bytes"]
    grown = [b / max(a, 1) for a, b in zip(small_peaks, peaks)]
    assert len(grown) == ctx.world_size and max(grown) <= GROWTH, f"peaks {small_peaks} -> {peaks} bytes"
    return (f"peaks {[p // 1024 for p in small_peaks]} -> {[p // 1024 for p in peaks]} KiB "
            f"(x{max(grown):.2f}), {summary['windows']} windows")


def swin_network() -> list[torch.nn.Module]:
    """A small swinunetr3d (2 Swin stages, feature size 6), float64, eval mode."""
    from mpi4dl_nb.models.swinunetr3d import swinunetr3d

    torch.manual_seed(5)
    return [layer.double().eval() for layer in swinunetr3d(2, 6, CLASSES)]


def whole_run(ctx, slice_method: str, where: Path) -> str:
    """WHOLE: a float64 swinunetr3d run over WHOLE_VOLUME, NIfTI outputs, against one process's forward (rank 0)."""
    import nibabel

    vol = volume(WHOLE_VOLUME, 4)
    grid = tuple(int(n) for n in slice_method.split("x"))
    out = where / "whole" / "seg.nii"
    summary = dl.infer_volume(swin_network(), dl_volume(vol), out, ctx=ctx, num_spatial_parts=int(np.prod(grid)),
                              slice_method=slice_method, dtype="float64", probability_dtype="float64",
                              overwrite=True)
    if ctx.rank != 0:
        return ""
    per_rank = tuple(n // p for n, p in zip(WHOLE_VOLUME, grid))
    assert summary is not None and summary["windows"] == 1 and tuple(summary["window"]) == per_rank, summary
    net = torch.nn.Sequential(*swin_network(), torch.nn.Softmax(dim=1))
    with torch.no_grad():
        want = net(torch.from_numpy(vol)[None])[0].numpy()
    got = np.stack([np.asarray(nibabel.load(str(out.with_name(f"seg_prob{k}.nii"))).dataobj).transpose(2, 1, 0)
                    for k in range(CLASSES)])
    err = float(np.abs(got - want).max())
    assert got.shape == want.shape and err <= WHOLE_TOLERANCE, f"max |difference| {err:.2e} (shapes {got.shape})"
    labels = np.asarray(nibabel.load(str(out)).dataobj).transpose(2, 1, 0)
    assert np.array_equal(labels, want.argmax(0)), "labels are not the argmax"
    return f"max |diff| {err:.1e}, one window {summary['window']} per rank, peaks {summary['peak_memory_bytes']} B"


def check_all(check: Checks, ctx, slice_method: str, where: Path, suffix: str) -> None:
    with check(f"{WHOLE}{suffix}") as result:
        result.detail = whole_run(ctx, slice_method, where)
    with check(f"{EXACT}{suffix}") as result:
        result.detail = exact_run(ctx, slice_method, where)
    with check(f"{MEMORY}{suffix}") as result:
        result.detail = memory_run(ctx, slice_method, where)


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    slice_method = sys.argv[1]
    with tempfile.TemporaryDirectory() as scratch:
        where = Path(ctx.bcast_object(scratch if ctx.rank == 0 else None, root=0))
        check_all(check, ctx, slice_method, where, f" on {slice_method}")
        ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
