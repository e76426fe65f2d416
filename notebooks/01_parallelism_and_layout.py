# ---
# jupyter:
#   kernelspec:
#     display_name: Python (mpi4dl-nb)
#     language: python
#     name: mpi4dl-nb
# ---

# %% [markdown]
# # 01 — Parallelism schemes and the rank layout
#
# **What you will learn**: the five ways mpi4dl-nb splits training over MPI ranks, how to describe a
# configuration (`ParallelConfig`), how many ranks it needs and what each rank does, how much memory each
# rank needs, and which scheme to choose when.
#
# **What you need**: Python and PyTorch basics; no GPU (the notebook starts 5 MPI ranks on this machine);
# about a minute.
#
# Training a CNN on a 2048-16384 px pathology tile runs out of memory because of *activations*: the
# feature maps autograd keeps for the backward pass. Those of the first layers are the largest (full
# resolution, before any stride); the weights are small. Splitting the image into tiles (spatial
# parallelism) divides exactly those activations; splitting the model into stages divides the rest.
# Below we compute how much each split saves. mpi4dl-nb combines five ways to split the work (MPI4DL's "5D"
# hybrid parallelism):
#
# | scheme | splits | knob |
# |---|---|---|
# | spatial (SP) | the image into tiles with halos, one per rank | `spatial_size`, `num_spatial_parts`, `slice_method` |
# | layer (LP) | the model into consecutive stages | `split_size`, `balance` |
# | pipeline (PP) | the batch into micro-batches through the stages | `parts`, `schedule` |
# | GEMS | a mirrored second replica on the same ranks | `times` |
# | data (DP) | whole replicas (`data_parallel`) or only LP stages (`local_dp`) | |
#
# A configuration is pure data: `ParallelConfig`. Before any engine starts it tells how
# many ranks it needs and what each rank does.

# %%
import torch

import mpi4dl_nb as dl
from mpi4dl_nb import viz

torch.set_num_threads(1)

# %%
cfg = dl.ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, slice_method="square")
print("world size:", cfg.world_size, "=", cfg.describe_world())
from mpi4dl_nb.layout import layout_table

print(layout_table(cfg))
viz.show(viz.draw_rank_layout(cfg))

# %% [markdown]
# The flagship layout of notebook 04: stage 0 is spatial, cut into a 2 x 2 grid of tiles on ranks 0-3;
# stage 1 is a plain layer stage on rank 4, which receives the four tiles' outputs (the *hand-off*). Read
# the world size as "4 tile ranks for the spatial stage + 1 rank per layer stage".

# %% [markdown]
# Three more layouts: layer parallelism with local data parallelism on the LP stages (`local_dp=2`: each
# layer stage runs as 2 *copies*, each on half of every micro-batch), GEMS (a mirror replica laid in
# reverse order on the same ranks), and plain data parallelism (2 full replicas of a 2-stage pipeline):

# %%
for knobs in (dict(split_size=3, spatial_size=1, num_spatial_parts=2, slice_method="vertical", local_dp=2),
              dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="horizontal", times=1),
              dict(split_size=2, spatial_size=0, data_parallel=2, parts=2)):
    c = dl.ParallelConfig(**knobs)
    print(knobs, "->", c.world_size, "ranks")
    viz.show(viz.draw_rank_layout(c))

# %% [markdown]
# In the first figure the two layer stages each have two copies (4 ranks) behind a 2-tile spatial stage:
# `local_dp` multiplies only the LP ranks. In the GEMS figure every rank holds two stages (one per
# direction), so weights double per rank while idle time halves. In the last, each replica sees half the
# batch: with data parallelism the *effective batch size* of one optimizer step is the global batch you
# pass, split over replicas (per-replica batch = batch / `data_parallel`), so scale the batch (and learning
# rate) with the number of replicas.
#
# Bad settings are refused up front, with the knob and a fix:

