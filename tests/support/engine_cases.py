"""Engine exactness cases: configuration, model, batch; grouped by the ranks they need."""

from __future__ import annotations

import random

from mpi4dl_nb.config import ParallelConfig
from mpi4dl_nb.pipeline.reference import serial_chunks  # noqa: F401  (the cases' serial reference)

# name -> (ParallelConfig kwargs, model, global batch, image size)
CASES: dict[str, tuple[dict, str, int, int]] = {
    "lp2": (dict(split_size=2, spatial_size=0), "resnet", 2, 16),
    "lp3": (dict(split_size=3, spatial_size=0), "cells", 2, 16),
    "pp2_gpipe_m2": (dict(split_size=2, spatial_size=0, parts=2, schedule="gpipe"), "resnet", 4, 16),
    "pp2_gpipe_m4": (dict(split_size=2, spatial_size=0, parts=4, schedule="gpipe"), "cells", 4, 16),
    "pp2_1f1b_m2": (dict(split_size=2, spatial_size=0, parts=2, schedule="1f1b"), "cells", 4, 16),
    "pp2_1f1b_m4": (dict(split_size=2, spatial_size=0, parts=4, schedule="1f1b"), "resnet", 4, 16),
    "pp3_1f1b_m4": (dict(split_size=3, spatial_size=0, parts=4, schedule="1f1b"), "resnet", 8, 16),
    "gems_t1": (dict(split_size=2, spatial_size=0, times=1), "resnet", 2, 16),
    "gems_t2": (dict(split_size=2, spatial_size=0, times=2), "cells", 4, 16),
    "gems3_t1": (dict(split_size=3, spatial_size=0, times=1), "cells", 2, 16),
    "gems_pp": (dict(split_size=2, spatial_size=0, times=1, parts=2, schedule="1f1b"), "resnet", 4, 16),
    # 3-stage GEMS 1F1B: a channel's payloads are received in another order than their receive
    # actions come (the mailbox takes them in send order, as the torch plane requires)
    "gems3_1f1b_m2": (dict(split_size=3, spatial_size=0, times=1, parts=2, schedule="1f1b"),
                      "cells", 4, 16),
    "dp2_split1": (dict(split_size=1, spatial_size=0, data_parallel=2, parts=2), "cells", 4, 16),
    "local_dp2": (dict(split_size=2, spatial_size=0, local_dp=2, parts=2), "resnet", 8, 16),
    "dp2_lp2": (dict(split_size=2, spatial_size=0, data_parallel=2), "cells", 4, 16),
    "sp_localdp": (dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical",
                        local_dp=2, balance=(3, 3)), "cells", 4, 16),
    "sp_lp_square": (dict(split_size=2, spatial_size=1, num_spatial_parts=4, slice_method="square",
                          balance=(2, 3)), "resnet", 2, 16),
    "sp_lp_vertical": (dict(split_size=2, spatial_size=1, num_spatial_parts=4,
                            slice_method="vertical", balance=(3, 3)), "cells", 2, 16),
    "sp_lp_horizontal": (dict(split_size=2, spatial_size=1, num_spatial_parts=4,
                              slice_method="horizontal", balance=(2, 3)), "resnet", 2, 16),
    "sp_pp": (dict(split_size=2, spatial_size=1, num_spatial_parts=4, parts=2, schedule="1f1b",
                   balance=(2, 3)), "resnet", 4, 16),
    "sp_gems_lp": (dict(split_size=2, spatial_size=1, num_spatial_parts=4, times=1,
                        balance=(3, 3)), "cells", 2, 16),
    "sp_gems_pp": (dict(split_size=2, spatial_size=1, num_spatial_parts=4, times=1, parts=2,
                        balance=(2, 3)), "resnet", 4, 16),
    "dp2_sp_lp": (dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical",
                       data_parallel=2, balance=(2, 3)), "resnet", 4, 16),
    "sp3_spatial2": (dict(split_size=3, spatial_size=2, num_spatial_parts=4, slice_method="square",
                          balance=(1, 2, 2)), "resnet", 2, 16),
    # SE gates, U-Net, GroupNorm/InstanceNorm inside spatial stages (issue 10)
    "sp_se_lp": (dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical",
                      balance=(3, 2)), "se_resnet", 2, 16),
    "sp_se_pp": (dict(split_size=2, spatial_size=1, num_spatial_parts=4, parts=2, schedule="1f1b",
                      balance=(3, 2)), "se_resnet", 4, 16),
    "sp_unet_lp": (dict(split_size=2, spatial_size=1, num_spatial_parts=4, balance=(3, 3)), "unet", 2, 16),
    "sp_unet_pp": (dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="horizontal",
                        parts=2, balance=(4, 2)), "unet", 4, 16),
    "sp_norms_lp": (dict(split_size=2, spatial_size=1, num_spatial_parts=4, balance=(3, 1)), "norms", 2, 16),
    "sp_norms_pp": (dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical",
                         parts=2, schedule="1f1b", balance=(2, 2)), "norms", 4, 16),
    # a BatchNorm used twice per forward: running statistics replayed per call
    "bn_reuse_pp": (dict(split_size=2, spatial_size=0, parts=2), "reused_bn", 4, 16),
    "bn_reuse_sp_pp": (dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical",
                            parts=2, balance=(2, 2)), "reused_bn", 4, 16),
    # sync_batchnorm: the copies of a micro-batch normalise together
    "sync_dp2_lp2": (dict(split_size=2, spatial_size=0, data_parallel=2, sync_batchnorm=True),
                     "resnet", 4, 16),
    "sync_sp_localdp2": (dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical",
                              local_dp=2, balance=(2, 3), sync_batchnorm=True), "resnet", 4, 16),
    "sync_sp_dp2_pp": (dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical",
                            data_parallel=2, parts=2, balance=(2, 3), sync_batchnorm=True),
                       "resnet", 8, 16),
    "sync_gems_localdp2": (dict(split_size=2, spatial_size=0, times=1, local_dp=2, sync_batchnorm=True),
                           "cells", 8, 16),
    # interleaved (issue 44): split_size stages on split_size / virtual_stages ranks, each holding
    # virtual_stages non-consecutive chunks; with a spatial first stage (its tile 0 holds stage 2)
    "il2_m4": (dict(split_size=4, spatial_size=0, parts=4, schedule="interleaved", virtual_stages=2),
               "cells", 4, 16),
    "il2_m8": (dict(split_size=4, spatial_size=0, parts=8, schedule="interleaved", virtual_stages=2),
               "resnet", 8, 16),
    "il4_m4": (dict(split_size=8, spatial_size=0, parts=4, schedule="interleaved", virtual_stages=2),
               "cells8", 4, 16),
    "il4_m8": (dict(split_size=8, spatial_size=0, parts=8, schedule="interleaved", virtual_stages=2),
               "cells8", 8, 16),
    "il_sp": (dict(split_size=4, spatial_size=1, num_spatial_parts=2, slice_method="vertical", parts=2,
                   schedule="interleaved", virtual_stages=2, balance=(2, 1, 1, 1)), "resnet", 4, 16),
    "il_dp2": (dict(split_size=4, spatial_size=0, data_parallel=2, parts=2, schedule="interleaved",
                    virtual_stages=2), "cells", 8, 16),
    "il4_sp": (dict(split_size=6, spatial_size=1, num_spatial_parts=2, slice_method="vertical", parts=3,
                    schedule="interleaved", virtual_stages=2, balance=(1, 1, 2, 1, 2, 1)), "cells8", 6, 16),
    "il_sp_recompute": (dict(split_size=4, spatial_size=1, num_spatial_parts=2, slice_method="horizontal",
                             parts=4, schedule="interleaved", virtual_stages=2, balance=(2, 1, 1, 1),
                             checkpoint_activations="every"), "resnet", 4, 16),
    # zero bubble ZB-H1 (issue 44): backward split into I and W, W deferred (but on the first stage:
    # split_backward.splits_backward); a spatial first stage, a split spatial second stage (its W exchanges
    # nothing), replicas, recomputation (whole backward in I), a module called twice per forward (its
    # parameters' gradients in I, the others' in W)
    "zb1_pp2_m4": (dict(split_size=2, spatial_size=0, parts=4, schedule="zb1"), "resnet", 4, 16),
    "zb1_pp3_m4": (dict(split_size=3, spatial_size=0, parts=4, schedule="zb1"), "cells", 8, 16),
    "zb1_sp": (dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical", parts=2,
                    schedule="zb1", balance=(2, 3)), "resnet", 4, 16),
    "zb1_sp2": (dict(split_size=3, spatial_size=2, num_spatial_parts=2, slice_method="vertical", parts=3,
                     schedule="zb1", balance=(1, 1, 3)), "resnet", 3, 16),
    "zb1_dp2": (dict(split_size=2, spatial_size=0, data_parallel=2, parts=2, schedule="zb1"), "cells", 8, 16),
    "zb1_recompute": (dict(split_size=2, spatial_size=0, parts=2, schedule="zb1",
                           checkpoint_activations="every"), "resnet", 4, 16),
    "zb1_bn_reuse": (dict(split_size=2, spatial_size=0, parts=2, schedule="zb1"), "reused_bn", 4, 16),
    # zero bubble ZB-V (issue 44): 2 chunks per rank, rank r holding stages r and 2S-1-r (the forward turns
    # on the last rank, a payload it hands itself; the loss on rank 0), backward split into I and W; tuple
    # activations, a spatial first stage (its tile 0 holds the last stage), replicas, recomputation
    "zbv_pp2_m4": (dict(split_size=4, spatial_size=0, parts=4, schedule="zbv"), "cells", 4, 16),
    "zbv_sp": (dict(split_size=4, spatial_size=1, num_spatial_parts=2, slice_method="vertical", parts=2,
                    schedule="zbv", balance=(2, 1, 1, 1)), "resnet", 4, 16),
    "zbv_dp2": (dict(split_size=4, spatial_size=0, data_parallel=2, parts=2, schedule="zbv"), "resnet", 8, 16),
    "zbv_recompute": (dict(split_size=4, spatial_size=0, parts=2, schedule="zbv", checkpoint_activations="every"),
                      "resnet", 4, 16),
    # gradient all-reduce overlapped with backward (issue 44): buckets of ~2 KB, several per stage, posted
    # during the last backward of the step (tests/mpi/grad_overlap.py checks the order and today's path)
    "dp2_buckets": (dict(split_size=1, spatial_size=0, data_parallel=2, parts=2, schedule="1f1b",
                         grad_bucket_mb=0.002), "resnet", 4, 16),
    "localdp2_buckets": (dict(split_size=1, spatial_size=0, local_dp=2, parts=2, grad_bucket_mb=0.002),
                         "cells", 4, 16),
    "sync_dp2_buckets": (dict(split_size=1, spatial_size=0, data_parallel=2, sync_batchnorm=True,
                              grad_bucket_mb=0.002), "resnet", 4, 16),
    "gems_buckets": (dict(split_size=2, spatial_size=0, times=1, parts=2, schedule="1f1b",
                          grad_bucket_mb=0.002), "resnet", 4, 16),
    "sp_se_buckets": (dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical",
                           balance=(3, 2), grad_bucket_mb=0.002), "se_resnet", 2, 16),
}


