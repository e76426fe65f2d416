# ---
# jupyter:
#   kernelspec:
#     display_name: Python (mpi4dl-nb)
#     language: python
#     name: mpi4dl-nb
# ---

# %% [markdown]
# # 09 — Segmentation on tiles: a U-Net on 4 ranks, exact, from masks to QuPath polygons
#
# Segmentation gives a class to every pixel, so the output is as large as the input: with every stage
# spatial, each rank keeps its tile from the first layer to the per-pixel loss, and no rank ever holds the
# whole image or the whole mask. Here a small U-Net learns a per-pixel label on 4 tiles, its losses and
# weights are checked against the same training in one process, and the trained network is run over a
# slide to give a label map and polygons that QuPath imports.
#
# **What you will learn**: how a segmentation run is set up (`--task segmentation --model unet`), why tiles
# give the serial per-pixel loss exactly, how to read the per-class Dice curve, and what `infer` writes for a
# segmentation checkpoint (a label map and GeoJSON polygons per class).
#
# **What you need**: notebooks 02 (halos) and 07 (inference over a slide); 4 MPI ranks (started below);
# about a minute.
#
# **The label is a stand-in.** The IHC tissue image has no pathologist's annotation. Its mask here is made by
# *colour deconvolution*: the DAB (brown immunostain) optical density, smoothed and cut at Otsu's threshold.
# It says where the brown stain is, which a network can learn in a few steps; it is not tumour or stroma,
# and the Dice figures below judge the mechanics, not a model you could use.

# %%
import json

import numpy as np
import torch

import mpi4dl_nb as dl
from mpi4dl_nb import viz

torch.set_num_threads(1)

# %% [markdown]
# ## The image and its stand-in mask

# %%
import matplotlib.pyplot as plt

from mpi4dl_nb.data.sample import DAB_CLASSES, dab_mask, ihc_image

image = ihc_image()
mask = dab_mask(image)
print(f"{image.shape[1]}x{image.shape[0]} px, classes {DAB_CLASSES}: {mask.mean():.1%} of the pixels DAB-positive")
figure, (left, right) = plt.subplots(1, 2, figsize=(9, 4.4))
left.imshow(image)
left.set_title("IHC tissue", fontsize=10)
right.imshow(image)
right.imshow(np.ma.masked_equal(mask, 0), cmap="autumn", alpha=0.55)
right.set_title("stand-in mask: DAB-positive", fontsize=10)
for axis in (left, right):
    axis.axis("off")
plt.show()

# %% [markdown]
# Brown is DAB, the immunostain; blue is haematoxylin, the nuclei. The threshold marks about half the pixels
# (the stained glands) as DAB-positive, in red on the right.
#
# ## Training: every stage spatial, 4 tiles
#
# `train --task segmentation --model unet` without `--datapath` trains on 64 px crops of this image (each in its
# 8 rotations and flips) with their masks; with `--datapath D` it reads `D/images/` with `D/masks/`, or slides
# with QuPath GeoJSON beside them (docs/segmentation.md). `--split-size 1 --spatial-size 1
# --num-spatial-parts 4`: the whole U-Net is one spatial stage, cut 2 x 2. Each rank reads only its
# 32 x 32 tile of each image and of its mask; the convolutions exchange halos, BatchNorm sums its statistics
# over the tiles, and the loss (cross-entropy + soft Dice) is summed over tiles into the serial mean. The
# run holds out 9 crops and measures Dice every 2 steps.

# %%
cfg = dl.ParallelConfig(split_size=1, spatial_size=1, num_spatial_parts=4, slice_method="square")
print(cfg.world_size, "ranks:", cfg.describe_world())
viz.show(viz.draw_rank_layout(cfg))

# %%
import tempfile
from pathlib import Path

