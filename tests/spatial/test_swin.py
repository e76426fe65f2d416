"""timm's Swin and Swin-V2 on tiles (issue 53): under mpiexec, Swin-T on 2x2 and 1x4 tiles at 224 and 448 px and
Swin-V2-T (window 8) on 2x2 equal one process in float64, the distributed roll equals torch.roll (2-D and 3-D
grids), what stays refused is named (tests/mpi/swin_exact.py: one 4-rank launch on the mpi plane shared with other
programs, a roll-and-one-model subset on gloo); without MPI, the conversion keeps the model's class and keys."""

from __future__ import annotations

from typing import Any

import pytest

from mpi4dl_nb.config import ConfigError
from tests.support.battery import shared_job
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

MISSING = missing_modules("timm")
SWIN_JOB = None if MISSING else shared_job(4, "swin_exact", timeout=900)
SWIN_GLOO_JOB = None if MISSING else shared_job(4, "swin_exact", "--backend=gloo", plane="gloo", timeout=300)


class _OneRank:
    """The one-rank context ``spatialize`` needs to convert (no communication happens on one tile)."""

    rank, world_size = 0, 1


def _converted(**kwargs: Any):
    import timm

    from mpi4dl_nb.spatial.convert import spatialize
    from mpi4dl_nb.spatial.geometry import TileGrid

    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(2, 2, 2, 2), embed_dim=24,
                              num_heads=(1, 2, 4, 8), drop_path_rate=0.0, **kwargs)
    return model, spatialize(model, TileGrid(1, 1), _OneRank())   # type: ignore[arg-type]


def test_a_converted_swin_keeps_its_class_parameters_and_keys():
    require_or_skip(MISSING, "timm's Swin", MODELS_EXTRA)
    model, net = _converted()
    assert isinstance(net, type(model)) and list(net.state_dict()) == list(model.state_dict())
    assert all(a is b for a, b in zip(net.parameters(), model.parameters()))
    assert type(net.layers[1].blocks[1]).__name__ == "SpatialSwinTransformerBlock"
    assert type(net.layers[1].downsample).__name__ == "SpatialPatchMerging"


def test_a_swin_without_the_average_pool_is_refused_naming_the_knob():
    require_or_skip(MISSING, "timm's Swin", MODELS_EXTRA)
    with pytest.raises(ConfigError, match="global_pool=''"):
        _converted(global_pool="")


def test_timm_swins_on_tiles_equal_one_process(shared_launch):
    from tests.mpi.swin_exact import check_names

    require_or_skip(MISSING, "timm's Swin", MODELS_EXTRA)
    assert SWIN_JOB is not None
    shared_launch(SWIN_JOB).require(check_names())


def test_the_roll_and_a_swin_on_the_torch_plane(shared_launch):
    from tests.mpi.swin_exact import check_names

    require_or_skip(MISSING, "timm's Swin", MODELS_EXTRA)
    assert SWIN_GLOO_JOB is not None
    shared_launch(SWIN_GLOO_JOB).require(check_names("gloo"))
