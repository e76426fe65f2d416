"""Engine exactness cases: configuration, model, batch; grouped by the ranks they need."""

from __future__ import annotations

from mpi4dl_nb.config import ParallelConfig

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
}


def config_of(name: str) -> ParallelConfig:
    return ParallelConfig(**CASES[name][0])


def cases_by_world_size() -> dict[int, list[str]]:
    """World size -> the case names that run on that many ranks."""
    groups: dict[int, list[str]] = {}
    for name in CASES:
        groups.setdefault(config_of(name).world_size, []).append(name)
    return groups