# %%
for knobs in (dict(num_spatial_parts=3), dict(split_size=1, spatial_size=2), dict(fused_layers=2)):
    try:
        dl.ParallelConfig(**knobs)
    except dl.ConfigError as err:
        print(f"{knobs}: {err}")
try:
    dl.ParallelConfig(parts=2).validate(batch_size=3)
except dl.ConfigError as err:
    print(err)

# %% [markdown]
# ## The configuration panel
#
# Every change re-validates; the rank layout, world size and the planner's per-rank memory
# estimate follow. (Below we set values from code, as a test does; in JupyterLab just type.) The model is
# a ResNet "v2" (pre-activation residual blocks: BatchNorm and ReLU before each convolution).

# %%
from mpi4dl_nb.models import build_model
from mpi4dl_nb.notebook.widgets import ConfigPanel

model = build_model("resnet", num_layers=11, num_filters=8, num_classes=2)
panel = ConfigPanel(model=model, image_size=256, batch_size=2, devices=8)
panel.widget

# %%
panel.set(num_spatial_parts=3)
print("after num_spatial_parts=3:", panel.error)
panel.set(slice_method="vertical")
print("after slice_method='vertical': world size", panel.config.world_size)
print(panel.plan.table())

# %% [markdown]
# The table's columns, per rank, in MB: `params`, `grads` and `optim` (optimizer state: SGD momentum) for
# the layers the rank holds; `activ`, the activations kept for the backward pass; `trans`, *transient*
# buffers alive only for a moment (the largest layer output being computed, a received hand-off, gradients
# being sent back). The planner profiles the layers on PyTorch's *meta device* (tensors with shapes but no
# data), so an estimate at any image size is instant and allocates nothing.
#
# ## Exercise: memory per rank against `num_spatial_parts` and `balance`
#
# **Predict** before running: at 2048 px, with the model above cut into 2 stages (spatial + layer), how much
# memory does the *largest* rank need, as a share of one process, with 2 and with 4 tiles? Does it matter
# where the cut is (`balance=(2, 3)`: by layer count, stem + block 1 on the spatial stage; `balance=(4, 1)`:
# everything but the classifier head)? Write your guesses in `my_guess`, run, compare; then change
# `IMAGE_SIZE`, `PARTS` or `BALANCES`.

# %%
from mpi4dl_nb import planner

IMAGE_SIZE, PARTS, BALANCES = 2048, (2, 4), ((2, 3), (4, 1))
my_guess = {(4, (4, 1)): 0.25}         # (tiles, balance) -> your guess of largest rank / one process

one_process = planner.estimate_memory(model, dl.ParallelConfig(split_size=1, spatial_size=0), IMAGE_SIZE, 2).peak
print(f"one process at {IMAGE_SIZE} px, batch 2: {one_process / 2**20:,.0f} MB")
print(f"{'tiles':>5} {'balance':>8} {'tile rank MB':>13} {'layer rank MB':>14} {'largest / one':>14}",
      f"{'your guess':>11}")
shares = {}
for parts in PARTS:
    for balance in BALANCES:
        knobs = dict(split_size=2, spatial_size=1, num_spatial_parts=parts, balance=balance,
                     slice_method="square" if parts == 4 else "vertical")
        totals = planner.estimate_memory(model, dl.ParallelConfig(**knobs), IMAGE_SIZE, 2).totals
        shares[parts, balance] = max(totals) / one_process
        guess = my_guess.get((parts, balance))
        print(f"{parts:5} {str(balance):>8} {totals[0] / 2**20:13,.0f} {totals[-1] / 2**20:14,.0f} "
              f"{shares[parts, balance]:14.2f} {'-' if guess is None else f'{guess:.2f}':>11}")
if (4, (2, 3)) in shares and (4, (4, 1)) in shares:
    assert shares[4, (4, 1)] < shares[4, (2, 3)], "cutting after the blocks should relieve the layer rank"

