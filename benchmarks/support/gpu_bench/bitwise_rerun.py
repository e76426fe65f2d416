"""Row (e), bitwise rerun: a float64 training of a few steps (ResNet-8 on 2 spatial tiles + a layer rank, torch's
deterministic algorithms as a float64 run of the package has them), run twice in one launch; the two runs' losses,
eval outputs, gradients and weights on every rank compared bit for bit."""

from __future__ import annotations

import hashlib

import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.comm.determinism import Determinism, deterministic_run
from mpi4dl_nb.config import SliceMethod
from mpi4dl_nb.models import build_model

from ..world import require_world
from .arguments import noted, row_parser
from .report import report

STEPS, BATCH, SIDE = 3, 4, 64
CONFIG = dl.ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method=SliceMethod.VERTICAL)
Run = dict[str, torch.Tensor]          # what one run leaves on this rank, by name


def train(ctx: Context) -> tuple[Run, bool]:
    """One run from the same seeds: this rank's losses, eval outputs, gradients and weights; whether torch's
    deterministic algorithms were on."""
    torch.manual_seed(0)
    layers = [layer.double() for layer in build_model("resnet", num_layers=8, num_filters=8, version=1)]
    engine = dl.HybridEngine(layers, CONFIG, ctx, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9))
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(BATCH, 3, SIDE, SIDE, generator=generator, dtype=torch.float64).to(ctx.device)
    labels = torch.randint(0, 10, (BATCH,), generator=generator).to(ctx.device)
    with deterministic_run(Determinism.AUTO, torch.float64) as deterministic:
        losses = [engine.train_step(images, labels) for _ in range(STEPS)]
        outputs = [output for _, output in engine.evaluate_batch(images)]
    found: Run = {"losses": torch.tensor(losses, dtype=torch.float64)}
    found.update({f"output {i}": out.detach().cpu() for i, out in enumerate(outputs) if isinstance(out, torch.Tensor)})
    for (_, stage), instance in engine.instances.items():
        for name, param in instance.canonical.named_parameters():
            found[f"stage {stage} weight {name}"] = param.detach().cpu().clone()
            if param.grad is not None:
                found[f"stage {stage} gradient {name}"] = param.grad.detach().cpu().clone()
    return found, deterministic


def first_difference(first: Run, second: Run) -> str | None:
    """The first entry the runs differ in, with its largest difference (None: bitwise identical)."""
    if first.keys() != second.keys():
        return f"different entries: {sorted(first.keys() ^ second.keys())[:3]}"
    for name, tensor in first.items():
        if not torch.equal(tensor, second[name]):
            return f"{name} (max |diff| {float((tensor - second[name]).abs().max()):.1e})"
    return None


def digest(run: Run) -> str:
    hashed = hashlib.sha256()
    for name in sorted(run):
        hashed.update(name.encode())
        hashed.update(run[name].contiguous().numpy().tobytes())
    return hashed.hexdigest()[:12]


def main() -> None:
    args = row_parser(__doc__.splitlines()[0]).parse_args()
    ctx = Context(backend="mpi", device=args.device)
    require_world(ctx, CONFIG.world_size, "bitwise rerun")
    (first, deterministic), (second, _) = train(ctx), train(ctx)
    mine = (first_difference(first, second), digest(first), len(first), deterministic)
    everyone = ctx.all_gather_object(mine)
    if ctx.rank == 0:
        differences = [f"rank {rank}: {found[0]}" for rank, found in enumerate(everyone) if found[0] is not None]
        verdict = "identical" if not differences else f"first difference {differences[0]}"
        digests = ", ".join(found[1] for found in everyone)
        report(not differences, noted(args.note, f"{verdict}: ResNet-8 float64 {STEPS} steps, {BATCH}x{SIDE}², "
                                                 f"{sum(found[2] for found in everyone)} tensors over "
                                                 f"{len(everyone)} ranks (losses, eval outputs, gradients, weights; "
                                                 f"sha256 {digests}); deterministic algorithms "
                                                 f"{'on' if all(f[3] for f in everyone) else 'OFF'}"))


if __name__ == "__main__":
    main()
