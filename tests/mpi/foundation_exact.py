"""MPI (5 ranks): a foundation model's architecture built from the command line is exact on 4 tiles + a layer rank.

The ranks set the run up as ``python -m mpi4dl_nb train`` does (``parsed_plan``, ``set_up_run``, ``build_trainer``)
with ``--model timm:vit_tiny_patch16_224 --model-args ...``: Virchow2's and UNI2-h's layer choices (SwiGLU-packed
MLP, SiLU, register tokens, LayerScale) on a narrow, 2-block ViT, 3 float64 steps; rank 0 trains the record's
model in one process (whole images, the layout's chunks).

Checks: ``model-args losses equal one process`` (1e-9, and the weights); ``model-args recorded`` (the checkpoint's
model holds the arguments, and rebuilds the trained network). The same run with ``--lora-rank 4`` (issue 66): ``lora
losses equal one process``, ``lora trains adapters and head only`` (every other tensor of the final state equal to
the starting one), ``lora recorded and merged`` (the checkpoint records the adapters, rebuilds and loads them;
``export --merge-lora``'s state dict loads strictly into the plain timm model and gives the same logits); with
``--layer-decay 0.75``: ``layer decay losses equal one process`` (the one process's optimizer groups by the same
whole-model names), ``layer decay groups are BEiT's`` (every rank's groups against the rule, the record keeps it),
``layer decay rates of every group logged`` (issue 81: rank 0 holds stage 0's groups only, yet its metrics.jsonl has
every group's ``lr/<name>`` = lr x scale, and the checkpoint's record lists every group).

``--huge`` runs issue 66's acceptance instead: ``timm:vit_huge_patch14_224`` with Virchow2's arguments and
``depth=2`` at 224 px (minutes on two cores; not part of the suite).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import mpi4dl_nb as dl
from mpi4dl_nb.checkpoint.record import read_checkpoint
from mpi4dl_nb.cli.export_cmd import CheckedExport, ExportFormat, export
from mpi4dl_nb.cli.train_cmd import parsed_plan
from mpi4dl_nb.comm.protocol import Comm
from mpi4dl_nb.evaluation.log import MetricsLog, read_metrics
from mpi4dl_nb.models.lora import ADAPTER_KEYS, LoraSpec
from mpi4dl_nb.models.model_args import parse_model_args, timm_resolver
from mpi4dl_nb.models.vit import layer_decay_scales
from mpi4dl_nb.pipeline.layer_decay import SCALE, ScaledOptimizer, local_groups
from mpi4dl_nb.pipeline.reference import serial_chunks, serial_step
from mpi4dl_nb.run.job_run import JobSetup, build_trainer, set_up_run
from tests.support.checks import Checks, run_checks
from tests.support.scratch import shared_temp_folder
from tests.support.serial_training import matches_one_process, train_one_process

STEPS = 3
ARGS = "embed_dim=48,num_heads=2,depth=2,mlp_layer=swiglu_packed,act_layer=silu,reg_tokens=4,init_values=1e-5"
SMALL = f"--model timm:vit_tiny_patch16_224 --model-args {ARGS} --image-size 64".split()
HUGE = ("--model timm:vit_huge_patch14_224 --model-args mlp_layer=swiglu_packed,act_layer=silu,reg_tokens=4,"
        "init_values=1e-5,mlp_ratio=5.3375,depth=2 --image-size 224 --lr 0.0001").split()   # 0.01: loss 0 at step 2
FLAGS = ("--num-classes 2 --batch-size 2 --num-samples 8 --dtype float64 --steps 3 --no-progress --step-timeout 0 "
         "--split-size 2 --spatial-size 1 --num-spatial-parts 4").split()
TOLERANCE = 1e-9
DECAY = 0.75


def serial_of(setup: JobSetup) -> torch.nn.Sequential:
    """The run's model built in one process as the run builds it (its seed, its adapters), float64."""
    torch.manual_seed(setup.job.training.seed)
    return torch.nn.Sequential(*setup.record.model.build(setup.job.data.image_size)).to(torch.float64)


