# ---
# jupyter:
#   kernelspec:
#     display_name: Python (mpi4dl-nb)
#     language: python
#     name: mpi4dl-nb
# ---

# %% [markdown]
# # 05 — Tuning split and spatial sizes with the planner and measured runs
#
# The planner predicts every rank's peak memory (the model's own layers run shape-only on
# PyTorch's `meta` device, along the real schedule: no memory, any image size) and the step
# time (layer times measured once, a network model, the schedule replayed in simulated time).
# `suggest` lists the configurations that fit a memory limit, fastest first, and says what
# binds each one. Then the auto-tune runs the top ones on the cluster, next to one process.

# %%
import torch

import mpi4dl_nb as dl
from mpi4dl_nb import viz

torch.set_num_threads(1)

# %%
from mpi4dl_nb import planner
from mpi4dl_nb.measure.trials import ModelSpec

spec = ModelSpec("resnet", num_layers=11, num_filters=16, num_classes=2)
model = spec.build()
IMAGE, BATCH, RANKS = 128, 2, 5
one = planner.estimate_memory(model, dl.ParallelConfig(split_size=1, spatial_size=0), IMAGE, BATCH)
LIMIT = 0.6 * one.peak
print(f"one process needs {one.peak / 2**20:.1f} MB; limit per rank {LIMIT / 2**20:.1f} MB")
found = planner.suggest(model, IMAGE, LIMIT, devices=RANKS, batch_size=BATCH, top=6)
print(found.table(refused=False))
print(f"\n{len(found.refused)} configurations on {RANKS} ranks do not fit, e.g.:")
for refusal in found.refused[-3:]:
    print("  ", refusal.describe())

# %% [markdown]
# The memory estimate of the first suggestion, term by term, at each rank's peak moment:

# %%
best = found[0]
print(planner.describe_config(best.cfg))
print(best.memory.table())

# %%
from mpi4dl_nb.notebook.widgets import ConfigPanel

panel = ConfigPanel(best.cfg, model=model, image_size=IMAGE, batch_size=BATCH, devices=RANKS)
panel.widget

# %% [markdown]
# Auto-tune on 5 MPI ranks: the one-process reference and the planner's top 2, built side by
# side (a warm-up and a memory-measured step each), then two timed steps of each, one step of
# every configuration in turn so a slow spell of the machine falls on all of them alike;
# predicted next to measured; the fastest configuration whose measured peak fits the limit is
# picked.

# %%
from mpi4dl_nb.notebook.widgets import AutoTune

cluster = dl.cluster.start(n=RANKS)
tuner = AutoTune(cluster, spec, IMAGE, BATCH, memory_limit_mb=LIMIT / 2**20, top=2, steps=2)
tuner.widget

# %%
result = tuner.run()
print(result.table())
assert result.best is not None and tuner.best is not None
assert [row.cfg for row in result.candidates] == [s.cfg for s in result.suggestions]

# %% [markdown]
# The first row is one process on every core, the reference each parallel configuration is
# compared with; the candidates are exactly the ones `suggest` listed above, in its order.
#
# When a prediction is off, `result.explain()` (the closed section under the widget) says
# where: each rank's predicted and traced seconds per step by action - forward, backward,
# waiting for a stage's input or gradient, the gradient all-reduce - and the largest gap.

# %%
print(result.explain())
assert result.explain().count("largest gap: rank ") == len(result.candidates)

# %% [markdown]
# One knob at a time: around the picked configuration, every valid change of a single knob
# on the same 5 ranks (`planner.one_knob_variants`), predicted next to measured, so each
# difference in the table has one cause.

# %%
sweep = tuner.sweep(knobs=("parts", "slice_method", "num_spatial_parts", "halo_d2"))
print(sweep.table())
assert all(row.measured is not None for row in sweep.rows)

# %% [markdown]
# Per-rank memory of the picked configuration, measured against the estimate:

# %%
picked = result.best   # the auto-tune's pick (the sweep above does not change it)
plan = planner.estimate_memory(model, picked.cfg, IMAGE, BATCH)
viz.show(viz.draw_memory_bars(list(picked.measured.peaks), plan.totals))
cluster.stop()
