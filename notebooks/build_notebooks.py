"""Write the tutorial notebooks 01..06 (without outputs) from the cell sources below.

Run ``python notebooks/build_notebooks.py`` after editing; the .ipynb files are generated.
Sizes are small so every notebook runs top to bottom in about a minute on 2 cores.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
KERNEL = {"name": "mpi4dl-nb", "display_name": "Python (mpi4dl-nb)", "language": "python"}


def md(text: str) -> nbformat.NotebookNode:
    return new_markdown_cell(text.strip())


def code(text: str) -> nbformat.NotebookNode:
    return new_code_cell(text.strip())


SETUP = code("""
import torch
import mpi4dl_nb as dl
from mpi4dl_nb import viz
torch.set_num_threads(1)
""")

# ---------------------------------------------------------------------------- 01
NB01 = [
    md("""
# 01 — Parallelism schemes and the rank layout

Training a CNN on a 16k x 16k pathology tile runs out of memory in the *first* layers:
their activations are huge, the weights are small. mpi4dl-nb combines five ways to split
the work (MPI4DL's "5D" hybrid parallelism):

| scheme | splits | knob |
|---|---|---|
| spatial (SP) | the image into tiles, one per rank; convs exchange halos | `spatial_size`, `num_spatial_parts`, `slice_method` |
| layer (LP) | the model into consecutive stages | `split_size`, `balance` |
| pipeline (PP) | the batch into micro-batches through the stages | `parts`, `schedule` |
| GEMS | a mirrored second replica on the same ranks | `times` |
| data (DP) | whole replicas (`data_parallel`) or only LP stages (`local_dp`) | |

A configuration is pure data: `ParallelConfig`. Before any engine starts it tells how
many ranks it needs and what each rank does.
"""),
    SETUP,
    code("""
cfg = dl.ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, slice_method="square")
print("world size:", cfg.world_size, "=", cfg.describe_world())
from mpi4dl_nb.layout import layout_table
print(layout_table(cfg))
viz.show(viz.draw_rank_layout(cfg))
"""),
    md("Layer parallelism with local data parallelism on the LP stages, and GEMS (a mirror replica laid in reverse order on the same ranks):"),
    code("""
for knobs in (dict(split_size=3, spatial_size=1, num_spatial_parts=2, slice_method="vertical", local_dp=2),
              dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="horizontal", times=1),
              dict(split_size=2, spatial_size=0, data_parallel=2, parts=2)):
    c = dl.ParallelConfig(**knobs)
    print(knobs, "->", c.world_size, "ranks")
    viz.show(viz.draw_rank_layout(c))
"""),
    md("Bad settings are refused up front, with the knob and a fix:"),
    code("""
for knobs in (dict(num_spatial_parts=3), dict(split_size=1, spatial_size=2), dict(fused_layers=2)):
    try:
        dl.ParallelConfig(**knobs)
    except dl.ConfigError as err:
        print(f"{knobs}: {err}")
try:
    dl.ParallelConfig(parts=2).validate(batch_size=3)
except dl.ConfigError as err:
    print(err)
"""),
    md("""
## The configuration panel

Every change re-validates; the rank layout, world size and the planner's per-rank memory
estimate follow. (Below we set values from code, as a test does; in JupyterLab just type.)
"""),
    code("""
from mpi4dl_nb.models import build_model
from mpi4dl_nb.notebook.widgets import ConfigPanel
model = build_model("resnet", num_layers=11, num_filters=8, num_classes=2)
panel = ConfigPanel(model=model, image_size=256, batch_size=2, devices=8)
panel.widget
"""),
    code("""
panel.set(num_spatial_parts=3)
print("after num_spatial_parts=3:", panel.error)
panel.set(slice_method="vertical")
print("after slice_method='vertical': world size", panel.config.world_size)
print(panel.plan.table())
"""),
    md("""
## The same layout on a real MPI cluster

`dl.cluster.start(n)` launches `n` ipyparallel engines as one `mpiexec` job (MPICH here;
Open MPI flags are handled). Each engine is one MPI rank; `cluster.run(f)` calls `f` on
all of them and returns the results indexed by rank. Every call has a timeout.
"""),
    code("""