scratch = tempfile.TemporaryDirectory(prefix="mpi4dl-09-")   # removed at the end (and when the kernel exits)
work = Path(scratch.name)
RUN = ["train", "--task", "segmentation", "--model", "unet", "--num-layers", "2", "--num-filters", "8",
       "--app", "medical", "--image-size", "64", "--batch-size", "4", "--steps", "8", "--dtype", "float64",
       "--optimizer", "adamw", "--lr", "0.01", "--loss", "ce+dice", "--val-fraction", "0.005", "--eval-every", "2",
       "--no-progress", "--step-timeout", "0"]
TILES = ["--split-size", "1", "--spatial-size", "1", "--num-spatial-parts", "4"]
ONE_PROCESS = ["--split-size", "1", "--spatial-size", "0"]


def run_command(argv):
    """``python -m mpi4dl_nb <argv>``, called in this process (on every engine: one rank each)."""
    from mpi4dl_nb.cli.commands import main

    return main(argv)


cluster = dl.cluster.start(n=cfg.world_size)
tiles = [*RUN, *TILES, "--checkpoint-dir", str(work / "tiles"), "--log-dir", str(work / "tiles-log")]
print("mpiexec -n 4 python -m mpi4dl_nb", " ".join(tiles))
print("exit codes:", cluster.run(run_command, tiles, timeout=600))

# %% [markdown]
# ## Exact: the same numbers as one process
#
# The same command with `--spatial-size 0` trains the whole images in this process. Every step's loss (from
# the runs' `metrics.jsonl`) and every weight and BatchNorm statistic of the last checkpoint agree to float64
# rounding:

# %%
import contextlib
import io

from mpi4dl_nb.evaluation.log import read_metrics

one = [*RUN, *ONE_PROCESS, "--checkpoint-dir", str(work / "one"), "--log-dir", str(work / "one-log")]
printed = io.StringIO()
with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):   # its lines: the logs have them
    assert run_command(one) == 0, printed.getvalue()


def losses(log):
    return [r["loss"] for r in read_metrics(log) if r["kind"] == "train"]


tile_state, one_state = dl.model_state_dict(work / "tiles"), dl.model_state_dict(work / "one")
loss_error = max(abs(a - b) for a, b in zip(losses(work / "tiles-log"), losses(work / "one-log"), strict=True))
weight_error = max(float((tile_state[k] - v).abs().max()) for k, v in one_state.items() if v.is_floating_point())
print("losses on 4 tiles:", [round(v, 6) for v in losses(work / "tiles-log")])
print(f"max |loss difference| = {loss_error:.1e}, max |weight difference| = {weight_error:.1e} over "
      f"{len(one_state)} tensors -> exact: {loss_error < 1e-9 and weight_error < 1e-9}")
assert loss_error < 1e-9 and weight_error < 1e-9

# %% [markdown]
# ## The Dice curve
#
# Every 2 steps the run evaluates its 9 held-out crops on the same 4 tiles (forward only, BatchNorm in eval
# mode). Dice and IoU come from a confusion matrix of integer pixel counts summed over the tiles, so they are
# the serial figures exactly, not an average of per-tile scores. Per class, Dice = 2 |P ∩ T| / (|P| + |T|):

# %%
evaluations = [r for r in read_metrics(work / "tiles-log") if r["kind"] == "eval"]
serial_evaluations = [r for r in read_metrics(work / "one-log") if r["kind"] == "eval"]
steps = [r["step"] for r in evaluations]
figure, axis = plt.subplots(figsize=(6.5, 3.6))
for index, name in enumerate(DAB_CLASSES):
    line, = axis.plot(steps, [r["val_dice"][index] for r in evaluations], marker="o", label=f"{name} (4 tiles)")
    axis.plot(steps, [r["val_dice"][index] for r in serial_evaluations], ls="none", marker="x", ms=9,
              color=line.get_color(), label=f"{name} (one process)")
axis.plot(steps, [r["val_mean_dice"] for r in evaluations], color="black", ls="--", label="mean Dice")
axis.set(xlabel="step", ylabel="Dice on held-out crops", ylim=(0, 1), title="per-class Dice over training")
axis.grid(alpha=0.3)
axis.legend(fontsize=8, loc="lower right")
plt.show()
print("last confusion matrix (rows: true background, DAB):", evaluations[-1]["val_confusion_matrix"])

