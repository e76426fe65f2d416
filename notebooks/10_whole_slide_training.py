# ---
# jupyter:
#   kernelspec:
#     display_name: Python (mpi4dl-nb)
#     language: python
#     name: mpi4dl-nb
# ---

# %% [markdown]
# # 10 — Whole-slide training from slide labels: one canvas per slide on 4 tiles, a slide-level pool, exact
#
# Pathology labels belong to slides (tumour or not), and the evidence can be a few cells somewhere in the tissue.
# Here every training sample is a whole slide: its tissue placed on one square canvas at a chosen resolution,
# cut 2 x 2 over four spatial ranks, with a slide-level max pool over every position of every tile and the
# classifier on a fifth rank. The run on tiles is checked against the same command on one process, a recipe that
# learns (for every pool) trains the model, then we look at where it looked on a slide and score the held-out
# slides.
#
# **What you will learn**: what `train --whole-slide --cohort` makes of a slide (the canvas, its tissue box, what
# is cut or padded), how a slide-level pool (`--pool max`; `attention`, `tissue-mean`, `avg` by changing one
# word) runs exactly on tiles, a recipe that learns whole slides (two canvases per batch, AdamW with a warm-up),
# how to draw the map of where a trained model looked over the slide, and how to read a slide-level AUC on a
# handful of held-out slides.
#
# **What you need**: notebooks 02 (halos) and 04 (exactness against one process); 5 MPI ranks (started below);
# about two minutes.
#
# **The cohort is synthetic** (`mpi4dl_nb.data.synthetic_cohort`): each slide is glass with an ellipse of pink
# stroma and purple nuclei (about 6 µm); `positive` slides also carry a few clusters of dark dots about 2 µm
# across. The label hangs on those dots, which only a fine resolution shows. The canvases here are 128 px at
# 1 µm per pixel so the notebook runs in two minutes on a laptop; a real cohort is trained on canvases of 8192 px
# and more at 0.5 µm per pixel, on as many tiles as that takes, for tens of epochs.

# %%
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

import mpi4dl_nb as dl
from mpi4dl_nb import viz

torch.set_num_threads(1)
scratch = tempfile.TemporaryDirectory(prefix="mpi4dl-10-")   # removed at the end (and when the kernel exits)
work = Path(scratch.name)

# %% [markdown]
# ## A small cohort
#
# Twelve slides of 256 µm squared, scanned at 1 µm per pixel with two coarser levels (2 and 4 µm per pixel), and
# their manifest `cohort.csv`: slide, label, patient. Eight patients alternate between the classes, so four of
# them have two slides each: the held-out split below keeps each patient's slides on one side.

# %%
import csv

from mpi4dl_nb.data.synthetic_cohort import write_synthetic_cohort

manifest, slides = write_synthetic_cohort(work / "cohort", slides=12, side_um=256.0, mpp=1.0, levels=3,
                                          clusters=8)
with manifest.open() as handle:
    rows = list(csv.DictReader(handle))
print(f"{'slide':<14}{'label':<10}{'patient':<12}dots")
for row in rows:
    print(f"{row['slide']:<14}{row['label']:<10}{row['patient']:<12}{row['structures']}")

# %% [markdown]
# What tells the classes apart: a positive slide at full resolution (1 µm/px) and the same place at the
# slide's coarsest level (4 µm/px), where each pixel averages 4 x 4 of the finer ones:

# %%
from mpi4dl_nb.data.pathology import open_slide

positive = next(s for s in slides if s.label == "positive")
row, col = positive.structures[0]
with_dots = open_slide(positive.path)
fine = np.asarray(with_dots.read_region((col - 32, row - 32), 0, (64, 64)).convert("RGB"))
coarse = np.asarray(with_dots.read_region((col - 32, row - 32), 2, (16, 16)).convert("RGB"))
figure, (left, right) = plt.subplots(1, 2, figsize=(7, 3.6))
left.imshow(fine)
left.set_title(f"{positive.path.stem}, 1 µm/px (64 µm)", fontsize=10)
right.imshow(coarse)
right.set_title("the same 64 µm at 4 µm/px", fontsize=10)
for axis in (left, right):
    axis.axis("off")
plt.show()

