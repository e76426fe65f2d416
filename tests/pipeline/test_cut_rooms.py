"""The default cut reads in one module: following a configuration from ``default_balance``, the package modules
("rooms") the calls enter, seen ``depth`` frames down, return at most twice to a room they had left (issue 87: the
tile reach and the memory probe asked once each, as plain data)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import FrameType

import pytest
from torch import nn

import mpi4dl_nb
from mpi4dl_nb.config import ParallelConfig
from mpi4dl_nb.models import build_model
from mpi4dl_nb.pipeline.default_cut import default_balance

PACKAGE = os.path.dirname(mpi4dl_nb.__file__)
SPATIAL = ParallelConfig(split_size=3, spatial_size=1, num_spatial_parts=4)
COLUMNS = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, slice_method="vertical")


def stacks_of(run: Callable[[], object]) -> list[tuple[str, ...]]:
    """The package modules of the package frames on the stack (outermost first) at each call and return while
    ``run`` runs."""
    stack: list[str] = []
    seen: list[tuple[str, ...]] = []

    def tracer(frame: FrameType, event: str, arg: object) -> Callable[..., object] | None:
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return None
        if event == "call":
            frame.f_trace_lines = False
            stack.append(os.path.relpath(frame.f_code.co_filename, PACKAGE))
        elif event == "return":
            stack.pop()
        if stack and (not seen or seen[-1] != tuple(stack)):
            seen.append(tuple(stack))
        return tracer

    sys.settrace(tracer)
    try:
        run()
    finally:
        sys.settrace(None)
    return seen


def rooms(stacks: list[tuple[str, ...]], depth: int) -> list[str]:
    """The rooms the calls stand in, in order (a stay once however long): each moment's room is the module of the
    ``depth``-th package frame of the stack (1: the outermost), or of the deepest if fewer."""
    stays: list[str] = []
    for stack in stacks:
        room = stack[min(len(stack), depth) - 1]
        if not stays or stays[-1] != room:
            stays.append(room)
    return stays


def returns(stays: list[str]) -> int:
    """How often the calls come back to a room they had left."""
    return sum(1 for index, room in enumerate(stays) if room in stays[:index])


def resnet() -> list[nn.Module]:
    return build_model("resnet", num_layers=11, num_filters=8, num_classes=2)


CASES = {   # a fresh model each (no kept probe answers): (layers, configuration, image size)
    "spatial stages at an image size": (resnet, SPATIAL, 64),
    "spatial stages, no image size": (resnet, SPATIAL, None),
    "a balance given": (resnet, SPATIAL.with_(balance=(1, 2, 2)), 64),
    "no spatial stage": (resnet, ParallelConfig(split_size=2, spatial_size=0), None),
    "a u-net on tile columns": (lambda: build_model("unet", num_layers=2, num_filters=4, num_classes=2), COLUMNS, 32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_following_a_configuration_from_default_balance_returns_at_most_twice(case):
    build, cfg, image_size = CASES[case]
    layers = build()
    stacks = stacks_of(lambda: default_balance(layers, cfg, image_size=image_size))
    probed = cfg.spatial_size > 0 and cfg.balance is None
    for depth in (2, 3):   # the modules default_balance calls, and those they call
        stays = rooms(stacks, depth)
        assert stays[0] == stays[-1] == "pipeline/default_cut.py"
        assert returns(stays) <= 2, f"depth {depth}: " + " > ".join(stays)
        if probed and image_size is not None:   # the tiles' reach, then the memory probe: asked once each
            assert stays == ["pipeline/default_cut.py", "pipeline/tile_fit.py", "pipeline/default_cut.py",
                             "pipeline/layer_probe.py", "pipeline/default_cut.py"]
    if probed:   # deeper down the probes run the layers, in many modules: the trace sees them
        assert len(set(rooms(stacks, 99))) > 3


def test_the_count_sees_a_return():
    def back_and_forth() -> None:
        ParallelConfig(split_size=2).with_(parts=2)
        default_balance([nn.Identity(), nn.Identity()], ParallelConfig(split_size=2, spatial_size=0))
        ParallelConfig(split_size=2).with_(parts=2)
    stays = rooms(stacks_of(back_and_forth), 1)
    assert stays == ["config.py", "pipeline/default_cut.py", "config.py"] and returns(stays) == 1, stays
