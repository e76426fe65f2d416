"""Planner estimates against measurements: the peak of one training step on this process, and
estimate/measured ratios on every rank of a local cluster."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from ipyparallel import interactive
from torch import nn

from mpi4dl_nb import ParallelConfig, planner
from mpi4dl_nb.models import build_model


def serial_peak(model: nn.Module, batch: int, size: int, profile_warmup: bool = True) -> int:
    """Measured peak bytes of one SGD-with-momentum step of ``model`` on random images
    (``planner.measure_step_memory``, after a warm-up step: profiled too, or, ``profile_warmup=False``,
    run before and its optimizer state counted as held: half the profiling of a large model)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 2, (batch,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    if not profile_warmup:
        step()
        return planner.measure_step_memory(step, [model], opt)
    return planner.measure_step_memory(step, [model], opt, warmup=step)


@interactive  # shipped by value to the engines
def _measure_on_engine(cfg_dict: dict[str, Any], image_size: int, batch: int, model: str, depth: int,
                       width: int) -> Any:
    from mpi4dl_nb.measure.trials import ModelSpec, measure_config_on_engine

    return measure_config_on_engine(ModelSpec(model, depth, width), cfg_dict, image_size, batch, 1).peaks


def cluster_ratios(cases: Sequence[tuple[dict[str, Any], int, str]], sizes: dict[str, tuple[int, int, int]],
                   ranks: int = 3) -> list[tuple[dict[str, Any], str, list[float]]]:
    """(knobs, model, estimate/measured per rank) of each (knobs, batch, model) case, all run
    on one cluster of ``ranks`` engines; ``sizes``: model -> (depth, width, image size), a model named
    as ``build_model`` names it, or ``family:label`` for a second size of one family (``"resnet:20"``)."""
    from mpi4dl_nb import cluster as clu

    out = []
    with clu.start(n=ranks, call_timeout=300) as cluster:
        for knobs, batch, model in cases:
            depth, width, size = sizes[model]
            family = model.split(":")[0]
            layers = build_model(family, num_layers=depth, num_filters=width, num_classes=2)
            plan = planner.estimate_memory(layers, ParallelConfig(**knobs), size, batch)
            measured = cluster.run(_measure_on_engine, knobs, size, batch, family, depth, width)[0]
            out.append((knobs, model, [e / m for e, m in zip(plan.totals, measured)]))
    return out
