"""MPI4DL's parallelism flags on the command line: ParallelConfig's fields name them (``config.py``); the
configuration of parsed flags, and the flags that give a configuration back (``tune`` prints its pick as a
``train`` command)."""
from __future__ import annotations

import argparse
from dataclasses import replace

from ..config import ConfigError, ParallelConfig, SliceMethod
from ..schema import build_job, flag_fields
from .job_flags import keyword_values

# flag -> ParallelConfig field, in the order MPI4DL documents them
PARALLEL_FLAGS: dict[str, str] = {item.flag.option: item.field.name for item in flag_fields(ParallelConfig)}


def config_from_args(args: argparse.Namespace) -> ParallelConfig:
    """The ``ParallelConfig`` of parsed flags (the parallelism flags given; the defaults for the rest)."""
    return build_job(ParallelConfig, keyword_values(args, ParallelConfig), "the parallelism flags")


def flag_text(value: object) -> str:
    """A knob's value as its flag takes it: a tuple comma-joined, a choice by its text."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def parallel_flags(cfg: ParallelConfig) -> list[str]:
    """The parallelism flags that give ``cfg`` (those that differ from the defaults), inverse of
    ``config_from_args``; ConfigError for a tile grid no ``--slice-method`` makes."""
    if cfg.grid is not None:
        method = next((m for m in SliceMethod if m.grid_shape(cfg.num_spatial_parts) == cfg.grid), None)
        if method is None:
            raise ConfigError("grid", f"a {cfg.grid[0]}x{cfg.grid[1]} tile grid has no --slice-method; set "
                                      f"ParallelConfig(grid=...) from Python")
        cfg = replace(cfg, grid=None, slice_method=method)
    default = ParallelConfig()
    out: list[str] = []
    for item in flag_fields(ParallelConfig):
        name = item.field.name
        value = getattr(cfg, name)
        if name == "slice_method" and cfg.volume_grid is not None:   # --slice-method DxRxC
            value = "x".join(map(str, cfg.volume_grid))
        if value == getattr(default, name):
            continue
        out += [item.flag.option] if item.flag.switch else [item.flag.option, flag_text(value)]
    return out

