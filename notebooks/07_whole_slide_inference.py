# ---
# jupyter:
#   kernelspec:
#     display_name: Python (mpi4dl-nb)
#     language: python
#     name: mpi4dl-nb
# ---

# %% [markdown]
# # 07 — Whole-slide inference: a heat map over a slide, on 4 ranks, exact
#
# A classifier trained on tissue tiles is applied to a whole slide *fully convolutionally*: its
# global pool + linear head becomes a pooling window + 1x1 convolution over the trunk's feature map,
# so every output cell holds the class probabilities of the slide around it. The slide is walked in
# windows; each window is split over 4 MPI ranks (halo exchanges between them), and windows overlap
# by exactly the receptive field, so the heat map equals the same network run on the whole slide in
# one process — no seams. (The same runs as `mpiexec -n 4 python -m mpi4dl_nb infer ...`.)
#
# **What you will learn**: how a tile classifier becomes a heat map over a whole slide, how the slide is
# streamed in windows split over ranks, why the result has no seams, and how to read the heat map.
#
# **What you need**: notebooks 02 (halos) and 04 (training); 4 MPI ranks (started below); about a minute.
# The model is trained here in a few seconds, so its heat map shows the mechanics, not a useful classifier.

# %%
import torch

import mpi4dl_nb as dl

torch.set_num_threads(1)

# %% [markdown]
# Train a small ResNet briefly on tiles of the bundled IHC tissue image (one process, the `train`
# command with a checkpoint directory); any checkpoint written by `train` works the same way.

# %%
import os
import subprocess
import sys
import tempfile
from pathlib import Path

scratch = tempfile.TemporaryDirectory(prefix="mpi4dl-infer-")   # removed at the end (and when the kernel exits)
work = Path(scratch.name)
env = dict(os.environ, **dl.cluster.ENGINE_ENV)
train = [sys.executable, "-m", "mpi4dl_nb", "train", "--model", "resnet", "--resnet-version", "1",
         "--num-layers", "8", "--num-filters", "4", "--image-size", "32", "--batch-size", "4",
         "--split-size", "1", "--spatial-size", "0", "--app", "medical", "--num-classes", "2",
         "--steps", "4", "--lr", "0.05", "--checkpoint-dir", str(work / "ck"), "--no-progress"]
result = subprocess.run(train, capture_output=True, text=True, env=env, timeout=300)
assert result.returncode == 0, result.stderr
print(sorted(p.name for p in (work / "ck").iterdir()))

# %% [markdown]
# A slide: the tissue image tiled into a 384 x 640 pyramidal TIFF (3 levels), with a strip of bare
# glass on the right (background windows can be skipped with `tissue_only=True`).

# %%
import numpy as np
import tifffile
from skimage import data as skdata

sample = skdata.immunohistochemistry()
image = np.concatenate([sample, sample[:, ::-1]], axis=1)[:384, :640].copy()
image[:, 560:] = 245
slide = work / "slide.tif"
with tifffile.TiffWriter(slide) as tw:
    level = image
    for index in range(3):
        tw.write(level, tile=(64, 64), compression="jpeg", photometric="rgb", subfiletype=1 if index else 0,
                 metadata=None)
        level = np.ascontiguousarray(level[::2, ::2])
print(slide, image.shape)

# %% [markdown]
# Inference on a 4-rank cluster: each window is cut 2 x 2 among the ranks, 128 px per rank per side.
# `keep_trace=True` returns every rank's timeline (reads, computes, halo exchanges).

# %%
cluster = dl.cluster.start(n=4)


def infer(checkpoint, slide, output):
    import mpi4dl_nb as dl

    return dl.infer_slide(checkpoint, slide, output, num_spatial_parts=4, slice_method="square",
                          window=128, dtype="float64", keep_trace=True, overwrite=True)


outputs = [str(work / name) for name in ("heat.npy", "heat.tif", "overlay.png")]
summary = cluster.run(infer, str(work / "ck"), str(slide), outputs, timeout=600)[0]
print({k: summary[k] for k in ("output_shape", "output_stride", "window_grid", "windows", "megapixels_per_s")})
print("field of one cell:", summary["field"]["text"])
print("peak memory per rank (MB):", [round(b / 2**20, 1) for b in summary["peak_memory_bytes"]])