cluster = dl.cluster.start(n=cfg.world_size)
cluster
"""),
    code("""
def who_am_i(knobs):
    import mpi4dl_nb as dl
    ctx = dl.init()
    role = dl.layout(dl.ParallelConfig(**knobs))[ctx.rank]
    return f"rank {ctx.rank} of {ctx.world_size} on {ctx.device}: {role.describe()}"

for line in cluster.run(who_am_i, cfg.as_dict(), timeout=60):
    print(line)
"""),
    code("cluster.stop()"),
]

# ---------------------------------------------------------------------------- 02
NB02 = [
    md("""
# 02 — Slicing and halos on a pathology tile

Spatial parallelism gives every rank one tile of the image. A 3x3 convolution near a
tile border needs pixels of the neighbour: the *halo*. The geometry is pure index math
(`dl.TileGrid`): each rank owns a range of the output, the input range it needs minus
the range it has is the halo per side. Exchanges go rows first, then columns over the
full needed row range, so corners arrive without diagonal messages.
"""),
    SETUP,
    code("""
from mpi4dl_nb.data.sample import ihc_image
image = ihc_image()            # a real IHC-stained colon tissue tile, 512x512 RGB
grid = dl.TileGrid.from_slice_method("square", 4)
print(grid, [grid.tile_box(t, 512, 512) for t in range(grid.num_tiles)])
viz.show(viz.draw_tiles_and_halos(image, grid))
"""),
    code("""
halo = grid.layer_halo(512, 512, kernel=3, stride=1, padding=1, name="conv 3x3")
print(halo.describe())
viz.show(viz.draw_tiles_and_halos(image, grid, halo))
"""),
    md("Wider windows need wider halos; strides shrink the map (the halo of layer *k* lives on its own feature map, scaled onto the image here). Tile 0's bands, corner included:"),
    code("""
wide = grid.layer_halo(128, 128, kernel=7, stride=2, padding=3, name="conv 7x7 / 2 on a 128x128 map")
print(viz.halo_bands(wide.tile(0), 128, 128))
viz.show(viz.draw_tiles_and_halos(image, grid, wide, tiles=[0]))
"""),
    md("The halo viewer walks the convs/pools of a real model (ResNet here) at its feature-map sizes:"),
    code("""
from mpi4dl_nb.models import build_model
from mpi4dl_nb.notebook.widgets import HaloViewer
model = build_model("resnet", num_layers=11, num_filters=8, num_classes=2)
viewer = HaloViewer(image, model, image_size=512)
viewer.widget
"""),
    code("""
viewer.tile_choice.value = 3
viewer.slice_choice.value = "vertical"
print(viewer.describe())
"""),
    md("""
## The exchange for real, on 4 MPI ranks

`dl.spatialize` turns the conv into one that exchanges halos (forward) and sends halo
gradients back (backward, the exact adjoint). Output and weight gradient equal the
single-process conv in float64.
"""),
    code("""
cluster = dl.cluster.start(n=4)
"""),
    code("""
def tiled_conv(pixels):
    import torch
    from torch import nn
    import mpi4dl_nb as dl
    ctx = dl.init()
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1).double()
    x = torch.tensor(pixels).permute(2, 0, 1)[None].double() / 255
    reference = conv(x)
    reference.square().sum().backward()
    ref_grad = conv.weight.grad.clone()
    conv.zero_grad()
    grid = dl.TileGrid(2, 2)
    net = dl.spatialize(conv, grid, ctx)
    tile = dl.scatter_tiles(x, grid, ctx)
    out_tile = net(tile)
    out_tile.square().sum().backward()
    full = dl.gather_tiles(out_tile.detach(), grid, ctx)
    grad = conv.weight.grad.clone()
    ctx.all_reduce(grad)                    # tile shares of the weight gradient add up
    return (tuple(tile.shape), float((full - reference).abs().max()),
            float((grad - ref_grad).abs().max()))

