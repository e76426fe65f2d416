"""4 ranks share each window: the streamed output equals the whole-slide network in one process (float64).
Usage: python -m tests.mpi.infer_exact [CHECKPOINT SLIDE OUTDIR] [--backend=NAME]; without them (as the shared
launches of tests/infer/test_infer_mpi.py run it) rank 0 makes tests/infer/conftest.py's checkpoint and slide in a
folder of the job's own. Named checks (every rank):
SQUARE (the command, 2x2 grid, .npy + .tif), VERTICAL (dl.infer_slide, 1x4 grid, two windows per forward),
SEGMENTATION (the command on a U-Net checkpoint, 2x2 grid: probabilities, label map, polygons)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

import mpi4dl_nb as dl
from mpi4dl_nb.cli.infer_cmd import main as infer_main
from tests.support.checks import Checks, run_checks
from tests.support.infer_data import (
    make_checkpoint_alone,
    make_slide,
    relative_difference,
    tissue_image,
    unet_checkpoint,
    whole_reference,
    whole_slide_reference,
    write_slide,
)
from tests.support.planes import split_backend
from tests.support.scratch import shared_temp_folder

SQUARE = "command on a 2x2 grid equals the whole-slide network in one process"
VERTICAL = "infer_slide on a 1x4 grid, batched windows, equals the whole-slide network"
SEGMENTATION = "a U-Net on a 2x2 grid: probabilities equal the whole slide's, label map and polygons written"
TILES = "--map-mode tiles on 4 ranks: every cell the classifier on its lone tile, NaN where no whole tile"


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    backend, args = split_backend(sys.argv[1:])
    ctx = dl.init(backend=backend)
    if args:
        check_windows(check, ctx, Path(args[0]), Path(args[1]), Path(args[2]))
        return
    with shared_temp_folder(ctx, "infer-") as folder:
        if ctx.rank == 0:
            make_checkpoint_alone(folder / "ck")
            make_slide(folder / "slide.tif", 150, 330)
        ctx.barrier()
        check_windows(check, ctx, folder / "ck", folder / "slide.tif", folder)


def check_windows(check: Checks, ctx: dl.Context, checkpoint: Path, slide: Path, out: Path) -> None:
    """The four checks of ``checkpoint`` on ``slide``, their outputs written under ``out``."""
    reference = whole_slide_reference(checkpoint, slide) if ctx.rank == 0 else None

    with check(SQUARE) as result:
        code = infer_main(["--checkpoint", str(checkpoint), "--slide", str(slide), "--output", str(out / "sq.npy"),
                           "--output", str(out / "sq.tif"), "--num-spatial-parts", "4", "--slice-method", "square",
                           "--dtype", "float64", "--window", "64", "--no-progress"])
        assert code == 0, f"exit code {code}"
        if ctx.rank == 0:
            import openslide

            err = relative_difference(np.load(out / "sq.npy"), reference)
            assert err <= 1e-9, f"relative difference {err:.2e}"
            with openslide.OpenSlide(str(slide)) as source, openslide.OpenSlide(str(out / "sq.tif")) as heat:
                width, height = source.dimensions                       # the map covers the slide, 4 px a pixel
                assert heat.level_dimensions[0] == (-(-width // 4), -(-height // 4))
            result.detail = f"rel {err:.1e}"

    with check(VERTICAL) as result:
        summary = dl.infer_slide(checkpoint, slide, out / "v.npy", num_spatial_parts=4, slice_method="vertical",
                                 dtype="float64", window=96, batch_windows=2)
        if ctx.rank == 0:
            assert summary["grid"] == [1, 4] and summary["window_grid"][0] > 1
            assert len(summary["peak_memory_bytes"]) == 4
            err = relative_difference(np.load(out / "v.npy"), reference)
            assert err <= 1e-9, f"relative difference {err:.2e}"
            result.detail = f"rel {err:.1e}, {summary['windows']} windows"
        else:
            assert summary is None
    check_segmentation(check, ctx, out)
    with check(TILES) as result:
        code = infer_main(["--checkpoint", str(checkpoint), "--slide", str(slide), "--output", str(out / "t.npy"),
                           "--map-mode", "tiles", "--output-stride", "16", "--num-spatial-parts", "4",
                           "--dtype", "float64", "--no-progress"])
        assert code == 0, f"exit code {code}"
        if ctx.rank == 0:
            cells = np.load(out / "t.npy")
            expected = lone_tiles(checkpoint, slide, stride=16, shape=cells.shape)
            assert np.array_equal(np.isnan(cells), np.isnan(expected)), "no-data cells differ"
            err = relative_difference(np.nan_to_num(cells), np.nan_to_num(expected))
            assert err <= 1e-12, f"relative difference {err:.2e}"
            result.detail = f"rel {err:.1e}, {int(np.isfinite(cells[0]).sum())} tiles"
    ctx.barrier()


def check_segmentation(check: Checks, ctx: dl.Context, out: Path) -> None:
    """SEGMENTATION: the command on a small U-Net checkpoint and slide written under ``out``."""
    with check(SEGMENTATION) as result:
        dense = out / "dense"
        if ctx.rank == 0:
            dense.mkdir()
            unet_checkpoint(dense / "ck", mpp=0.5)
            write_slide(dense / "s.tif", tissue_image(160, 224), mpp=0.5)
        ctx.barrier()
        code = infer_main(["--checkpoint", str(dense / "ck"), "--slide", str(dense / "s.tif"), "--output",
                           str(dense / "m.npy"), "--output", str(dense / "m.tif"), "--output", str(dense / "m.geojson"),
                           "--num-spatial-parts", "4", "--dtype", "float64", "--window", "96", "--no-progress"])
        assert code == 0, f"exit code {code}"
        if ctx.rank == 0:
            import json

            import openslide

            err = relative_difference(np.load(dense / "m.npy"), whole_reference(dense / "ck", dense / "s.tif"))
            assert err <= 1e-9, f"relative difference {err:.2e}"
            with openslide.OpenSlide(str(dense / "m.tif")) as labels:
                assert labels.level_dimensions[0] == (224, 160)
            collection = json.loads((dense / "m.geojson").read_text())
            names = {f["properties"]["classification"]["name"] for f in collection["features"]}
            assert collection["type"] == "FeatureCollection" and names and names <= {"background", "tumor", "stroma"}
            result.detail = f"rel {err:.1e}, {len(collection['features'])} regions"


def lone_tiles(checkpoint: Path, slide: Path, *, stride: int, shape: tuple[int, ...]) -> np.ndarray:
    """The trained classifier on every whole tile of the slide, one at a time (float64), NaN elsewhere."""
    from mpi4dl_nb.infer.reader import SlideReader
    from mpi4dl_nb.infer.trained import load_network

    trained = load_network(str(checkpoint), dtype=torch.float64, output_stride=stride)
    net = torch.nn.Sequential(*trained.layers).eval()
    reader = SlideReader(slide)
    extent = trained.cell_extent
    out = np.full(shape, np.nan)
    for row in range(min(shape[1], (reader.height - extent) // stride + 1)):
        for col in range(min(shape[2], (reader.width - extent) // stride + 1)):
            pixels = reader.read((row * stride, row * stride + extent, col * stride, col * stride + extent))
            with torch.no_grad():
                logits = net(torch.from_numpy(pixels).permute(2, 0, 1)[None].double() / 255.0)
            out[:, row, col] = torch.softmax(logits, dim=1)[0].numpy()
    return out


if __name__ == "__main__":
    run_checks(main)