# %% [markdown]
# The same network on the whole slide in this process (float64): the 4-rank streamed heat map
# matches it to round-off.

# %%
from mpi4dl_nb.infer.fully_conv import fully_convolutional
from mpi4dl_nb.infer.model import load_layers
from mpi4dl_nb.infer.reader import SlideReader

layers, description = load_layers(work / "ck", dtype=torch.float64)
net = fully_convolutional(layers, description.image_size)
reader = SlideReader(slide)
x = torch.from_numpy(reader.read((0, 384, 0, 640))).permute(2, 0, 1).double().div(255.0)
with torch.no_grad():
    whole = net(x[None])[0].numpy()
heat = np.load(work / "heat.npy")
difference = float(np.abs(heat - whole).max())
print(f"{description.describe()}\nmax |streamed - whole slide| = {difference:.1e}")
assert difference < 1e-9

# %% [markdown]
# The `.png` output: the heat map (probability of the last class) over the slide's overview.

# %%
from IPython.display import Image, display

display(Image(filename=str(work / "overlay.png")))

# %% [markdown]
# Bright (yellow, in the `inferno` colour map) marks a high probability of "high DAB" (brown-stained tissue),
# dark a low one; the bare glass strip on the right gets whatever the network says about white, which is why
# `tissue_only=True` skips such windows. Each heat-map cell is one output of the trunk (`output_stride`
# pixels apart), computed from the field printed above.

# %% [markdown]
# The heat map over the slide: pick the pyramid level, move the view, change the opacity; pick a cell
# (`select(x, y)` in slide pixels, or the cell boxes) to see the pixels it reads and its probabilities.

# %%
from mpi4dl_nb.notebook.widgets.slide_viewer import SlideViewer

viewer = SlideViewer(slide, work / "heat.npy", stride=summary["output_stride"], field=summary["field"]["rows"],
                     classes=["low DAB", "high DAB"])
viewer.level.value = 0
viewer.select(200, 150)
viewer

# %% [markdown]
# The pyramidal `.tif` is **slide-aligned**: it covers the slide's extent from its origin, one pixel per output
# stride, each cell on the pixels it describes, with one 8-bit sample per class (`P x 255`). OpenSlide opens it,
# and QuPath or ASAP lay it over the slide (with MPP tags when the slide has an MPP; this one has none). Drawn
# here in slide coordinates over the slide itself: the map needs no shift or scaling beyond its stride.

# %%
import matplotlib.pyplot as plt
import openslide

with openslide.OpenSlide(str(work / "heat.tif")) as heatmap:
    print("levels:", heatmap.level_dimensions, "| vendor:", heatmap.properties["openslide.vendor"])
probabilities = tifffile.imread(work / "heat.tif")[..., 1] / 255.0       # sample 1: P(high DAB)
stride = summary["output_stride"]
rows, cols = probabilities.shape
figure, axis = plt.subplots(figsize=(8, 5))
axis.imshow(image, extent=(0, image.shape[1], image.shape[0], 0))
shown = axis.imshow(probabilities, extent=(0, cols * stride, rows * stride, 0), cmap="inferno", alpha=0.55,
                    vmin=0, vmax=1)
figure.colorbar(shown, ax=axis, label="P(high DAB)")
axis.set(title="heat.tif over the slide, in slide pixels", xlabel="x (px)", ylabel="y (px)")
plt.show()

# %% [markdown]
# Per-rank timeline of the windows: reads (prefetched in a thread), computes and the halo exchanges
# between the 4 ranks of each window.

# %%
from mpi4dl_nb.notebook.widgets import TimelineView

TimelineView(summary["events"], measured=summary["peak_memory_bytes"])

# %% [markdown]
# One row per rank: every window is read (in a background thread, so reads overlap compute), computed on
# the 4 tiles with halo exchanges between them, and written. Windows overlap by the receptive field, so
# the more windows, the more pixels are computed twice: larger windows cost memory but waste less.
#
# ## What to try next
#
# * Change `window=128` to 256 in `infer` and predict the number of windows and the peak memory per rank.
# * Train longer (`--steps 40`) and watch the heat map start to follow the brown stain.
# * Run the same on your own slide from a shell: `mpiexec -n 4 python -m mpi4dl_nb infer --help`.

# %%
cluster.stop()
scratch.cleanup()