# %% [markdown]
# On the left, the dark dots (2 µm) sit among the purple nuclei (6 µm); on the right the dots are averaged into
# the stroma and only the nuclei remain as smudges. A model trained at 4 µm per pixel cannot see the label.
#
# ## The canvases
#
# `--whole-slide --image-size 128 --mpp 1`: for each slide the tissue is found once on the coarsest level, its
# bounding box scaled to 1 µm/px, and a 128 px canvas centred on it. Tissue larger than the canvas is cut around
# its centre (the share cut is reported); where the canvas reaches beyond the slide it is white. This is the
# dataset `train` builds, `SlideCanvases`; each line is what `train` prints before its first step:

# %%
from mpi4dl_nb.data.canvas import cohort_canvases
from mpi4dl_nb.data.manifest import read_cohort

CANVAS, MPP = 128, 1.0
canvases = cohort_canvases(read_cohort(manifest), CANVAS, mpp=MPP)
print("\n".join(canvases.report()))

# %% [markdown]
# Most slides' tissue fills three quarters or more of its canvas; the larger ellipses lose a share of their
# tissue at the canvas's edges (the "cut" column), the smaller ones are padded with their own glass. On a real
# cohort you choose `--image-size` from these lines: large enough that little tissue is cut, at the `--mpp` the
# label needs.
#
# One slide drawn at its coarsest level, with its tissue box (dashed), its canvas (solid) and the 2 x 2 tiles the
# four spatial ranks read (each rank reads only its quarter of the canvas from the slide file, never the whole
# canvas):

# %%
import dataclasses

import matplotlib.patches as patches

cfg = dl.ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, slice_method="square")
SHOWN = 1                                          # a positive slide
placement = canvases.placements[SHOWN]
level = with_dots.level_count - 1
scale = with_dots.level_downsamples[level]          # level-0 px per thumbnail px (1 µm/px is level 0 here)
thumbnail = np.asarray(canvases.slide(SHOWN).read_region((0, 0), level, canvases.slide(SHOWN).level_dimensions[
    level]).convert("RGB"))
canvas_image = canvases.read(SHOWN).permute(1, 2, 0).numpy()


def draw_canvas(axis, placement, scale, color="black"):
    """The canvas of ``placement`` and its 2 x 2 tiles, in pixels of a picture ``scale`` times coarser."""
    top, left, side = placement.top / scale, placement.left / scale, placement.size / scale
    axis.add_patch(patches.Rectangle((left - 0.5, top - 0.5), side, side, fill=False, lw=2, color=color))
    axis.plot([left + side / 2 - 0.5] * 2, [top - 0.5, top + side - 0.5], color=color, lw=1)
    axis.plot([left - 0.5, left + side - 0.5], [top + side / 2 - 0.5] * 2, color=color, lw=1)


figure, (left, right) = plt.subplots(1, 2, figsize=(9, 4.6))
left.imshow(thumbnail)
r0, r1, c0, c1 = (v / scale for v in placement.tissue)
left.add_patch(patches.Rectangle((c0 - 0.5, r0 - 0.5), c1 - c0, r1 - r0, fill=False, ls="--", lw=1.5,
                                 color="tab:blue", label="tissue box"))
draw_canvas(left, placement, scale)
left.set_title(f"{placement.slide} at 4 µm/px: tissue box, canvas, tiles", fontsize=10)
right.imshow(canvas_image)
draw_canvas(right, dataclasses.replace(placement, top=0, left=0), 1.0)       # the canvas's own pixels
for rank, (r, c) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
    right.text(c * CANVAS / 2 + 4, r * CANVAS / 2 + 12, f"rank {rank}", fontsize=9,
               bbox={"facecolor": "white", "alpha": 0.7, "lw": 0})
right.set_title(f"its {CANVAS} px canvas at 1 µm/px, cut 2 x 2", fontsize=10)
for axis in (left, right):
    axis.axis("off")
plt.show()

