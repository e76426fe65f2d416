"""MPI (4 ranks, 2x2 tiles): slide-level inference of whole-slide models equals one process (float64).

Rank 0 writes two synthetic slides (``data/synthetic_cohort.py``, 1 µm/px) and, for each of ``--pool attention``
and ``max``, a whole-slide checkpoint of a random ResNet v1 (BatchNorm running statistics random,
64 px canvas at 1 µm/px). Every rank runs ``CanvasNetwork.predict`` on 2x2 tiles of each canvas (slide reads
recorded), and for attention also the command's loop ``run_slide_level`` (slides.csv, the OME-TIFF maps). Rank 0
computes the reference independently, in one process: the network on the whole canvas, the softmax of its logits,
for attention the softmax over the whole canvas of the head's scores, for max the share of the non-constant
channels whose first maximum lies in each cell.

The same for a ResNet with a slide encoder (2 layers, 2 heads) before an attention pool, whose head runs on the cells
gathered from the tiles, its class-token attention map beside the pool's.

Checks, per pool (and ``--slide-encoder transformer --pool attention``): ``--pool P: each rank reads its
tile`` (its largest slide read is at most the 32 px tile);
``--pool P: probabilities equal one process`` (the gathered prediction and, for attention, slides.csv written with
repr: 1e-12); ``--pool P: map equals one process`` (attention and max: the gathered map, 1e-12; for attention also
the map read back from the slide-aligned OME-TIFF, float32, 1e-6, no data exactly where the canvas is not);
``--slide-encoder transformer --pool attention: class attention equals one process`` (its gathered map, 1e-12, and
its OME-TIFF, 1e-6).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

import mpi4dl_nb as dl
from mpi4dl_nb.checkpoint.files import CheckpointChoice
from mpi4dl_nb.data.canvas import CanvasPlacement, SlideCanvases
from mpi4dl_nb.data.synthetic_cohort import write_synthetic_cohort
from mpi4dl_nb.infer.attention_map import CLASS_MAP_NAME, MAP_NAMES, on_slide
from mpi4dl_nb.infer.job import InferJob
from mpi4dl_nb.infer.outputs.slide_level import SLIDES_CSV, map_paths
from mpi4dl_nb.infer.slide_level import open_canvas, run_slide_level
from mpi4dl_nb.infer.slide_list import SlideSource, slide_sources
from mpi4dl_nb.infer.whole_slide import CanvasNetwork, SlidePrediction, WholeSlideModel, load_whole_slide
from mpi4dl_nb.models.pools import PoolKind
from mpi4dl_nb.models.slide_encoder import SlideEncoderSpec
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.support.checks import Checks, run_checks
from tests.support.scratch import shared_temp_folder
from tests.support.slide_recorder import ReadRecorder
from tests.support.whole_slide_model import random_whole_slide

POOLS = ("attention", "max")   # tissue-mean: its first model build costs ~10 s a rank (meta probes); same code path
COMMAND = "attention"       # the pool run through the command's loop too (run_slide_level: slides.csv, OME-TIFF)
ENCODED = "--slide-encoder transformer --pool attention"     # a slide encoder before the pool (through the loop too)
ENCODER = SlideEncoderSpec(layers=2, heads=2)
CASES = (*POOLS, ENCODED)
Reference = tuple[np.ndarray, "np.ndarray | None", "np.ndarray | None"]   # probabilities, the pool's map, the class's
Gathered = tuple[str, CanvasPlacement, "SlidePrediction | None", "Reference | None"]
SIZE, MPP = 64, 1.0
TOLERANCE = 1e-12
GRID = TileGrid.from_slice_method("square", 4)


def class_reference(model: WholeSlideModel, canvases: SlideCanvases) -> np.ndarray | None:
    """One process, whole canvas: the slide encoder's class-token attention over the cells (None without one),
    from the attention weights recomputed from the last block's input."""
    encoder = model.encoder
    if encoder is None:
        return None
    image = canvases.read(0).to(torch.float64)[None]
    kept: list[torch.Tensor] = []
    hooks = [encoder.blocks[-1].register_forward_pre_hook(lambda module, inputs: kept.append(inputs[0])),
             encoder.register_forward_pre_hook(lambda module, inputs: kept.append(inputs[0]))]
    with torch.no_grad():
        torch.nn.Sequential(*model.layers)(image)
        cells, tokens = kept[0], kept[1]
        block = encoder.blocks[-1]
        q, k, _ = block.attention.qkv(block.norm1(tokens)).chunk(3, -1)
        heads = block.attention.heads
        q0 = q[0, 0].view(heads, -1)                            # the class token's query, per head
        keys = k[0].view(k.shape[1], heads, -1).transpose(0, 1)  # (heads, tokens, D)
        weights = torch.softmax((keys @ q0[..., None])[..., 0] / q0.shape[-1] ** 0.5, -1).mean(0)
    for hook in hooks:
        hook.remove()
    return weights[1:].view(cells.shape[-2:]).numpy()


