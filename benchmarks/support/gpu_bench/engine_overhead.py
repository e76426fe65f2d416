"""Row (c), engine overhead: one rank training through ``HybridEngine`` against plain torch on the same step
(ResNet-50 and ViT-B/16, SGD with momentum, bf16 autocast, both reading the loss once a step): time ratio."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.config import PrecisionMode

from .arguments import noted, row_parser
from .device_timing import median_seconds
from .report import report

CLASSES = 10
Step = Callable[[], float]


def resnet50(side: int, depth: int) -> nn.Module:
    import torchvision

    return torchvision.models.resnet50(num_classes=CLASSES)


def vit_b16(side: int, depth: int) -> nn.Module:
    import timm

    extra: dict[str, Any] = {"depth": depth} if depth else {}
    model: nn.Module = timm.create_model("vit_base_patch16_224", img_size=side, num_classes=CLASSES, **extra)
    return model


def sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)  # type: ignore[arg-type]


def plain_step(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> Step:
    """A plain torch training step of ``model`` (moved to the images' device) under bf16 autocast."""
    model.to(images.device)
    optimizer, loss_fn = sgd(model.parameters()), nn.CrossEntropyLoss()

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(images.device.type, dtype=torch.bfloat16):
            loss = loss_fn(model(images), labels)
        loss.backward()
        optimizer.step()
        return float(loss.detach())
    return step


def engine_step(model: nn.Module, ctx: Context, images: torch.Tensor, labels: torch.Tensor) -> Step:
    """The same step through the engine: one rank, one stage, ``precision='bf16'``."""
    cfg = dl.ParallelConfig(split_size=1, spatial_size=0, num_spatial_parts=1, precision=PrecisionMode.BF16)
    engine = dl.HybridEngine(dl.layer_list(model, check=False), cfg, ctx, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=sgd)
    return lambda: engine.train_step(images, labels)


def ratio(make: Callable[[int, int], nn.Module], side: int, depth: int, batch: int, ctx: Context,
          repeats: int) -> tuple[float, float]:
    """(engine seconds / plain seconds, plain seconds) per step of the model ``make`` builds."""
    torch.manual_seed(0)
    model = make(side, depth)
    twin = copy.deepcopy(model)
    images = torch.randn(batch, 3, side, side, device=ctx.device)
    labels = torch.randint(0, CLASSES, (batch,), device=ctx.device)
    engine = median_seconds(engine_step(model, ctx, images, labels), ctx.device, repeats)
    plain = median_seconds(plain_step(twin, images, labels), ctx.device, repeats)
    print(f"{make.__name__} {side} px batch {batch}: engine {1e3 * engine:.1f} ms, plain {1e3 * plain:.1f} ms",
          flush=True)
    return engine / plain, plain


def main() -> None:
    parser = row_parser(__doc__.splitlines()[0])
    parser.add_argument("--resnet-side", type=int, required=True)
    parser.add_argument("--vit-side", type=int, required=True)
    parser.add_argument("--vit-depth", type=int, default=0, help="ViT-B/16's blocks (0: all)")
    parser.add_argument("--batch", type=int, required=True)
    args = parser.parse_args()
    ctx = Context(backend="mpi", device=args.device)
    cells = []
    for label, make, side, depth in (("ResNet-50", resnet50, args.resnet_side, 0),
                                     ("ViT-B/16", vit_b16, args.vit_side, args.vit_depth)):
        found, plain = ratio(make, side, depth, args.batch, ctx, args.repeats)
        blocks = f" depth {depth}" if depth else ""
        cells.append(f"{label}{blocks} {side}²: {found:.3f}x ({1e3 * plain:.1f} ms plain)")
    report(True, noted(args.note, f"step time engine/plain, batch {args.batch}, bf16 autocast: {'; '.join(cells)}"))


if __name__ == "__main__":
    main()