# %% [markdown]
# ## The recipe
#
# Whole slides train one small batch of canvases at a time, on a handful of slides, and a newcomer's first choice
# (plain SGD at `--lr 0.02`, one canvas per step, a dozen steps) diverges: the held-out loss climbs past 50 and
# every slide gets the same class. The recipe below learns this cohort with every pool (measured in
# docs/whole-slide.md, "A recipe that learns"):
#
# * **two canvases per batch** (`--batch-size 2`): BatchNorm then normalises over both. With one canvas it
#   normalises each by its own statistics, which takes away much of what an averaging pool reads (how much of
#   the canvas shows the evidence): avg and attention-MIL do not learn this cohort at batch 1, tissue-mean
#   barely (`train` says so in a note), max pooling does;
# * **AdamW** at `--lr 0.003` with a **linear warm-up** of 10 steps and a **cosine** decay to 0 (`--optimizer
#   adamw --warmup-steps 10 --lr-schedule cosine`): the first steps' gradients of a max pool on an untrained trunk
#   are large, and a full learning rate at once throws the weights far off;
# * **90 steps** (30 epochs of the six training slides): the held-out loss stays near ln 2 for the first 20 to 30
#   steps before it falls.
#
# Half of the patients (two of each class, six slides) are held out by `--val-fraction 0.5`.

# %%
import contextlib
import io

POOL, VAL_FRACTION = "max", 0.5
RECIPE = ["--batch-size", "2", "--optimizer", "adamw", "--lr", "0.003", "--warmup-steps", "10",
          "--lr-schedule", "cosine", "--steps", "90"]
RUN = ["train", "--whole-slide", "--cohort", str(manifest), "--image-size", str(CANVAS), "--mpp", str(MPP),
       "--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4", "--pool", POOL,
       "--val-fraction", str(VAL_FRACTION), "--no-progress", "--step-timeout", "0", *RECIPE]