for rank, (shape, out_err, grad_err) in enumerate(cluster.run(tiled_conv, image[:128, :128], timeout=120)):
    print(f"rank {rank}: tile {shape}, max |output - serial| = {out_err:.1e}, max |dW - serial| = {grad_err:.1e}")
"""),
    code("cluster.stop()"),
]

# ---------------------------------------------------------------------------- 03
NB03 = [
    md("""
# 03 — Layer, pipeline and GEMS schedules, step by step

A schedule is plain data: per rank, per tick, forward (`F`) or backward (`B`) of a
micro-batch, sends and receives, the gradient all-reduce (`AR`) and the optimizer step.
The runtime executes exactly this object — and the step-through debugger walks it.
"""),
    SETUP,
    code("""
from mpi4dl_nb.pipeline import schedules
print(schedules.gpipe(3, 4).table())
print()
print(schedules.one_f_one_b(3, 4).table())
print()
print(schedules.gems(2, 1, times=1).table())
print("GPipe bubble with 3 stages and 4 micro-batches:", schedules.ideal_bubble_fraction(3, 4))
"""),
    md("Schedule only (nothing runs): forward walks the global order, back goes back."),
    code("""
from mpi4dl_nb.notebook.widgets import StepThrough
cfg = dl.ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical", parts=2)
dry = StepThrough(schedules.build_schedule(cfg))
for _ in range(3):
    dry.forward()
print(dry.label.value)
dry.widget
"""),
    md("""
## Stepping the real thing

Now the same schedule on 3 MPI ranks (2 tiles of a spatial stage + 1 layer stage). Each
forward click releases one action on its rank: `HybridEngine.train_step` waits before every
action until the notebook lets it go. A tile's forward waits for its neighbour's halo,
so it completes when the neighbour's forward is released.
"""),
    code("""
cluster = dl.cluster.start(n=cfg.world_size)

def setup(knobs, seed=0):
    import torch
    from torch import nn
    import mpi4dl_nb as dl
    from mpi4dl_nb.models import build_model
    global eng, images, labels
    torch.set_num_threads(1)
    ctx = dl.init()
    torch.manual_seed(seed)
    layers = build_model("resnet", num_layers=11, num_filters=4, num_classes=2)
    eng = dl.HybridEngine(layers, dl.ParallelConfig(**knobs), ctx, loss_fn=nn.CrossEntropyLoss(),
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    images, labels = torch.randn(2, 3, 32, 32), torch.tensor([0, 1])
    return ctx.rank

cluster.run(setup, cfg.as_dict(), timeout=120)
"""),
    code("""
from mpi4dl_nb.notebook.widgets import ClusterStepAgent
agent = ClusterStepAgent(cluster, engine="eng", images="images", labels="labels", settle=1.0)
stepper = StepThrough(agent.fetch_schedule(), agent)
for _ in range(4):
    stepper.forward()
    print(stepper.label.value)
    print("   ", stepper.details.value.replace("<br>", "\\n    "))
stepper.widget
"""),
    code("""
stepper.run_to_end()
print(stepper.details.value)
assert stepper.error is None
"""),
    md("## Timeline of a normal step (Gantt per rank from the trace)"),
    code("""
def traced_step():
    eng.ctx.tracer.clear()
    eng.train_step(images, labels)
    return eng.timeline(clear=True)

events = cluster.run(traced_step, timeout=120)[0]
from mpi4dl_nb.notebook.widgets import TimelineView
timeline = TimelineView(events)
viz.show(timeline.view.figure)
timeline.widget
"""),
    code("cluster.stop()"),
]

# ---------------------------------------------------------------------------- 04
NB04 = [
    md("""
# 04 — Hybrid SP + LP training on pathology tiles, checked against one process

The flagship: a ResNet (v2) whose first stage runs spatially on 4 tiles (2x2) and whose
second stage runs on a fifth rank — 5 MPI ranks. We train a few steps on crops of a real
IHC-stained tissue image in float64 and compare loss, and every weight after the updates,
with the same model trained in this notebook on one process.
"""),
    SETUP,
    code("""
import json, time
import numpy as np
from torch import nn
from mpi4dl_nb.models import build_model
from mpi4dl_nb.data.sample import IHCSampleDataset

IMAGE, BATCH, STEPS, DEPTH, WIDTH = 128, 2, 3, 11, 8
cfg = dl.ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, slice_method="square")
data = IHCSampleDataset(IMAGE, num_classes=2)
picks = [[(7 * (step * BATCH + i)) % len(data) for i in range(BATCH)] for step in range(STEPS)]
batches = [(torch.stack([data.read(i) for i in idx]).double(), torch.tensor([data.label(i) for i in idx]))
           for idx in picks]