def decayed_one_process(setup: JobSetup, model: torch.nn.Sequential) -> list[float]:
    """``STEPS`` steps of ``model`` in one process with the run's --layer-decay groups (by whole-model name)."""
    training, batcher = setup.record.training, setup.batcher
    assert training is not None and batcher is not None and training.optimizer.layer_decay is not None
    factory = ScaledOptimizer(training.optimizer, layer_decay_scales(list(model), DECAY, "the model"))
    optimizer = factory.by_name([(k, p) for k, p in model.named_parameters() if p.requires_grad])
    chunks = serial_chunks(setup.job.config, setup.job.training.batch_size)
    return [serial_step(model, optimizer, setup.record.loss(), batcher.images(0, step).to(torch.float64),
                        batcher.labels(0, step), chunks) for step in range(STEPS)]


def lora_run(check: Checks, ctx: Comm, folder: Path) -> None:
    """``--lora-rank 4`` on 4 tiles + a layer rank: exact, only adapters and head trained, recorded, merged."""
    argv = [*SMALL, *FLAGS, "--lora-rank", "4", "--checkpoint-dir", str(folder / "lora")]
    setup = set_up_run(parsed_plan(argv), ctx)
    trainer = build_trainer(setup, None)
    summary = trainer.run()
    state = trainer.engine.full_state_dict()
    if ctx.rank != 0:
        for name in ("lora losses equal one process", "lora trains adapters and head only",
                     "lora recorded and merged"):
            with check(name):
                pass
        return
    assert summary is not None and state is not None
    serial_model = serial_of(setup)
    start = {k: v.clone() for k, v in serial_model.state_dict().items()}
    with check("lora losses equal one process") as result:
        serial = train_one_process(setup, serial_model, setup.record.loss(),
                                   lambda batcher, epoch, step: batcher.labels(epoch, step), STEPS)
        result.detail = matches_one_process(summary.losses, state, serial, serial_model, TOLERANCE)
    with check("lora trains adapters and head only") as result:
        head = f"{len(serial_model) - 1}."
        trained = {k for k in start if k.endswith(ADAPTER_KEYS) or k.startswith(head)}
        changed = {k for k, v in start.items() if not torch.equal(state[k].to(v.dtype), v)}
        assert changed == trained, (sorted(changed - trained)[:3], sorted(trained - changed)[:3])
        result.detail = f"{len(changed)} of {len(start)} tensors changed (adapters and head)"
    with check("lora recorded and merged") as result:
        import timm

        file = next((folder / "lora").glob("*.pt"))
        spec = read_checkpoint(file).record.model
        assert spec.lora == LoraSpec(4), spec.lora
        adapted = torch.nn.Sequential(*spec.build(setup.job.data.image_size)).to(torch.float64)
        adapted.load_state_dict(read_checkpoint(file).model_state, strict=True)
        output = folder / "merged.pt"
        export(CheckedExport(file, output, ExportFormat.TORCH, merge_lora=True))
        plain = timm.create_model("vit_tiny_patch16_224", num_classes=2, img_size=64,
                                  **parse_model_args(ARGS).keywords(timm_resolver(timm))).to(torch.float64)
        plain.load_state_dict(torch.load(output, weights_only=True), strict=True)
        x = torch.rand(2, 3, 64, 64, dtype=torch.float64)
        adapted.eval(), plain.eval()
        with torch.no_grad():
            gap = (adapted(x) - plain(x)).abs().max().item()
        assert gap < 1e-12, gap
        result.detail = f"merged logits within {gap:.1e}"