# %% [markdown]
# With the cut by layer count (`(2, 3)`), the layer rank receives the full-resolution output of block 1
# and keeps the activations of every later block: it needs most of what one process needs (over 80% in
# the table) whatever the number of tiles, so the split buys little. With `(4, 1)` the high-resolution
# layers are all on the tiles, each tile rank holds about `1/tiles` of them (plus halos and weights), and
# the largest rank drops to about half (2 tiles) and a quarter (4 tiles) of one process. That is the rule:
# SP for the early, high-resolution layers, LP for the small late ones.
#
# ## Which scheme when: a decision guide
#
# * **Model and one image fit a device, you want throughput** -> data parallelism (`data_parallel=k`):
#   k replicas, one gradient all-reduce per step. The *effective batch* of a step stays the global batch you
#   pass (each replica gets batch / k): scale batch and learning rate with k.
# * **One image's activations do not fit** (pathology tiles of 2048 px and up) -> spatial for the first
#   stage(s) + layer stage(s) for the rest (`spatial_size=1`, `num_spatial_parts=P`, a `balance` that keeps
#   the high-resolution layers on the spatial stage). Measured: spatial-stage activations per rank 0.50x
#   (2 tiles) and 0.25x (4 tiles) of one process (BENCHMARKS.md §2c); ResNet-29 at 512 px, 2 tiles + 1 layer
#   rank: largest rank 0.46x (§5); a 2048² conv stack runs 1.79x faster on 2 tiles (§2b).
# * **The image fits, the weights or late activations do not** -> layer parallelism (`split_size=S`):
#   ResNet-29 at 512 px on 2 stages, largest rank 0.58x (§5); no speed-up alone (one stage works at a time).
# * **Layer parallelism with a batch > 1** -> pipeline (`parts=m`, 4-8; `schedule="1f1b"` keeps fewer
#   micro-batches alive): 2 stages run 1.46x (m=4) and 1.51x (m=8) faster than m=1 (§3); bubble
#   (S-1)/(m+S-1), notebook 03.
# * **Layer parallelism with batch 1** (nothing to pipeline) -> GEMS (`times=1`): 1.53x plain LP at batch 1
#   on 2 stages (§3); each rank holds two stages' weights.
# * **More devices than one replica needs** -> `local_dp` (copies of the layer stages only) or
#   `data_parallel` (whole replicas), on the part that is the bottleneck.
#
# Speed figures were measured on a 2-core CPU machine; on GPU nodes (one rank per GPU) compute dominates and
# the communication share shrinks. Notebook 05 lets the planner pick among valid configurations for a memory
# budget.

# %% [markdown]
# ## The same layout on a real MPI cluster
#
# `dl.cluster.start(n)` launches `n` ipyparallel engines as one `mpiexec` job (MPICH here;
# Open MPI flags are handled). Each engine is one MPI rank; `cluster.run(f)` calls `f` on
# all of them and returns the results indexed by rank. Every call has a timeout.

# %%
cluster = dl.cluster.start(n=cfg.world_size)
cluster


# %%
def who_am_i(knobs):
    import mpi4dl_nb as dl
    ctx = dl.init()
    role = dl.layout(dl.ParallelConfig(**knobs))[ctx.rank]
    return f"rank {ctx.rank} of {ctx.world_size} on {ctx.device}: {role.describe()}"

for line in cluster.run(who_am_i, cfg.as_dict(), timeout=60):
    print(line)

# %% [markdown]
# Each engine reports the role `layout` gave its rank: the configuration, not the launch, decides who does
# what, so the same `ParallelConfig` drives the notebook cluster, `mpiexec` and Slurm jobs.
#
# ## What to try next
#
# * In the panel, set `times=1` and predict the world size and the memory of the largest rank before you look.
# * Raise `IMAGE_SIZE` in the exercise to 4096 and `PARTS` to `(2, 4, 8)` (with `slice_method` square for 4,
#   vertical otherwise): when does the layer rank become the largest again?
# * Notebook 02 shows what a tile's halo is; 04 trains the flagship layout and checks it against one process.

# %%
cluster.stop()