def config_of(name: str) -> ParallelConfig:
    return ParallelConfig(**CASES[name][0])


def cases_by_world_size() -> dict[int, list[str]]:
    """World size -> the case names that run on that many ranks."""
    groups: dict[int, list[str]] = {}
    for name in CASES:
        groups.setdefault(config_of(name).world_size, []).append(name)
    return groups


# ------------------------------------------------------------- random configurations
LAYERS = {"resnet": 5, "cells": 6, "se_resnet": 5, "norms": 4}


def random_cases(world_size: int, count: int, seed: int = 0) -> dict[str, tuple[dict, str, int, int]]:
    """``count`` random valid engine configurations of ``world_size`` ranks (split, spatial,
    parts, times, local_dp, data_parallel, schedule, sync_batchnorm, grid), each with a model
    and batch; names carry the seed: ``random <world>-<seed>``."""
    rng = random.Random(1000 * world_size + seed)
    cases: dict[str, tuple[dict, str, int, int]] = {}
    attempts = 0
    while len(cases) < count and attempts < 20000:
        attempts += 1
        model = rng.choice(sorted(LAYERS))
        split = rng.choice([2, 2, 3])
        spatial = rng.choice([0, 0, 1, 1, 2]) if split > 2 else rng.choice([0, 1, 1])
        parts_sp = rng.choice([2, 2, 3, 4])
        method = rng.choice(["vertical", "horizontal", "square"]) if parts_sp == 4 else \
            rng.choice(["vertical", "horizontal"])
        kwargs = dict(split_size=split, spatial_size=spatial, num_spatial_parts=parts_sp,
                      slice_method=method, parts=rng.choice([1, 1, 2]), times=rng.choice([0, 0, 1]),
                      local_dp=rng.choice([1, 1, 2]), data_parallel=rng.choice([1, 1, 2]),
                      schedule=rng.choice(["gpipe", "1f1b"]), sync_batchnorm=rng.random() < 0.4)
        layers = LAYERS[model]
        if split > layers or (spatial and model == "cells" and split > 2):
            continue
        cuts = sorted(rng.sample(range(1, layers), split - 1))
        kwargs["balance"] = tuple(b - a for a, b in zip([0, *cuts], [*cuts, layers]))
        try:
            cfg = ParallelConfig(**kwargs)
        except Exception:
            continue
        if cfg.world_size != world_size:
            continue
        batch = cfg.batch_divisor * rng.choice([1, 2])
        name = f"random {world_size}-{seed + len(cases)}"
        cases[name] = (kwargs, model, batch, 16)
    return cases
