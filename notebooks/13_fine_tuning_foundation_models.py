# ---
# jupyter:
#   kernelspec:
#     display_name: Python (mpi4dl-nb)
#     language: python
#     name: mpi4dl-nb
# ---

# %% [markdown]
# # 13 — Fine-tuning a foundation model: UNI's trunk, LoRA and layer decay on 4 tiles, back to timm
#
# Pathology fine-tunes today by starting from a foundation model's trunk (UNI, Virchow2, Prov-GigaPath,
# H-optimus: timm vision transformers trained on millions of tiles), training a few low-rank adapters (LoRA) and a new
# head rather than all the weights, with a learning rate that shrinks block by block towards the input (layer
# decay), and handing the result back as a state dict of the original architecture. Here that whole recipe runs on
# 2 x 2 tiles of the bundled IHC sample, one tile per MPI rank, and equals one process in float64.
#
# **What you will learn**: how `--model uni` builds a published architecture from its preset (and `depth=2`
# makes it fit a laptop); what a *headless* weights file is and how a run loads it; what `--lora-rank` and
# `--layer-decay` train, and at which rate each parameter group learns step by step; how to check the fine-tuning
# on 4 ranks against one process yourself; how `export --merge-lora` hands the result back to timm; what the
# planner says fits of the full 24-block model, with and without LoRA.
#
# **What you need**: notebooks 04 (exactness against one process) and 12 (a ViT on token tiles); the `models` extra
# (timm: `make install` has it); 5 MPI ranks (started below); a minute or two. The trunk is UNI's ViT-L/16 at its full
# width (1024) but cut to 2 of its 24 blocks, on 224 x 224 crops, in float64: the commands are the same for the
# whole model and its real weights.

# %%
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import timm
import torch

import mpi4dl_nb as dl
from mpi4dl_nb.data.sample import IHCSampleDataset
from mpi4dl_nb.models.model_args import timm_resolver
from mpi4dl_nb.models.presets import PRESETS

torch.set_num_threads(1)
work = Path(tempfile.mkdtemp(prefix="mpi4dl-13-"))        # the notebook's files; removed at the end

# %% [markdown]
# ## The preset: a published architecture by name
#
# `--model uni` is timm's `vit_large_patch16_224` with the constructor arguments UNI's model card gives
# (LayerScale, `init_values=1e-5`), and the preprocessing the card feeds it: 224 x 224 tiles in [0, 1], normalised
# with the card's mean and std (ImageNet's for UNI). Your `--model-args` go over the preset's: `depth=2` keeps the
# first 2 of its 24 blocks, a short trial of the same architecture.

# %%
uni = PRESETS["uni"]
card = uni.preprocessing
ARGS = uni.args.keywords(timm_resolver(timm))           # timm's keywords: {'init_values': 1e-05}
print(f"--model uni: timm:{uni.architecture} with {uni.args}, from {uni.card}")
print(f"fed {card.input_size} x {card.input_size} tiles ({card.patch_size} px patches) normalised with "
      f"{card.normalization.describe()}: mean {card.normalization.mean}, std {card.normalization.std}")
print("other presets:", ", ".join(f"{p.name} ({p.architecture})" for p in PRESETS.values() if p is not uni))

# %% [markdown]
# ## A headless weights file
#
# Foundation models ship *headless*: the trunk's weights, saved with `num_classes=0`, no classifier. The real file
# comes from the card (UNI's is gated: accept its terms on Hugging Face, load it with timm as the card shows, then
# `torch.save(model.state_dict(), "uni.pth")`). Here a stand-in of the same shapes: timm's model of the preset's
# arguments at depth 2, drawn from a seed of its own and saved without a head, as the card's download would be.

# %%
DEPTH, SIZE = 2, 224
torch.manual_seed(7)
trunk = timm.create_model(uni.architecture, depth=DEPTH, num_classes=0, **ARGS)
weights_file = work / "uni_trunk.pth"
torch.save(trunk.state_dict(), weights_file)
start = dl.read_weights(weights_file)
print(f"{weights_file.name}: {len(start)} tensors, {sum(t.numel() for t in start.values()):,} numbers; "
      f"a head in it: {any(key.startswith('head') for key in start)}")

