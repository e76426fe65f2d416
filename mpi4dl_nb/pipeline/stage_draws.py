"""Training refused where dropout or stochastic depth would not draw one process's masks: on two stages, or replicas."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

from torch import nn

from ..config import ParallelConfig
from ..errors import ConfigError
from .default_cut import default_balance, draws_in_training, kept_together, module_draws, partition_stages

RATES = ("set their rates to 0 (--model-args drop_path_rate=0,drop_rate=0 for a timm model; p=0 for an "
         "nn.Dropout)")


def first_drawing_module(layers: Sequence[nn.Module], start: int, stop: int) -> str:
    """The name of the first module of ``layers[start:stop]`` that draws in training: its name in the model for a
    cut model's piece (``layers.2.blocks.0.drop_path1``), else its key in ``nn.Sequential(*layers)`` (``3.1``)."""
    for index in range(start, stop):
        for name, module in layers[index].named_modules():
            if module_draws(module):
                if hasattr(layers[index], "paths") and name:   # a piece of a cut model: its modules' model names
                    return name
                return f"{index}.{name}" if name else str(index)
    raise ValueError(f"no layer of {start}:{stop} draws in training")


def drawing_stages(layers: Sequence[nn.Module], balance: Sequence[int]) -> dict[int, str]:
    """Each stage of the cut ``balance`` that holds a layer drawing in training, with its first such module."""
    draws = draws_in_training(layers)
    ends = list(accumulate(balance, initial=0))
    return {stage: first_drawing_module(layers, ends[stage], ends[stage + 1]) for stage in range(len(balance))
            if any(draws[ends[stage]:ends[stage + 1]])}


def one_stage_cut(layers: Sequence[nn.Module], cfg: ParallelConfig,
                  image_size: int | tuple[int, int] | None = None) -> tuple[int, ...] | None:
    """A cut keeping every drawing layer on one stage: the default cut at ``image_size`` where it does, else the
    evenest by layer count that does (None: none does)."""
    if cfg.balance is not None:
        try:
            cut = default_balance(layers, cfg.with_(balance=None), image_size=image_size)
            if len(drawing_stages(layers, cut)) <= 1:
                return cut
        except ConfigError:
            pass
    try:
        return partition_stages(len(layers), cfg.split_size,
                                kept_together(lambda stage, start, stop: stop - start, draws_in_training(layers)))
    except ConfigError:
        return None


def replicated(cfg: ParallelConfig, stages: Sequence[int]) -> tuple[str, str, str] | None:
    """``(knob, replicas, way out)`` when more than one rank runs a drawing stage on other samples (each draws from
    the start of the same random stream): data-parallel replicas, GEMS's mirror, ``local_dp`` copies of a layer
    stage; None when one rank runs each drawing stage's every sample."""
    if cfg.data_parallel > 1:
        return "data_parallel", f"{cfg.data_parallel} data-parallel replicas", "--data-parallel 1"
    if cfg.gems:
        return "times", "GEMS's mirrored replica", "--times 0"
    if cfg.local_dp > 1 and any(stage >= cfg.spatial_size for stage in stages):
        return "local_dp", f"{cfg.local_dp} --local-DP copies of a layer stage", "--local-DP 1"
    return None


def draws_refusal(layers: Sequence[nn.Module], balance: Sequence[int], cfg: ParallelConfig,
                  image_size: int | tuple[int, int] | None = None) -> ConfigError | None:
    """Why training ``layers`` cut by ``balance`` on ``cfg`` would not draw one process's dropout and stochastic
    depth masks (None: it would). Each rank draws from its own random state, seeded alike: a rank running a later
    stage starts where one process starts the first stage, and replicas draw the same masks for other samples.
    Micro-batches (``parts``) are exact: a stage's rank draws them in the serial reference's chunk order.
    ``image_size``: the images' size, for the cut the refusal suggests (``one_stage_cut``)."""
    held = drawing_stages(layers, balance)
    if not held:
        return None
    named = ", ".join(f"stage {stage} (first: {name})" for stage, name in held.items())
    what = "layers drawing random numbers in training (dropout, stochastic depth)"
    if len(held) > 1:
        cut = one_stage_cut(layers, cfg, image_size)
        keep = f"--balance {','.join(map(str, cut))}" if cut is not None else "another --balance"
        return ConfigError("balance", f"{what} lie on {len(held)} stages ({named}): each stage's rank draws from "
                           f"its own random state, so a later stage would not draw one process's masks; keep them "
                           f"on one stage ({keep}; the default cut does where the tiles allow) or {RATES}")
    found = replicated(cfg, list(held))
    if found is None:
        return None
    knob, replicas, way = found
    return ConfigError(knob, f"{what} on {named} are run by {replicas}: each replica draws from the same random "
                       f"state, so they would draw the same masks for other samples where one process draws new "
                       f"ones; train without them ({way}) or {RATES}")


def check_draws(layers: Sequence[nn.Module], cfg: ParallelConfig,
                image_size: int | tuple[int, int] | None = None) -> None:
    """The training pre-flight: ``draws_refusal`` on the engine's cut (``default_balance`` at ``image_size``)."""
    if not any(draws_in_training(layers)):
        return
    refusal = draws_refusal(layers, default_balance(layers, cfg, image_size=image_size), cfg, image_size)
    if refusal is not None:
        raise refusal