# %% [markdown]
# The crosses (one process) sit on the dots (4 tiles). At first the network calls nearly every pixel
# background: the DAB Dice is near 0 and the background's is what labelling everything background scores. As it
# learns the stain's colour the DAB Dice climbs; the confusion matrix shows most errors are DAB pixels still
# called background. Eight steps of a width-8 U-Net are a demonstration, not a trained model.
#
# ## Polygons over a slide
#
# The IHC image written as a small pyramidal slide (2 levels), and the checkpoint run over it on the 4 ranks
# (each window cut 2 x 2 over the ranks, up to 256 px per rank and side, halos between the tiles, windows
# overlapping by the network's field, so no seams): `.npy` holds the per-pixel class
# probabilities, `.geojson` the DAB regions as polygons in level-0 pixel coordinates, with the class name and
# colour QuPath reads (`exclude_classes` leaves out the background, `min_area` drops specks).

# %%
import tifffile

slide = work / "slide.tif"
with tifffile.TiffWriter(slide) as writer:
    level = image
    for index in range(2):
        writer.write(level, tile=(64, 64), photometric="rgb", subfiletype=1 if index else 0, metadata=None)
        level = np.ascontiguousarray(level[::2, ::2])


def infer(checkpoint, slide, outputs):
    import mpi4dl_nb as dl

    return dl.infer_slide(checkpoint, slide, outputs, num_spatial_parts=4, window=256, dtype="float64",
                          exclude_classes=("background",), min_area=16, overwrite=True)


outputs = [str(work / "labels.npy"), str(work / "labels.geojson")]
summary = cluster.run(infer, str(work / "tiles"), str(slide), outputs, timeout=600)[0]
print({k: summary[k] for k in ("task", "output_shape", "windows", "classes", "regions", "class_area_px")})

# %% [markdown]
# The slide viewer: the DAB probability over the tissue, and the predicted polygons outlined on top (switch
# them off with the `polygons` box; pick a pixel with `select(x, y)` to see its probabilities).

# %%
from mpi4dl_nb.notebook.widgets.slide_viewer import SlideViewer

viewer = SlideViewer(slide, work / "labels.npy", stride=summary["output_stride"], field=summary["field"]["rows"],
                     classes=list(DAB_CLASSES), polygons=work / "labels.geojson")
viewer.level.value = 0
viewer.opacity.value = 0.2
viewer.select(300, 200)
viewer

# %% [markdown]
# The GeoJSON as QuPath imports it (*File > Import objects*, or drag the file onto the open slide): a
# FeatureCollection of annotations, each with its class name and colour, holes as inner rings, and per-region
# measurements.

# %%
collection = json.loads((work / "labels.geojson").read_text())
first = collection["features"][0]
print(collection["type"], "with", len(collection["features"]), "features; classes:",
      sorted({f["properties"]["classification"]["name"] for f in collection["features"]}))
print("first feature:", first["geometry"]["type"], "with", len(first["geometry"]["coordinates"]), "ring(s),",
      json.dumps(first["properties"]))

# %% [markdown]
# ## What to try next
#
# * **Predict**, then check: with `--num-spatial-parts 2 --slice-method vertical` (2 strips: start the cluster
#   with `n=2`), are the losses still those of one process? Which rank's halo is longer than before?
# * Train longer (`--steps 60`) and watch the DAB Dice; then set `min_area=200` in `infer` and count the polygons.
# * Your own data: `--datapath D` with `D/images/` and `D/masks/` (add `--mpp 0.5` to train at 0.5 µm/px, and
#   `--source-mpp` for images that carry no resolution), or slides with QuPath annotations and `--classes`
#   (docs/segmentation.md).

# %%
cluster.stop()
scratch.cleanup()