print(cfg.world_size, "ranks:", cfg.describe_world(), "| dataset:", len(data), "crops")
viz.show(viz.draw_rank_layout(cfg))
grid = dl.TileGrid.from_slice_method(cfg.slice_method, cfg.num_spatial_parts)
first = grid.layer_halo(IMAGE, IMAGE, kernel=3, padding=1, name="stem conv 3x3")
viz.show(viz.draw_tiles_and_halos(batches[0][0][0], grid, first))
"""),
    code("""
def make_model():
    import torch
    from mpi4dl_nb.models import build_model
    torch.manual_seed(0)
    return [layer.double() for layer in build_model("resnet", num_layers=DEPTH, num_filters=WIDTH, num_classes=2)]

def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)

cluster = dl.cluster.start(n=cfg.world_size)
cluster.execute("import torch")
cluster.push({"DEPTH": DEPTH, "WIDTH": WIDTH, "make_model": make_model, "optimizer": optimizer})

def setup(knobs):
    import torch
    from torch import nn
    import mpi4dl_nb as dl
    global eng
    torch.set_num_threads(1)
    ctx = dl.init()
    eng = dl.HybridEngine(make_model(), dl.ParallelConfig(**knobs), ctx,
                          loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer)
    return ctx.rank

cluster.run(setup, cfg.as_dict(), timeout=120)
"""),
    md("Train on the cluster with a progress bar (each step is one remote call with a timeout):"),
    code("""
from mpi4dl_nb.notebook.widgets import TrainingProgress

def train_step(images, labels):
    return eng.train_step(images, labels)

progress = TrainingProgress(STEPS)
display(progress.widget)
parallel_losses = progress.run(lambda i: cluster.run(train_step, *batches[i - 1], timeout=300)[0],
                               images_per_step=BATCH)
images_per_second = float(np.mean(progress.images_per_second))
print("losses:", parallel_losses, f"| {images_per_second:.2f} images/s")
"""),
    md("The same training on one process:"),
    code("""
serial = nn.Sequential(*make_model())
serial_opt = optimizer(serial.parameters())
serial_losses = []
for images, labels in batches:
    serial_opt.zero_grad(set_to_none=True)
    loss = nn.CrossEntropyLoss()(serial(images), labels)
    loss.backward()
    serial_opt.step()
    serial_losses.append(loss.item())

def full_state():
    return eng.full_state_dict()

parallel_state = cluster.run(full_state, timeout=120)[0]
serial_state = serial.state_dict()
loss_error = max(abs(a - b) for a, b in zip(parallel_losses, serial_losses))
weight_error = max(float((parallel_state[k].double() - v.double()).abs().max()) for k, v in serial_state.items())
exact = loss_error < 1e-10 and weight_error < 1e-10
print(f"max |loss difference| = {loss_error:.2e}, max |weight difference| = {weight_error:.2e} "
      f"over {len(serial_state)} tensors (weights, BatchNorm statistics) -> exact: {exact}")
assert exact
"""),
    md("Per-rank memory: measured peak of one step against the planner's estimate:"),
    code("""
from mpi4dl_nb import planner

def measure(images, labels):
    from mpi4dl_nb.notebook.planner import measure_engine_step
    return measure_engine_step(eng, images, labels, warmup=0)

measured = cluster.run(measure, *batches[0], timeout=300)
plan = planner.estimate_memory(make_model(), cfg, IMAGE, BATCH, dtype=torch.float64)
print(plan.table())
for rank, (est, got) in enumerate(zip(plan.totals, measured)):
    print(f"rank {rank}: estimate {est / 2**20:6.1f} MB, measured {got / 2**20:6.1f} MB, ratio {est / got:.2f}")
