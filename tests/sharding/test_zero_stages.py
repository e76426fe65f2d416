"""One record per ZeRO stage (``sharding/zero_stages.py``): what docs/sharding.md's table says, the configuration's
range, and the planner's and the engine's reading of it."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest

import mpi4dl_nb as dl
from mpi4dl_nb.config import ParallelConfig
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.schema import FLAG_KEY
from mpi4dl_nb.sharding.zero_stages import ZERO_STAGES, zero_stage
from tests.support.mpirun import REPO


def table_rows() -> list[tuple[str, str, str]]:
    text = (REPO / "docs" / "sharding.md").read_text()
    return re.findall(r"^\| (\d) \| (.+?) \| (.+?) \|$", text, flags=re.MULTILINE)


def test_the_docs_table_is_the_records():
    assert [(str(z.number), z.kept, z.step) for z in ZERO_STAGES] == table_rows()


def test_the_records_cover_exactly_the_flags_range():
    knob = next(f for f in fields(ParallelConfig) if f.name == "zero_stage")
    bounds = knob.metadata[FLAG_KEY].bounds
    assert [z.number for z in ZERO_STAGES] == list(range(int(bounds.least), int(bounds.most) + 1))
    assert [zero_stage(z.number) for z in ZERO_STAGES] == list(ZERO_STAGES)
    with pytest.raises(ConfigError, match="--zero-stage"):
        zero_stage(len(ZERO_STAGES))
    with pytest.raises(ConfigError, match="--zero-stage"):
        dl.ParallelConfig(zero_stage=len(ZERO_STAGES))


def test_each_stage_shards_what_the_one_below_does_and_one_thing_more():
    order = [(z.shards_optimizer, z.shards_gradients, z.shards_weights) for z in ZERO_STAGES]
    assert order == [(False, False, False), (True, False, False), (True, True, False), (True, True, True)]
    assert [z.takes_whole_gradients for z in ZERO_STAGES] == [False, True, False, False]
    assert [z.gathers_after_step for z in ZERO_STAGES] == [False, True, True, False]