def reference(model: WholeSlideModel, canvases: SlideCanvases) -> tuple[np.ndarray, np.ndarray | None]:
    """One process, whole canvas: the class probabilities and the map (None for tissue-mean)."""
    image = canvases.read(0).to(torch.float64)[None]
    pool = model.pool_module
    kept: list[torch.Tensor] = []                # what the pool is given: the trunk's cells (after any norm)
    hook = pool.register_forward_pre_hook(lambda module, inputs: kept.append(inputs[0])) if pool else None
    with torch.no_grad():
        probabilities = torch.softmax(torch.nn.Sequential(*model.layers)(image), 1)[0].numpy()
    if hook is not None:
        hook.remove()
    features = kept[0][0] if kept else torch.empty(0)
    if model.pool is PoolKind.ATTENTION:
        assert pool is not None
        with torch.no_grad():
            scores = pool.scores(features[None])[0, 0]
        return probabilities, torch.softmax(scores.flatten(), 0).view(scores.shape).numpy()
    if model.pool is PoolKind.MAX:
        flat = features.flatten(1)
        first = flat.argmax(1).numpy()          # the first maximum in row-major order
        informative = (flat.amax(1) > flat.amin(1)).numpy()
        counts = np.bincount(first[informative], minlength=flat.shape[1]).astype(np.float64)
        return probabilities, (counts / max(informative.sum(), 1)).reshape(features.shape[1:])
    return probabilities, None


def pool_of(case: str) -> str:
    return "attention" if case == ENCODED else case


def label_of(case: str) -> str:
    return case if case == ENCODED else f"--pool {case}"


def stored_error(stored: np.ndarray, cells: np.ndarray, placement: CanvasPlacement) -> float:
    """The largest difference of a map OME-TIFF's values from ``cells`` placed on the slide; its no-data pixels
    exactly where the canvas is not."""
    placed = on_slide(cells, placement).values
    assert stored.shape == placed.shape and (np.isnan(stored) == np.isnan(placed)).all()
    known = np.isfinite(placed)
    return float(np.abs(stored[known] - placed[known]).max())


def check_class_map(check: Checks, ctx: dl.Context, folder: Path, gathered: list[Gathered]) -> None:
    """The slide encoder's class-token map on 4 ranks, gathered and written, against one process."""
    import tifffile

    with check(f"{ENCODED}: class attention equals one process") as result:
        if ctx.rank == 0:
            worst = stored_worst = 0.0
            for stem, placement, prediction, expected in gathered:
                assert prediction is not None and expected is not None
                cells, wanted = prediction.class_cells, expected[2]
                assert cells is not None and wanted is not None and cells.shape == wanted.shape
                worst = max(worst, float(np.abs(cells - wanted).max()))
                tiff, _ = map_paths(folder, stem, CLASS_MAP_NAME)
                stored_worst = max(stored_worst, stored_error(tifffile.imread(tiff), wanted, placement))
            assert worst < TOLERANCE and stored_worst < 1e-6, (worst, stored_worst)
            result.detail = f"largest error {worst:.1e} (gathered), {stored_worst:.1e} (float32 OME-TIFF)"


def read_probabilities(table: Path) -> dict[str, np.ndarray]:
    import csv

    with table.open() as handle:
        return {row["slide"]: np.array([float(row[k]) for k in row if k.startswith("prob_")])
                for row in csv.DictReader(handle)}


