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
# Training a CNN on a 16k x 16k pathology tile runs out of memory in the *first* layers:
# their activations are huge, the weights are small. mpi4dl-nb combines five ways to split
# the work (MPI4DL's "5D" hybrid parallelism):
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
# Layer parallelism with local data parallelism on the LP stages, and GEMS (a mirror replica laid in reverse order
# on the same ranks):

# %%
for knobs in (dict(split_size=3, spatial_size=1, num_spatial_parts=2, slice_method="vertical", local_dp=2),
              dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="horizontal", times=1),
              dict(split_size=2, spatial_size=0, data_parallel=2, parts=2)):
    c = dl.ParallelConfig(**knobs)
    print(knobs, "->", c.world_size, "ranks")
    viz.show(viz.draw_rank_layout(c))

# %% [markdown]
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
# estimate follow. (Below we set values from code, as a test does; in JupyterLab just type.)

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

# %%
cluster.stop()
