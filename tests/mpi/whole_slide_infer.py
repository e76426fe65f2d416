"""MPI (4 ranks, 2x2 tiles): slide-level inference of whole-slide models equals one process (float64).

Rank 0 writes two synthetic slides (``data/synthetic_cohort.py``, 1 µm/px) and, for each of ``--pool attention``,
``max`` and ``tissue-mean``, a whole-slide checkpoint of a random ResNet v1 (BatchNorm running statistics random,
64 px canvas at 1 µm/px); every rank runs ``run_slide_level`` on 2x2 tiles of the canvas (each rank reads its 32 px
tile). Rank 0 computes the reference independently, in one process: the network on the whole canvas, the softmax of
its logits, for attention the softmax over the whole canvas of the head's scores, for max the share of channels
whose first maximum lies in each cell.

Checks, per pool: ``--pool P: probabilities equal one process`` (slides.csv, written with repr, 1e-12);
``--pool P: map equals one process`` (attention and max: the map gathered by ``CanvasNetwork.predict``, 1e-12;
the map read back from the slide-aligned OME-TIFF, float32, 1e-6, no data exactly where the canvas is not).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import mpi4dl_nb as dl
from mpi4dl_nb.data.canvas import SlideCanvases
from mpi4dl_nb.data.synthetic_cohort import write_synthetic_cohort
from mpi4dl_nb.infer.attention_map import MAP_NAMES, on_slide
from mpi4dl_nb.infer.slide_level import SlideLevelSettings, open_canvas, run_slide_level, slide_sources
from mpi4dl_nb.infer.slide_outputs import SLIDES_CSV, map_paths
from mpi4dl_nb.infer.whole_slide import CanvasNetwork, WholeSlideModel, load_whole_slide
from mpi4dl_nb.models.pools import PoolKind
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.support.checks import Checks, run_checks
from tests.support.scratch import shared_temp_folder
from tests.support.whole_slide_model import random_whole_slide

POOLS = ("attention", "max", "tissue-mean")
SIZE, MPP = 64, 1.0
TOLERANCE = 1e-12


def reference(model: WholeSlideModel, canvases: SlideCanvases) -> tuple[np.ndarray, np.ndarray | None]:
    """One process, whole canvas: the class probabilities and the map (None for tissue-mean)."""
    image = canvases.read(0).to(torch.float64)[None]
    layers = list(model.layers)
    with torch.no_grad():
        probabilities = torch.softmax(torch.nn.Sequential(*layers)(image), 1)[0].numpy()
        head = model.head
        features = head.relu(head.norm(torch.nn.Sequential(*layers[:-1])(image)))[0]
    if model.pool is PoolKind.ATTENTION:
        with torch.no_grad():
            scores = head.pool.scores(features[None])[0, 0]
        return probabilities, torch.softmax(scores.flatten(), 0).view(scores.shape).numpy()
    if model.pool is PoolKind.MAX:
        flat = features.flatten(1)
        first = flat.argmax(1).numpy()          # the first maximum in row-major order
        informative = (flat.amax(1) > flat.amin(1)).numpy()
        counts = np.bincount(first[informative], minlength=flat.shape[1]).astype(np.float64)
        return probabilities, (counts / max(informative.sum(), 1)).reshape(features.shape[1:])
    return probabilities, None


def read_probabilities(table: Path) -> dict[str, np.ndarray]:
    import csv

    with table.open() as handle:
        return {row["slide"]: np.array([float(row[k]) for k in row if k.startswith("prob_")])
                for row in csv.DictReader(handle)}


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    grid = TileGrid.from_slice_method("square", 4)
    with shared_temp_folder(ctx, "whole-slide-infer-") as folder:
        root = Path(folder)
        if ctx.rank == 0:
            write_synthetic_cohort(root / "cohort", slides=2, side_um=80.0, mpp=MPP, levels=2)
            for number, pool in enumerate(POOLS):
                random_whole_slide(root / f"c-{pool}", pool, SIZE, MPP, seed=number)
        ctx.barrier()
        manifest = str(root / "cohort" / "cohort.csv")
        for pool in POOLS:
            settings = SlideLevelSettings(checkpoint=str(root / f"c-{pool}"), slides=manifest,
                                          output=root / f"out-{pool}", num_spatial_parts=4, dtype="float64")
            summary = run_slide_level(settings, ctx)
            model = load_whole_slide(settings.checkpoint, torch.float64)
            network = CanvasNetwork(model, grid, ctx, torch.float64)
            slides = slide_sources(manifest, model.classes)
            gathered = []
            for slide in slides:
                canvases = open_canvas(model, slide, 0, MPP, None)
                gathered.append((slide.path.stem, canvases.placements[0], network.predict(canvases, 0),
                                 reference(model, canvases) if ctx.rank == 0 else None))
                canvases.close()
            with check(f"--pool {pool}: probabilities equal one process") as result:
                if ctx.rank == 0:
                    assert summary is not None and not summary.failed, summary
                    written = read_probabilities(settings.output / SLIDES_CSV)
                    errors = [float(np.abs(written[stem] - expected[0]).max()) for stem, _, _, expected in gathered
                              if expected is not None]
                    assert len(errors) == len(slides) and max(errors) < TOLERANCE, errors
                    result.detail = f"largest error {max(errors):.1e} over {len(errors)} slides (slides.csv)"
            if pool == "tissue-mean":
                continue
            with check(f"--pool {pool}: map equals one process") as result:
                if ctx.rank == 0:
                    import tifffile

                    worst = stored_worst = 0.0
                    for stem, placement, prediction, expected in gathered:
                        assert prediction is not None and prediction.cells is not None and expected is not None
                        assert expected[1] is not None and prediction.cells.shape == expected[1].shape
                        worst = max(worst, float(np.abs(prediction.cells - expected[1]).max()))
                        tiff, _ = map_paths(settings.output, stem, MAP_NAMES[model.pool])
                        stored = tifffile.imread(tiff)
                        placed = on_slide(expected[1], placement).values
                        assert stored.shape == placed.shape and (np.isnan(stored) == np.isnan(placed)).all()
                        known = np.isfinite(placed)
                        stored_worst = max(stored_worst, float(np.abs(stored[known] - placed[known]).max()))
                    assert worst < TOLERANCE and stored_worst < 1e-6, (worst, stored_worst)
                    result.detail = f"largest error {worst:.1e} (gathered), {stored_worst:.1e} (float32 OME-TIFF)"


if __name__ == "__main__":
    run_checks(main)