def predict_recorded(ctx: dl.Context, network: CanvasNetwork, slides: list[SlideSource],
                     ) -> tuple[list[Gathered], list[int]]:
    """Every slide through ``network`` on the tiles, its reads recorded, beside the one-process reference on rank 0;
    the largest read of every rank."""
    model = network.model
    gathered: list[Gathered] = []
    recorders: list[ReadRecorder] = []

    def recording(path: Path) -> ReadRecorder:
        recorders.append(ReadRecorder.open(path))
        return recorders[-1]

    for slide in slides:
        canvases = open_canvas(model, slide, 0, MPP, None)
        canvases.close()                        # reopened through a recorder: only the canvas's reads
        canvases._opener = recording
        prediction = network.predict(canvases, 0)
        canvases.close()
        expected = None
        if ctx.rank == 0:                       # the reference reads its own, whole canvas
            whole = open_canvas(model, slide, 0, MPP, None)
            expected = (*reference(model, whole), class_reference(model, whole))
            whole.close()
        gathered.append((slide.path.stem, canvases.placements[0], prediction, expected))
    reads = [size for recorder in recorders for _, _, size in recorder.calls]
    return gathered, ctx.all_gather_object(max((max(size) for size in reads), default=0))


def check_case(check: Checks, ctx: dl.Context, root: Path, number: int, started: float) -> None:
    """One checkpoint of ``CASES`` on 2x2 tiles (and through the command's loop) against one process."""
    case = CASES[number]
    label, command = label_of(case), case in (COMMAND, ENCODED)
    manifest = str(root / "cohort" / "cohort.csv")
    job = InferJob(CheckpointChoice(str(root / f"c-{number}")), outputs=(str(root / f"out-{number}"),),
                   cohort=manifest, num_spatial_parts=4, dtype="float64")
    summary = run_slide_level(job.check(), ctx) if command else None
    model = load_whole_slide(job.checkpoint.checkpoint, torch.float64)
    slides = slide_sources(manifest, model.classes)
    gathered, largest = predict_recorded(ctx, CanvasNetwork(model, GRID, ctx, torch.float64), slides)
    with check(f"{label}: each rank reads its tile") as result:
        if ctx.rank == 0:       # 32 px tiles of the 64 px canvas
            assert 0 < max(largest) <= SIZE // 2, largest
            result.detail = f"largest read per rank {largest} px"
    with check(f"{label}: probabilities equal one process") as result:
        if ctx.rank == 0:
            errors = [float(np.abs(prediction.probabilities - expected[0]).max())
                      for _, _, prediction, expected in gathered if prediction is not None and expected]
            if command:
                assert summary is not None and not summary.failed, summary
                written = read_probabilities(job.output_folder / SLIDES_CSV)
                errors += [float(np.abs(written[stem] - expected[0]).max())
                           for stem, _, _, expected in gathered if expected is not None]
            assert len(errors) == len(slides) * (2 if command else 1), errors
            assert max(errors) < TOLERANCE, errors
            result.detail = (f"largest error {max(errors):.1e} over {len(slides)} slides"
                             f"{' (and slides.csv)' if command else ''}; "
                             f"{time.perf_counter() - started:.1f} s into the job")
    with check(f"{label}: map equals one process") as result:
        if ctx.rank == 0:
            import tifffile

            worst = stored_worst = 0.0
            for stem, placement, prediction, expected in gathered:
                assert prediction is not None and prediction.cells is not None and expected is not None
                assert expected[1] is not None and prediction.cells.shape == expected[1].shape
                worst = max(worst, float(np.abs(prediction.cells - expected[1]).max()))
                if command:
                    tiff, _ = map_paths(job.output_folder, stem, MAP_NAMES[model.pool])
                    stored_worst = max(stored_worst, stored_error(tifffile.imread(tiff), expected[1], placement))
            assert worst < TOLERANCE and stored_worst < 1e-6, (worst, stored_worst)
            result.detail = f"largest error {worst:.1e} (gathered)" + (
                f", {stored_worst:.1e} (float32 OME-TIFF)" if command else "")
    if case == ENCODED:
        check_class_map(check, ctx, job.output_folder, gathered)


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    started = time.perf_counter()
    with shared_temp_folder(ctx, "whole-slide-infer-") as folder:
        root = Path(folder)
        if ctx.rank == 0:
            write_synthetic_cohort(root / "cohort", slides=2, side_um=80.0, mpp=MPP, levels=2)
            for number, case in enumerate(CASES):
                random_whole_slide(root / f"c-{number}", pool_of(case), SIZE, MPP, seed=number,
                                   encoder=ENCODER if case == ENCODED else None)
        ctx.barrier()
        for number in range(len(CASES)):
            check_case(check, ctx, root, number, started)


if __name__ == "__main__":
    run_checks(main)