# %% [markdown]
# ## The IHC sample at 224 px, on 2 x 2 tiles
#
# The run reads `--app medical` (the bundled IHC-stained colon tissue when no `--datapath` is given): 224 x 224
# crops every 112 px, each in its 8 rotations and flips, labelled by their brown (DAB) stain, above or below the
# median. Each rank holds a 112 x 112 tile of a crop: 7 x 7 of the 16 px patches, so no patch crosses a seam.

# %%
crops = IHCSampleDataset(SIZE, num_classes=2)
figure, (left, right) = plt.subplots(1, 2, figsize=(8.4, 4.2))
left.imshow(crops.pixels)
for (y, x), label in zip(crops.corners, crops.crop_labels):
    left.plot(x + SIZE / 2, y + SIZE / 2, "o", ms=11, mec="white", color="tab:orange" if label else "tab:blue")
left.add_patch(plt.Rectangle((0, 0), SIZE - 1, SIZE - 1, fill=False, lw=2, color="white"))
left.set_title(f"{len(crops.corners)} crop centres: orange more DAB (class 1),\nblue less; white: crop 0", fontsize=9)
right.imshow(crops.read_pixels(0).permute(1, 2, 0).numpy())
for line in range(0, SIZE + 1, card.patch_size):
    right.axhline(line - 0.5, color="white", lw=0.3)
    right.axvline(line - 0.5, color="white", lw=0.3)