TILES = ["--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "4", "--slice-method", "square"]
ONE_PROCESS = ["--split-size", "1", "--spatial-size", "0"]
print("python -m mpi4dl_nb", " ".join(RUN[:1] + ["--whole-slide", "--cohort", "cohort.csv"] + RUN[4:]))


def run_command(argv):
    """``python -m mpi4dl_nb <argv>``, called in this process (on every engine: one rank each)."""
    from mpi4dl_nb.cli.commands import main

    return main(argv)


def run_here(argv):
    """``run_command`` in this notebook's process (one process), what it prints kept in ``printed[-1]``."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        code = run_command(argv)
    printed.append(text.getvalue())
    return code


printed = []

# %% [markdown]
# ## Exact: 4 tiles + a layer rank equal one process
#
# `--split-size 2 --spatial-size 1 --num-spatial-parts 4`: stage 0 (the ResNet trunk) on a 2 x 2 grid of ranks
# 0-3, stage 1 (the pool and the classifier) on rank 4. Each tile convolves its quarter with halos from its
# neighbours, BatchNorm sums its statistics over the four tiles, and `--pool max` takes each feature's maximum
# over every position of every tile: the four tiles' maxima are merged into the canvas's maximum, and its
# gradient goes back to the one position (on one tile) that one process would pick (docs/whole-slide.md). A
# max pool suits a label that one small structure decides: one dark dot anywhere makes a slide positive.
#
# The check needs no more than a few steps: the same command with `--steps 3 --warmup-steps 1`, in float64, on
# the 4 tiles + 1 rank and on one process (`--split-size 1 --spatial-size 0`, the baseline to run first), here in
# this notebook's process (what it prints is kept in `printed`). Both write their losses (`--log-dir`) and final
# weights.

# %%
from mpi4dl_nb.evaluation.log import read_metrics
from mpi4dl_nb.infer.model import load_trained

viz.show(viz.draw_rank_layout(cfg))
SHORT = ["--steps", "3", "--warmup-steps", "1", "--checkpoint-every", "3", "--dtype", "float64"]
cluster = dl.cluster.start(n=cfg.world_size)


def short_run(folder, layout):
    """``train`` with the recipe's first steps and ``layout``, into ``folder`` (checkpoint) and its log."""
    return [*RUN, *SHORT, *layout, "--checkpoint-dir", str(folder), "--log-dir", str(folder / "log")]


def losses_and_layers(folder):
    """The run's training losses (its log) and final layers (its checkpoint), in float64."""
    losses = [r["loss"] for r in read_metrics(folder / "log") if r["kind"] == "train"]
    return losses, load_trained(folder, dtype=torch.float64)[0]


on_tiles = cluster.submit(run_command, short_run(work / "tiles", TILES))        # the engines start on it ...
print("one process: exit", run_here(short_run(work / "one-process", ONE_PROCESS)))   # ... while this process runs
print("tiles: exit", cluster.wait(on_tiles, timeout=600))
(tile_losses, tile_layers), (one_losses, one_layers) = (losses_and_layers(work / "tiles"),
                                                        losses_and_layers(work / "one-process"))
tile_state = torch.nn.Sequential(*tile_layers).state_dict()
one_state = torch.nn.Sequential(*one_layers).state_dict()
loss_error = max(abs(a - b) for a, b in zip(tile_losses, one_losses, strict=True))
weight_error = max(float((tile_state[k] - v).abs().max()) for k, v in one_state.items() if v.is_floating_point())
print("losses on 4 tiles + 1:", [round(v, 4) for v in tile_losses])
print(f"max |loss difference| = {loss_error:.1e}, max |weight difference| = {weight_error:.1e} over "
      f"{len(tile_state)} tensors -> exact: {loss_error < 1e-9 and weight_error < 1e-9}")
assert loss_error < 1e-9 and weight_error < 1e-9

# %% [markdown]
# The differences are float64 rounding, a few 1e-13 on values of order 1: the tiles add the same products
# in a different order (BatchNorm's sums over four tiles), and the AdamW steps carry those last digits along.
# Nothing is approximated: no tile sees a cropped context (the halos), no tile normalises by its own statistics,
# and each feature's maximum is taken over all four tiles, its gradient sent to the tile that holds it. A
# difference of 1e-3 would mean a real error, such as a missing halo or a per-tile maximum.
#
# ## The recipe learns
#
# The whole recipe, 90 steps, on one process (the same numbers as the tiles, as just checked; float32, a few
# seconds here). `train` scores the held-out slides at every epoch's end (`metrics.jsonl`; `printed[-1]` holds
# its lines):

# %%
recipe = work / "recipe"
print("exit", run_here([*RUN, *ONE_PROCESS, "--checkpoint-every", "90", "--checkpoint-dir", str(recipe),
                        "--log-dir", str(recipe / "log")]))
held = [r for r in read_metrics(recipe / "log") if r["kind"] == "eval"]
for r in (held[0], held[len(held) // 2], held[-1]):
    print(f"  step {r['step']:>2}: held-out loss {r['val_loss']:.3f}, slide AUC {r['val_roc_auc']:.2f}, "
          f"balanced accuracy {r['val_balanced_accuracy']:.2f}")
print(f"held-out loss {held[0]['val_loss']:.2f} -> {held[-1]['val_loss']:.2f} (chance: ln 2 = 0.69)")

trained_layers, _, record = load_trained(recipe, dtype=torch.float64)   # the trained model, in float64
trained = torch.nn.Sequential(*trained_layers)
scored = cohort_canvases(read_cohort(manifest), CANVAS, mpp=MPP, tissue_channel=record.model.pool.tissue)
training_slides, held_out = dl.split_dataset(scored, VAL_FRACTION, seed=record.seed)
assert record.split is not None and sorted(record.split.val) == sorted(
    {canvases.patients[i] for i in held_out.indices}), "the notebook holds out the run's patients"
print("held out:", [canvases.names[i] for i in held_out.indices], "patients", list(record.split.val))

# %% [markdown]
# The held-out loss starts at chance (ln 2: the model says 50/50), stays there while the trunk finds the dots,
# then falls; the held-out slides end on the right side of 0.5. The same recipe with the other pools, on this
# cohort (docs/whole-slide.md; held-out loss at the last step, slide AUC, balanced accuracy; seeds 0, 1, 2):
#
# | `--pool` | held-out loss | AUC | balanced accuracy |
# |---|---|---|---|
# | max | 0.08, 0.14, 0.38 | 1.0, 1.0, 1.0 | 1.0, 1.0, 0.83 |
# | attention | 0.17, 0.18, 0.15 | 1.0, 1.0, 1.0 | 1.0, 1.0, 1.0 |
# | tissue-mean | 0.29, 0.29, 0.33 | 1.0, 1.0, 1.0 | 1.0, 1.0, 1.0 |
# | avg (the default) | 0.33, 0.28, 0.34 | 1.0, 1.0, 1.0 | 1.0, 1.0, 1.0 |
#
# Set `POOL` to one of them in the recipe cell and run the notebook again: the map below then draws the attention
# weights (attention); the averaging pools (avg, tissue-mean) weigh every position alike and draw no map.
# (`scored` reads the canvases as the model takes them: with `--pool tissue-mean`, the tissue mask as a fourth
# channel.)
#
# ## Where the model looked
#
# The max pool keeps, for each of the trunk's 16 output features, its largest value over the canvas: the
# classifier sees one position per feature. The map of where the model looked is therefore, for every output
# cell, the share of the features whose maximum falls in it. There is no `infer` output for it yet, so we compute
# it here with the trained model: the pool's input is caught with a forward hook, and the arg-max of each feature
# over the positions is counted per cell (with `POOL = "attention"` the same cell draws the attention weights;
# the averaging pools draw none).
# Drawn over a held-out positive slide at 4 µm/px (left, where the canvas lies on the slide) and over its canvas
# at 1 µm/px (right, with the slide's dots circled):

# %%
from mpi4dl_nb.models.pools import AttentionMILPool, GlobalMaxPool

pool = next((m for m in trained.modules() if isinstance(m, (GlobalMaxPool, AttentionMILPool))), None)
caught = {}
hook = None if pool is None else pool.register_forward_hook(
    lambda module, inputs, output: caught.update(features=inputs[0]))
WHAT = "the features' maxima" if isinstance(pool, GlobalMaxPool) else "the attention"


def probability(index):
    """The trained model's probability of `positive` for canvas ``index``."""
    with torch.no_grad():
        return float(torch.softmax(trained(scored.read(index)[None].to(torch.float64)), 1)[0, 1])


def where_it_looked(index):
    """(probability of `positive`, the pool's map over the output cells) of canvas ``index``: per cell, the share
    of the features whose maximum lies there (max pool) or the attention weight (attention pool)."""
    with torch.no_grad():
        p = probability(index)
        features = caught["features"][0]                          # (features, rows, columns)
        if isinstance(pool, AttentionMILPool):
            scores = pool.scores(features[None])[0, 0]
            share = torch.softmax(scores.flatten(), 0).reshape(scores.shape)
        else:
            cells = features.shape[1] * features.shape[2]
            counts = torch.bincount(features.flatten(1).argmax(1), minlength=cells)
            share = (counts / len(features)).reshape(features.shape[1:])
    return p, share


def dots_on_canvas(index):
    """(rows, columns) of slide ``index``'s structures in its canvas's pixels (1 µm/px = level 0 here)."""
    placement = canvases.placements[index]
    found = np.array(slides[index].structures).reshape(-1, 2) - (placement.top, placement.left)
    inside = (found >= 0).all(1) & (found < CANVAS).all(1)
    return found[inside]


def near_dots(index, grid):
    """The output cells (``grid`` rows x columns) within one cell of a dot of slide ``index``."""
    near = np.zeros(grid, dtype=bool)
    for r, c in dots_on_canvas(index) // (CANVAS // grid[0]):
        near[max(r - 1, 0):r + 2, max(c - 1, 0):c + 2] = True
    return near


def draw_where_it_looked(shown):
    """The pool's map of canvas ``shown`` over its slide (4 µm/px) and over its canvas (1 µm/px), dots circled; the
    share of the map near the dots, on it and on the other held-out positive slides."""
    p_shown, share = where_it_looked(shown)
    looked = np.ma.masked_equal(share.numpy(), 0.0)              # cells holding no maximum stay clear
    dots = dots_on_canvas(shown)
    near = near_dots(shown, tuple(share.shape))
    placement = canvases.placements[shown]
    whole = canvases.slide(shown)
    overview = np.asarray(whole.read_region((0, 0), level, whole.level_dimensions[level]).convert("RGB"))
    top, start, side = placement.top / scale, placement.left / scale, placement.size / scale
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 4.6))
    left.imshow(overview)
    left.imshow(looked, cmap="autumn", alpha=0.9, vmin=0.0,
                extent=(start - 0.5, start + side - 0.5, top + side - 0.5, top - 0.5))
    draw_canvas(left, placement, scale)
    left.set(xlim=(-0.5, overview.shape[1] - 0.5), ylim=(overview.shape[0] - 0.5, -0.5))
    left.set_title(f"{placement.slide} (held out, positive) at 4 µm/px", fontsize=10)
    right.imshow(canvases.read(shown).permute(1, 2, 0).numpy())
    shade = right.imshow(looked, cmap="autumn", alpha=0.9, vmin=0.0, extent=(-0.5, CANVAS - 0.5, CANVAS - 0.5, -0.5))
    right.scatter(dots[:, 1], dots[:, 0], s=30, facecolors="none", edgecolors="cyan", lw=1)
    figure.colorbar(shade, ax=right, fraction=0.046, label=f"share of {WHAT}")
    right.set_title(f"its canvas: {share.shape[0]}x{share.shape[1]} output cells, dots circled", fontsize=10)
    for axis in (left, right):
        axis.axis("off")
    plt.show()
    print(f"P(positive) = {p_shown:.2f}; {near.mean():.0%} of the cells lie near a dot and hold "
          f"{float(share[torch.from_numpy(near)].sum()):.0%} of {WHAT} (a model blind to the dots would put about "
          f"{near.mean():.0%} there)")
    for i in held_out.indices:
        if canvases.label(i) == 1 and i != shown:
            grid = near_dots(i, tuple(share.shape))
            print(f"  {canvases.names[i]}: {grid.mean():.0%} of the cells near a dot hold "
                  f"{float(where_it_looked(i)[1][torch.from_numpy(grid)].sum()):.0%} of {WHAT}")


if pool is None:
    print(f"--pool {POOL} weighs every position alike: no map to draw")
else:
    draw_where_it_looked([i for i in held_out.indices if canvases.label(i) == 1][0])   # a held-out positive slide

# %% [markdown]
# Each output cell of the trunk covers 4 x 4 canvas pixels (its two stride-2 stages), so the map has 32 x 32
# cells; only the cells that hold some feature's maximum are coloured. Most features take their maximum on a
# dot: all but one of the coloured cells sit on or beside the circled clusters (the other, near the canvas's
# top-left edge, holds one feature), and on every held-out positive slide the cells near a dot, about a quarter
# of the canvas, hold close to nine in ten of the maxima or more. The model has found the label's evidence from
# slide labels alone: nobody told it where the dots are.
#
# ## Slide-level AUC on the held-out slides
#
# Each held-out slide is one sample, so the slide-level AUC is the rank statistic of the slides' `positive`
# probabilities (`mpi4dl_nb.evaluation.metrics.roc_auc`): the share of (positive, negative) pairs the model
# orders correctly. Here in this process, and with `dl.evaluate` on the same 4 tiles + 1 rank:

# %%
from mpi4dl_nb.evaluation.metrics import roc_auc

held_probabilities = np.array([probability(i) for i in held_out.indices])
held_labels = np.array([canvases.label(i) for i in held_out.indices])
for i, p, y in zip(held_out.indices, held_probabilities, held_labels, strict=True):
    print(f"  {canvases.names[i]}  {canvases.patients[i]}  {canvases.classes[y]:<9} P(positive) = {p:.3f}")
auc = roc_auc(held_probabilities, held_labels == 1)
print(f"slide-level AUC in one process: {auc:.3f}")


def evaluate_held_out(manifest, checkpoint, canvas, mpp, fraction, seed, knobs, tissue):
    """The checkpoint on the held-out slides, on this cluster's ranks with the tiles' layout: AUC and count."""
    import torch

    import mpi4dl_nb as dl
    from mpi4dl_nb.data.canvas import cohort_canvases
    from mpi4dl_nb.data.manifest import read_cohort

    canvases = cohort_canvases(read_cohort(manifest), canvas, mpp=mpp, tissue_channel=tissue)
    _, held_out = dl.split_dataset(canvases, fraction, seed=seed)
    metrics = dl.evaluate(checkpoint, held_out, ctx=dl.init(), config=dl.ParallelConfig(**knobs),
                          dtype=torch.float64)
    return metrics.roc_auc, metrics.count


parallel_auc, count = cluster.run(evaluate_held_out, str(manifest), str(recipe), CANVAS, MPP, VAL_FRACTION,
                                  record.seed, cfg.as_dict(), record.model.pool.tissue, timeout=300)[0]
print(f"slide-level AUC on 4 tiles + 1 rank: {parallel_auc:.3f} over {count} slides")
assert abs(parallel_auc - auc) < 1e-12

# %% [markdown]
# Both AUCs are the same number: the evaluation on tiles gives each slide the probability one process gives it,
# so the ranking of the slides is the same. Read the probabilities before the AUC: every held-out positive slide
# gets a higher probability than every held-out negative one, with a clear gap between the classes, so the AUC
# is 1; with the recipe the threshold of 0.5 separates them too (the negatives near 0, the positives from about
# 0.75 up). On six slides an AUC says little beyond "it separates these" (it moves in steps of 1/9; a confidence
# interval needs dozens of slides). `train` scores the held-out slides on
# its own with `--eval-every N` (slide and patient AUC in `metrics.jsonl`), and `evaluate --checkpoint DIR`
# rebuilds the recorded held-out canvases and scores them at
# slide and patient level.
#
# ## Exercise: what resolution buys
#
# **Predict**: the same 128 µm of tissue read at 4 µm per pixel fits a 32 px canvas. How dark is the darkest
# pixel of a positive slide's canvas compared with a negative slide's, at 1 µm/px and at 4 µm/px? (The dots are
# RGB (40, 20, 90), the nuclei (120, 70, 150).) Write your guess, then run the cell.

# %%
my_guess = {"1 µm/px": "much darker on positives", "4 µm/px": "?"}
coarse_canvases = cohort_canvases(read_cohort(manifest), CANVAS // 4, mpp=4.0)    # the same 128 µm at 4 µm/px
for mpp, read in ((MPP, canvases), (4.0, coarse_canvases)):
    darkest = {name: [] for name in read.classes}
    for i in range(len(read)):
        darkest[read.classes[read.label(i)]].append(float(read.read(i).mean(0).min()) * 255)
    print(f"{mpp:g} µm/px ({read.image_size} px canvas): darkest pixel (grey level) "
          + ", ".join(f"{name} {np.mean(values):.0f} ± {np.std(values):.0f}" for name, values in darkest.items()))

# %% [markdown]
# At 1 µm per pixel the dots' pixels are far darker than anything on a negative slide (grey 50 against 113, where
# nuclei are darkest), on every slide: a single position tells the classes apart, which is what max and attention
# pools are for. At 4 µm per pixel a 2 µm dot shares its pixel with fifteen pixels' worth of stroma and nuclei:
# the positives' darkest pixels (102 ± 7) come within about ten grey levels of the negatives' (113), and on some
# positive slides they are the same, so no pool can find the label there. That is the reason to train whole
# slides at fine resolution, and the reason they need spatial parallelism: the same 128 µm at 0.25 µm per pixel
# is a 512 px canvas, and a 2 cm section at 0.5 µm per pixel is 40000 px on a side.
#
# ## What to try next
#
# * **Predict**, then check: with `POOL = "attention"` (a gated attention-MIL pool, `z = sum_i a_i h_i` with
#   `a = softmax(w^T (tanh(V h_i) * sigmoid(U h_i)))`; on tiles each tile's scores merge with a running maximum
#   and sum into one softmax), are the losses still those of one process? Where does the attention go? The map
#   cell then draws the attention weights (`torch.softmax` of the `AttentionMILPool`'s `scores`).
# * **Predict**, then check: the recipe with `"--batch-size", "1"` instead of 2 (one canvas per step, 90 steps).
#   Which pools still learn? (`train` prints a note for the averaging ones: BatchNorm then normalises each canvas
#   by its own statistics. `--accumulate 2` with batch 1 sums two slides' gradients per step but keeps that.)
# * `--pool tissue-mean` (each canvas carries its tissue mask as a fourth channel, the mean runs over tissue
#   only), and the recipe with `--seed 1` or `2` (another split of the patients: the table's other figures).
# * Your own cohort: a `cohort.csv` with slide, label and patient columns beside your slides, `--mpp` at the
#   scale of the label's evidence, `--image-size` from the canvas lines `train` prints, and as many tiles as a
#   canvas needs to fit your devices' memory (notebook 05's planner estimates it).

# %%
if hook is not None:
    hook.remove()
canvases.close()
scored.close()
coarse_canvases.close()
with_dots.close()
cluster.stop()
scratch.cleanup()