viz.show(viz.draw_memory_bars(measured, plan.totals))
"""),
    md("Where the time goes (trace of one step):"),
    code("""
def traced(images, labels):
    eng.ctx.tracer.clear()
    eng.train_step(images, labels)
    return eng.timeline(clear=True)

events = cluster.run(traced, *batches[0], timeout=300)[0]
viz.show(viz.draw_timeline(events))
"""),
    code("""
summary = {"configuration": cfg.as_dict(), "world_size": cfg.world_size, "image_size": IMAGE,
           "batch_size": BATCH, "steps": STEPS, "exact": bool(exact), "max_loss_error": loss_error,
           "max_weight_error": weight_error, "images_per_second": images_per_second,
           "memory_measured_mb": [round(m / 2**20, 2) for m in measured],
           "memory_estimate_mb": [round(e / 2**20, 2) for e in plan.totals]}
print("MPI4DL_SUMMARY " + json.dumps(summary))
cluster.stop()
"""),
]

# ---------------------------------------------------------------------------- 05
NB05 = [
    md("""
# 05 — Tuning split and spatial sizes with the planner and measured runs

The planner estimates every rank's peak memory from layer shapes (profiled on PyTorch's
`meta` device: no memory, any image size) and the schedule; `suggest` ranks the
configurations that fit a memory budget. Then we measure a few of them on the cluster.
"""),
    SETUP,
    code("""
from mpi4dl_nb import planner
from mpi4dl_nb.models import build_model
model = build_model("resnet", num_layers=11, num_filters=16, num_classes=2)
IMAGE, BATCH = 128, 2
one = planner.estimate_memory(model, dl.ParallelConfig(split_size=1, spatial_size=0), IMAGE, BATCH)
print(f"one device needs {one.peak / 2**20:.1f} MB")
for s in planner.suggest(model, IMAGE, 0.75 * one.peak, devices=5, batch_size=BATCH, top=8):
    print(s.describe())
"""),
    code("""
from mpi4dl_nb.notebook.widgets import ConfigPanel
panel = ConfigPanel(model=model, image_size=IMAGE, batch_size=BATCH, devices=5)
panel.set(num_spatial_parts=2, slice_method="vertical")
panel.widget
"""),
    md("Measured on 3 MPI ranks: time per step and peak memory per rank, next to the estimate."),
    code("""
candidates = [dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical"),
              dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="horizontal", parts=2),
              dict(split_size=3, spatial_size=0, parts=2)]
cluster = dl.cluster.start(n=3)