def decay_run(check: Checks, ctx: Comm, folder: Path) -> None:
    """``--layer-decay 0.75`` on 4 tiles + a layer rank: exact, BEiT's groups on every rank, recorded."""
    argv = [*SMALL, *FLAGS, "--layer-decay", str(DECAY), "--checkpoint-dir", str(folder / "decay")]
    setup = set_up_run(parsed_plan(argv), ctx)
    trainer = build_trainer(setup, None)
    if ctx.rank == 0:           # --log-dir's log, as started_trainer opens it
        trainer.log = MetricsLog(folder / "decay-log", trainer.run_id)
    summary = trainer.run()
    state = trainer.engine.full_state_dict()
    with check("layer decay groups are BEiT's") as result:
        engine = trainer.engine
        assert engine.optimizer is not None
        scale_of = {id(p): group[SCALE] for group in engine.optimizer.param_groups for p in group["params"]}
        depth = 2            # the model's blocks: layers 1 and 2
        expected = {0: DECAY ** (depth + 1), 1: DECAY ** depth, 2: DECAY ** (depth - 1), 3: 1.0}
        for inst in engine.instances.values():
            for name, p in inst.canonical.named_parameters():
                layer = int(inst.canonical.full_key(name).split(".")[0])
                assert scale_of[id(p)] == expected[layer], (inst.canonical.full_key(name), scale_of[id(p)])
        if ctx.rank == 0:
            record = read_checkpoint(next((folder / "decay").glob("*.pt"))).record
            assert record.training is not None and record.training.optimizer.layer_decay == DECAY
        result.detail = f"{len(scale_of)} parameters in groups {sorted({*scale_of.values()})}"
    with check("layer decay rates of every group logged") as result:
        if ctx.rank == 0:
            names = ["embedding", "block.0", "block.1", "head"]         # scales DECAY ** 3, ** 2, ** 1, 1
            held = [name for name, _ in local_groups(trainer.engine.optimizer)]
            assert set(held) < set(names), held
            lines = [r for r in read_metrics(folder / "decay-log") if r["kind"] == "train"]
            assert len(lines) == STEPS
            for line in lines:
                logged = {k: v for k, v in line.items() if k.startswith("lr/")}
                assert list(logged) == [f"lr/{n}" for n in names], logged
                assert all(abs(logged[f"lr/{n}"] - line["lr"] * DECAY ** (3 - j)) < 1e-15 for j, n in enumerate(names))
            record = read_checkpoint(next((folder / "decay").glob("*.pt"))).record
            assert [(g.name, g.lr_scale) for g in record.param_groups] == [(n, DECAY ** (3 - j))
                                                                         for j, n in enumerate(names)]
            result.detail = f"rank 0 holds {held}; logged {names}"
    with check("layer decay losses equal one process") as result:
        if ctx.rank == 0:
            assert summary is not None and state is not None
            serial_model = serial_of(setup)
            serial = decayed_one_process(setup, serial_model)
            result.detail = matches_one_process(summary.losses, state, serial, serial_model, TOLERANCE)


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    model = HUGE if "--huge" in sys.argv[1:] else SMALL
    with shared_temp_folder(ctx, "foundation-") as folder:
        argv = [*model, *FLAGS, "--checkpoint-dir", str(Path(folder) / "c")]
        setup = set_up_run(parsed_plan(argv), ctx)
        trainer = build_trainer(setup, None)
        summary = trainer.run()
        state = trainer.engine.full_state_dict()
        with check("model-args losses equal one process") as result:
            if ctx.rank == 0:
                assert summary is not None and state is not None
                torch.manual_seed(setup.job.training.seed)
                serial_model = torch.nn.Sequential(*setup.record.model.build(setup.job.data.image_size))
                serial = train_one_process(setup, serial_model.to(torch.float64), setup.record.loss(),
                                           lambda batcher, epoch, step: batcher.labels(epoch, step), STEPS)
                result.detail = matches_one_process(summary.losses, state, serial, serial_model, TOLERANCE)
        with check("model-args recorded"):
            if ctx.rank == 0:
                saved = read_checkpoint(next((Path(folder) / "c").glob("*.pt")))
                spec = saved.record.model
                assert spec.model_args == setup.record.model.model_args and spec.model_args, spec.model_args
                rebuilt = torch.nn.Sequential(*spec.build(setup.job.data.image_size))
                assert [t.shape for t in rebuilt.state_dict().values()] == [
                    t.shape for t in serial_model.state_dict().values()]
        if model is SMALL:
            lora_run(check, ctx, Path(folder))
            decay_run(check, ctx, Path(folder))


if __name__ == "__main__":
    run_checks(main)