right.axhline(SIZE / 2 - 0.5, color="red", lw=2)
right.axvline(SIZE / 2 - 0.5, color="red", lw=2)
for rank in range(4):
    right.text(SIZE / 4 + SIZE / 2 * (rank % 2), SIZE / 4 + SIZE / 2 * (rank // 2), f"rank {rank}", ha="center",
               color="white", fontsize=10, weight="bold")
right.set_title("crop 0: 14 x 14 patches on 2 x 2 tiles", fontsize=9)
for axis in (left, right):
    axis.set_xticks([])
    axis.set_yticks([])
plt.show()

# %% [markdown]
# ## Fine-tuning on 4 tiles and a layer rank
#
# One set of settings, for the engines and for one process. The blocks run on the 4 tiles (a stage of 4 ranks, as
# in notebook 12), the head (final norm, pool, classifier) on a fifth rank: a ViT's head pools every token, so the
# spatial stage ends before it. `lora_rank=4` adapts the four linear layers of every block (`attn.qkv`, `attn.proj`,
# `mlp.fc1`, `mlp.fc2`) and freezes the rest but the head (final norm and a new classifier); `layer_decay=0.75`
# gives each block's parameters a rate 0.75 times the next block's; AdamW with a cosine schedule after one warm-up
# step. `dl.train` is `python -m mpi4dl_nb train` from Python, its keywords the flags; the command is printed.

# %%
SETTINGS = dict(model="uni", model_args=f"depth={DEPTH}", weights=str(weights_file), app="medical", image_size=SIZE,
                num_classes=2, batch_size=1, steps=4, seed=0, dtype="float64", optimizer="adamw", lr=1e-3,
                lr_schedule="cosine", warmup_steps=1, lora_rank=4, layer_decay=0.75)
TILES = dict(split_size=2, spatial_size=1, num_spatial_parts=4, slice_method="square")


def flags(settings):
    """The command-line flags of ``settings``."""
    return [item for key, value in settings.items() for item in (f"--{key.replace('_', '-')}", str(value))]


tiled, alone = work / "tiles", work / "one-process"
print("$ mpiexec -n 5 python -m mpi4dl_nb train", " ".join(flags({**SETTINGS, **TILES})), "--checkpoint-dir",
      tiled, "--log-dir", tiled, "--no-progress")
cluster = dl.cluster.start(n=dl.ParallelConfig(**TILES).world_size)
summary = cluster.run(dl.train, **SETTINGS, **TILES, checkpoint_dir=str(tiled), log_dir=str(tiled), progress=False,
                      timeout=600)[0]
print("losses on 4 tiles + 1 rank:", [round(loss, 6) for loss in summary.losses])

# %% [markdown]
# ## The same run in one process
#
# The same settings with `--split-size 1 --spatial-size 0`: one process, whole images. It reads the same crops in
# the same order and draws the same head and adapters from the same seed; float64, so that "equal" can mean 1e-10.

# %%
command = [sys.executable, "-m", "mpi4dl_nb", "train", *flags(SETTINGS), "--split-size", "1", "--spatial-size", "0",
           "--checkpoint-dir", str(alone), "--log-dir", str(alone), "--no-progress"]
print("$ python -m mpi4dl_nb train", " ".join(command[4:]))
done = subprocess.run(command, capture_output=True, text=True, timeout=600)
print(done.stderr.strip() or f"return code {done.returncode}")
serial_losses = [json.loads(line)["loss"] for line in (alone / "metrics.jsonl").read_text().splitlines()
                 if json.loads(line)["kind"] == "train"]
trained, serial = dl.model_state_dict(tiled), dl.model_state_dict(alone)
loss_error = max(abs(a - b) for a, b in zip(summary.losses, serial_losses, strict=True))
weight_error = max(float((trained[key] - serial[key]).abs().max()) for key in serial)
exact = loss_error < 1e-10 and weight_error < 1e-10 and trained.keys() == serial.keys()
print(f"losses in one process: {[round(loss, 6) for loss in serial_losses]}")
print(f"max |loss difference| = {loss_error:.1e}, max |weight difference| = {weight_error:.1e} over {len(serial)} "
      f"tensors -> exact: {exact}")

# %% [markdown]
# The lines above are the run's own account: the file had no classifier, so a new one was drawn; LoRA trains
# 135,170 of 26 million parameters. The differences are float64 rounding: the 4 ranks sum the same products in
# another order (attention across the seams runs as a ring, notebook 12; the gradients of every weight are summed
# over the tiles). A frozen weight that moved, or an adapter trained at another block's rate, would differ by about
# the learning rate: AdamW moves a trained number by up to 1e-3 a step.
#
# ## What trained
#
# The checkpoint's state dict holds the trunk's keys as the file had them, the adapters beside the weights they
# adapt (`blocks.0.attn.qkv.lora_a`: 4 x 1024, `lora_b`: 3072 x 4) and the new head. Against the file:

# %%
adapters = [key for key in trained if key.endswith(("lora_a", "lora_b"))]
moved = [key for key in start if not torch.equal(trained[key], start[key].to(trained[key].dtype))]
print(f"{len(start)} tensors from the file: {len(start) - len(moved)} unchanged, moved: {moved}")
head = [key for key in trained if key.startswith("head")]
print(f"new: {len(adapters)} adapter tensors, head {head}")
counts = [sum(trained[key].numel() for key in keys) for keys in (adapters, moved, head)]
print("trained numbers: adapters {:,}, final norm {:,}, classifier {:,}: {:,} in all".format(*counts, sum(counts)))

# %% [markdown]
# Every frozen tensor is bit for bit the file's; the final norm (`norm.weight`, `norm.bias`) belongs to the head and
# trains with it.
#
# ## The learning rate of each group, step by step
#
# Layer decay gives each parameter a rate by the layer it lies in (BEiT's rule, `pipeline/layer_decay.py`): with L
# blocks, the embedding learns at `lr x F^(L+1)`, block i at `lr x F^(L-i)`, the final norm and head at `lr`. The
# optimizer holds a parameter group per rate (its `lr_scale`), and the schedule multiplies every group's rate step by
# step. Rank 0 logs each group's rate of every step to `metrics.jsonl` (`lr/<group>`); drawn, with the rule applied
# to the decay and schedule the checkpoint records:

# %%
from mpi4dl_nb.checkpoint.record import read_checkpoint

checkpoint = read_checkpoint(next(tiled.glob("step-*.pt")))
optimizer, schedule = checkpoint.record.training.optimizer, checkpoint.record.training.schedule
log = [entry for entry in map(json.loads, (tiled / "metrics.jsonl").read_text().splitlines())
       if entry["kind"] == "train"]
power = {"lr/head": 0, **{f"lr/block.{i}": DEPTH - i for i in range(DEPTH)}}     # F^(L-i); the head: F^0
figure, axis = plt.subplots(figsize=(5.4, 3.4))
rule_error = 0.0
for (group, times), marker in zip(sorted(power.items(), key=lambda item: -item[1]), "os^"):
    logged = [entry[group] for entry in log]
    rule = [optimizer.lr * optimizer.layer_decay ** times * schedule.factor(entry["step"] - 1) for entry in log]
    rule_error = max(rule_error, *(abs(a - b) for a, b in zip(logged, rule)))
    axis.plot([entry["step"] for entry in log], logged, marker=marker, label=group.removeprefix("lr/"))
    print(f"{group:12s} lr_scale {optimizer.layer_decay ** times:.4f}: " + ", ".join(f"{r:.2e}" for r in logged))
print(f"logged against lr x {optimizer.layer_decay}^(L-i) x schedule: max difference {rule_error:.1e}")
axis.set_yscale("log")
axis.set_xlabel("optimizer step")
axis.set_ylabel("learning rate")
axis.set_xticks([entry["step"] for entry in log])
axis.legend(fontsize=8)
plt.show()

# %% [markdown]
# The warm-up step takes half the peak rate (step 1 of 1 + 1), then the cosine falls towards 0 at the run's end; on
# the log scale every group keeps its distance, a factor 0.75 per block. Under LoRA the embedding (patch embedding,
# class token, position embedding) is frozen: its group, at `lr x 0.75^3`, holds no parameter, and the optimizer and
# the log have none.
#
# ## Back to timm
#
# `export --merge-lora` folds each adapter into its weight, `W + (alpha / rank) B A`, and writes the model's own
# keys: timm's model of the same arguments loads it strictly. It starts without the normalisation step, which is
# preprocessing, not weights: the card's mean and std, recorded with the run, go in front.

# %%
exported = work / "uni_finetuned.safetensors"
command = [sys.executable, "-m", "mpi4dl_nb", "export", "--checkpoint", str(tiled), "--merge-lora",
           "--output-file", str(exported)]
print("$ python -m mpi4dl_nb export", " ".join(command[4:]))
print(subprocess.run(command, capture_output=True, text=True, check=True, timeout=300).stdout.strip())

from safetensors.torch import load_file

plain = timm.create_model(uni.architecture, depth=DEPTH, num_classes=2, **ARGS).double().eval()
print(plain.load_state_dict(load_file(exported), strict=True))

# %% [markdown]
# Its logits on the 9 crops (unturned) against the run's own model, rebuilt from the checkpoint with its adapters
# and normalisation (`dl.infer` and `evaluate` rebuild it the same way):

# %%
normal = checkpoint.record.model.normalize
print(f"the run normalised with {normal.describe()}: mean {normal.mean}, std {normal.std}")
batch = torch.stack([crops.read_pixels(index) for index in range(0, len(crops), 8)]).double()
model = torch.nn.Sequential(*checkpoint.record.model.build(SIZE)).double().eval()
model.load_state_dict(checkpoint.model_state, strict=True)
mean, std = (torch.tensor(v, dtype=torch.float64).view(1, 3, 1, 1) for v in (normal.mean, normal.std))
with torch.no_grad():
    gap = float((plain((batch - mean) / std) - model(batch)).abs().max())
print(f"{len(batch)} crops: max |timm - run| = {gap:.1e} -> the same network: {gap < 1e-10}")


# %% [markdown]
# ## What fits where: the whole UNI, fine-tuned fully or with LoRA
#
# The 2-block trial is for the notebook; the planner (`dl.planner.estimate_memory`) counts a training step of the
# whole 24-block ViT-L/16 on every rank, shape-only on the `meta` device: weights, gradients, AdamW's two states,
# gradient buckets and activations with the ring's key/value blocks in flight. `largest_side` searches the largest
# square image whose plan fits a rank's budget (float32, batch 1): here 24 GB, on 1 rank and on 2 x 2 tiles, with
# every weight trained or with LoRA rank 4 (frozen weights have no gradient nor optimizer state). The 4 engines
# share the 4 searches.

# %%
def largest_images(preset, args, tasks, budget_gb):
    from functools import partial

    import timm
    import torch

    import mpi4dl_nb as dl
    from mpi4dl_nb.models.lora import LoraSpec, add_adapters
    from mpi4dl_nb.planner.memory import largest_side

    def peak(parts, lora, side):
        with torch.device("meta"):                          # shapes only: no weights allocated
            net = timm.create_model(preset.architecture, img_size=side, num_classes=2, weight_init="skip", **args)
            layers = dl.layer_list(net, check=False)
            if lora:
                add_adapters(layers, LoraSpec(4), preset.name)
        cfg = dl.ParallelConfig(split_size=1, spatial_size=int(parts > 1), num_spatial_parts=parts)
        return dl.planner.estimate_memory(layers, cfg, side, 1, optimizer_states=2).peak    # AdamW: 2 states

    ctx = dl.init()
    unit = 2 * preset.preprocessing.patch_size              # sides in steps of 2 patches
    return {(parts, lora): largest_side(partial(peak, parts, lora), budget_gb * 1e9, unit, 4096 // unit)
            for parts, lora in tasks[ctx.rank::ctx.world_size]}


BUDGET_GB = 24
fits = {}
for part in cluster.run(largest_images, uni, ARGS, [(1, False), (1, True), (4, False), (4, True)], BUDGET_GB,
                        timeout=600):
    fits.update(part)
for parts in (1, 4):
    print(f"UNI (ViT-L/16, 24 blocks) on {parts} rank{'s' * (parts > 1)} of {BUDGET_GB} GB: largest image "
          f"{fits[parts, False]:,} px fully fine-tuned, {fits[parts, True]:,} px with LoRA rank 4")

# %% [markdown]
# LoRA leaves the trunk's 303 million weights without gradients or AdamW states: 3.6 GB of the 4.8 GB a full
# fine-tune keeps before any activation, so more of each rank's budget goes to the image (about 1,660 -> 1,890 px on
# one rank). On 4 tiles a rank keeps the activations of a quarter of the tokens: the pixels grow about 3.7 times (not
# 4: every rank holds the whole model), to about 3,200 px fully fine-tuned and 3,710 px with LoRA. Notebook 12's
# "What fits where" compares the larger foundation models; BENCHMARKS.md section 18 has the planner's bytes beside
# measured ones.
#
# ## Exercise: how many numbers does LoRA train?
#
# **Predict**: with `--lora-rank 8` on the whole UNI (24 blocks of width 1024, MLP 4096; the adapters of
# `attn.qkv`, `attn.proj`, `mlp.fc1` and `mlp.fc2` are `rank x in` and `out x rank`), how many parameters train,
# head (final norm and a 2-class classifier) included? Write your guess, then run the cell.

# %%
from mpi4dl_nb.models.lora import LoraSpec, add_adapters

my_guess = None
with torch.device("meta"):
    layers = dl.layer_list(timm.create_model(uni.architecture, num_classes=2, weight_init="skip", **ARGS), check=False)
print(add_adapters(layers, LoraSpec(8), "UNI"))

# %% [markdown]
# Per block, rank x (in + out) for each adapter: 8 x (1024 + 3072) for `qkv`, 8 x 2048 for `proj`, 8 x 5120 for
# each of `fc1` and `fc2`: 131,072; times 24 blocks, 3,145,728; plus the final norm (2,048) and the classifier
# (2,050): 3,149,826, about 1 % of the trunk. Twice the rank, twice the adapters: the head stays the same.
#
# ## What to try next
#
# * `--model virchow2 --model-args depth=2` (SwiGLU MLP, 4 register tokens) or `--model gigapath-tile`: the same
#   cells, another card's architecture and preprocessing.
# * `--lora-targets qkv,proj` (attention only), `--lora-alpha 16`, or no `--lora-rank` at all (every weight trains at
#   its layer's decayed rate): check each against one process as above.
# * The whole model: drop `depth=2`, give the card's file to `--weights`, train in float32, and add
#   `--checkpoint-activations every` where the planner's sides above are too small (docs/your-own-model.md,
#   "Foundation models").
# * `python -m mpi4dl_nb evaluate --checkpoint DIR` and `infer` rebuild the adapted model from the checkpoint alone.

# %%
import shutil

cluster.stop()
shutil.rmtree(work)