def run_config(knobs, image, batch):
    import time, torch
    from torch import nn
    import mpi4dl_nb as dl
    from mpi4dl_nb.models import build_model
    from mpi4dl_nb.notebook.planner import measure_engine_step
    torch.set_num_threads(1)
    ctx = dl.init()
    torch.manual_seed(0)
    eng = dl.HybridEngine(build_model("resnet", num_layers=11, num_filters=16, num_classes=2),
                          dl.ParallelConfig(**knobs), ctx, loss_fn=nn.CrossEntropyLoss(),
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
    x, y = torch.randn(batch, 3, image, image), torch.randint(0, 2, (batch,))
    peak = measure_engine_step(eng, x, y)
    start = time.perf_counter()
    eng.train_step(x, y)
    return peak, time.perf_counter() - start

rows = []
for knobs in candidates:
    c = dl.ParallelConfig(**knobs)
    plan = planner.estimate_memory(model, c, IMAGE, BATCH)
    results = cluster.run(run_config, knobs, IMAGE, BATCH, timeout=300)
    measured = [peak for peak, _ in results]
    seconds = max(t for _, t in results)
    rows.append((knobs, plan.totals, measured, seconds))
    print(knobs, f"step {seconds:.2f} s")
    for rank, (e, m) in enumerate(zip(plan.totals, measured)):
        print(f"   rank {rank}: estimate {e / 2**20:6.1f} MB  measured {m / 2**20:6.1f} MB  ratio {e / m:.2f}")
cluster.stop()
"""),
    code("""
from matplotlib.figure import Figure
fig = Figure(figsize=(10, 3))
for k, (knobs, est, got, _) in enumerate(rows):
    viz.draw_memory_bars(got, est, ax=fig.add_subplot(1, len(rows), k + 1))
    fig.axes[-1].set_title(", ".join(f"{a}={b}" for a, b in knobs.items() if a != "slice_method"), fontsize=7)
viz.show(fig)
"""),
]

# ---------------------------------------------------------------------------- 06
NB06 = [
    md("""
# 06 — From notebook to batch job (mpiexec, Slurm)

Everything the notebook drove through the cluster is the same engine code that batch jobs
run under `mpiexec` (and Slurm's `srun`). The CLI keeps MPI4DL's flag names.
"""),
    SETUP,
    code("""
import os, subprocess, sys
from pathlib import Path
bin_dir = Path(sys.executable).parent
env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", **dl.cluster.ENGINE_ENV)
flags = ["--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "2",
         "--slice-method", "vertical", "--image-size", "32", "--batch-size", "2",
         "--num-layers", "11", "--num-filters", "4", "--num-classes", "2", "--app", "synthetic"]
print(subprocess.run([sys.executable, "-m", "mpi4dl_nb", "layout", *flags], capture_output=True,
                     text=True, env=env, timeout=120).stdout)
"""),
    code("""
command = [str(bin_dir / "mpiexec"), "-n", "3", sys.executable, "-m", "mpi4dl_nb", "train", *flags,
           "--steps", "2", "--no-progress"]
print(" ".join(command[2:]))
result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
print(result.stdout[-2000:])
print(result.stderr[-2000:])
assert result.returncode == 0
"""),
    md("""
## On a Slurm cluster

The same command in an `sbatch` script (one MPI rank per task). The notebook cluster can
also run there: `dl.cluster.start(n, launcher="slurm", slurm_options=[...])` submits the
engines as a Slurm job (see `engines/README.md`), or `launcher="hostfile"` spreads
`mpiexec` over the hosts of a hostfile.
"""),
    code("""
def sbatch_script(ranks, flags, partition="gpu", hours=2):
    lines = ["#!/bin/bash", f"#SBATCH --ntasks={ranks}", f"#SBATCH --partition={partition}",
             f"#SBATCH --time={hours}:00:00", "#SBATCH --gpus-per-task=1",
             *(f"export {k}={v}" for k, v in dl.cluster.ENGINE_ENV.items()),
             "srun python -m mpi4dl_nb train " + " ".join(flags)]
    return "\\n".join(lines)

print(sbatch_script(3, flags))
print()
print(dl.cluster.slurm_batch_template(["--partition=gpu", "--time=02:00:00"], {"OMP_NUM_THREADS": "1"}))
"""),
    code("""
print("mpiexec flags for MPICH:  ", dl.cluster.mpi_launch_args("mpich", {"OMP_NUM_THREADS": "1"}, hostfile="hosts.txt"))
print("mpiexec flags for Open MPI:", dl.cluster.mpi_launch_args("openmpi", {"OMP_NUM_THREADS": "1"}, hostfile="hosts.txt"))
"""),
]

NOTEBOOKS = {
    "01_parallelism_and_layout.ipynb": NB01,
    "02_slicing_and_halos.ipynb": NB02,
    "03_schedules_step_by_step.ipynb": NB03,
    "04_hybrid_training_pathology.ipynb": NB04,
    "05_tuning_with_planner.ipynb": NB05,
    "06_notebook_to_batch_job.ipynb": NB06,
}


def build(directory: Path = HERE) -> list[Path]:
    """Write every notebook (no outputs) into ``directory``."""
    written = []
    for name, cells in NOTEBOOKS.items():
        notebook = new_notebook(cells=cells, metadata={"kernelspec": KERNEL,
                                                       "language_info": {"name": "python"}})
        path = directory / name
        nbformat.write(notebook, path)
        written.append(path)
    return written


if __name__ == "__main__":
    for path in build():
        print("wrote", path)
