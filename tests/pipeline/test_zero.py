"""ZeRO levels 1-3 (issue 80): where the shards lie (unit), what is refused, and under mpiexec every level equals one
process on 2x2 tiles + a layer rank and on tiles x 2 replicas with AdamW, SGD + clipping, accumulation, layer-decay
groups and frozen layers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.planner.fake_world import FakeComm
from mpi4dl_nb.sharding.plan import ShardPlan, shard_bounds
from tests.mpi.zero_exact import CHECKPOINT_LEVELS, LEVELS
from tests.support.battery import shared_job

JOB = shared_job(5, "zero_exact", "tiles", timeout=400)
REPLICAS_JOB = shared_job(6, "zero_exact", "replicas", timeout=400)
SE_JOB = shared_job(3, "zero_exact", "--variants=adamw", "se_tiles2", timeout=300)
PLANES = {"mpi": shared_job(4, "zero_planes", timeout=60),
          "gloo": shared_job(4, "zero_planes", "--backend=gloo", plane="gloo", timeout=60)}


def test_every_level_equals_one_process_and_checkpoints_whole(shared_launch):
    """float64 within 1e-9 of the serial run at levels 1-3 (clipping at 0 too; evaluation after training); the gathered
    optimizer state equals level 0's and resumes at another level; level 3 keeps at most 0.3 of level 0's state on a
    tile rank and gathers its weights layer by layer, at most two layers' at once."""
    names = [f"tiles {variant} zero {level}" for variant, levels in LEVELS.items() for level in levels]
    names += [f"tiles checkpoint zero {level}" for level in CHECKPOINT_LEVELS] + ["tiles state bytes"]
    assert {level for levels in LEVELS.values() for level in levels} == {0, 1, 2, 3}
    shared_launch(JOB).require(names)


def test_every_level_on_tiles_times_two_replicas_equals_one_process(shared_launch):
    """1x2 tiles + a layer rank, twice (data parallel 2): each stage sharded over its tiles and replicas together."""
    names = [f"replicas {variant} zero {level}" for variant, levels in LEVELS.items() for level in levels]
    shared_launch(REPLICAS_JOB).require(names + [f"replicas checkpoint zero {level}" for level in CHECKPOINT_LEVELS]
                                        + ["replicas state bytes"])


def test_tile_replicated_parameters_add_their_gradient_once(shared_launch):
    """SE gates on tiles: every tile holds their whole gradient, tile 0 alone puts it into the reduce-scatter."""
    names = [f"se_tiles2 adamw zero {level}" for level in LEVELS["adamw"]]
    shared_launch(SE_JOB).require(names + [f"se_tiles2 checkpoint zero {level}" for level in CHECKPOINT_LEVELS]
                                  + ["se_tiles2 state bytes"])


@pytest.mark.parametrize("plane", sorted(PLANES))
def test_reduce_scatter_and_all_gather_take_uneven_and_empty_pieces(shared_launch, plane):
    shared_launch(PLANES[plane]).require(["reduce_scatter uneven", "all_gather uneven"]
                                         + (["node shards"] if plane == "mpi" else []))


def test_shards_cover_every_element_once_in_member_order():
    for numel, members in [(10, 4), (3, 4), (1, 3), (12, 4), (0, 2)]:
        slices = [shard_bounds(numel, members, m) for m in range(members)]
        covered = [i for start, stop in slices for i in range(start, stop)]
        assert covered == list(range(numel))
        assert all(stop - start <= -(-numel // members) for start, stop in slices)
    assert [shard_bounds(3, 4, m) for m in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]   # the last one empty


def test_plan_counts_and_places_hold_each_members_piece_together():
    plan = ShardPlan((10, 3), members=4, index=1)
    assert plan.counts == [3 + 1, 3 + 1, 3 + 1, 1 + 0]
    assert plan.mine() == [(3, 6), (1, 2)] and plan.piece_offsets() == [0, 3]
    places = plan.places()
    assert places[:2] == [(0, 0, 3), (1, 0, 1)] and places[-2:] == [(0, 9, 10), (1, 3, 3)]
    assert sum(stop - start for _, start, stop in places) == 13


def test_gems_with_sharding_and_a_stage_above_3_are_refused_naming_the_flag_before_any_model():
    """The configuration itself refuses them (the command line's exit 2 before any rank builds a model)."""
    with pytest.raises(ConfigError, match="--zero-stage.*--times"):
        dl.ParallelConfig(split_size=2, spatial_size=0, times=1, zero_stage=2)
    with pytest.raises(ConfigError, match="--zero-stage.*<= 3, got 4"):
        dl.ParallelConfig(zero_stage=4)


def _layers() -> list[nn.Module]:
    """Five layers: four (Linear, BatchNorm, Tanh) blocks and a Linear head."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = [nn.Sequential(nn.Linear(i, o), nn.BatchNorm1d(o), nn.Tanh())
                               for i, o in [(6, 32), (32, 32), (32, 32), (32, 32)]]
    return [*blocks, nn.Linear(32, 3)]


@pytest.mark.parametrize("recompute", [None, "every", 2])
def test_level_3_gathers_layer_by_layer_within_two_layers_and_keeps_backward_exact(recompute):
    """Level 3 on 2 holders (the other's slices zeros, FakeComm): each layer gathered before its forward and its
    backward and freed after, so the whole weights alive never exceed the two largest layers' (the stage's five are
    1.67 times those), with and without recomputation; outputs and gradients equal a model holding the same weights
    whole, and after backward every layer is freed by its gradients' accumulation."""
    from mpi4dl_nb.comm.handles import Group
    from mpi4dl_nb.pipeline.recompute import checkpointed
    from mpi4dl_nb.sharding.layer_units import gather_layer_by_layer
    from mpi4dl_nb.sharding.sharded_stage import ShardedStage

    model = nn.Sequential(*_layers()).double()
    want = copy.deepcopy(model)
    ctx = FakeComm(0, None, torch.device("cpu"), world_size=2)
    trained = [(k, p) for k, p in model.named_parameters()]
    stage = ShardedStage(ctx, 0, trained, Group((0, 1)), 3, lambda: ())
    with torch.no_grad():   # the reference holds what the gathers rebuild: this holder's slices, zeros elsewhere
        for p, (start, stop) in zip(want.parameters(), stage.plan.mine()):
            kept = p.reshape(-1)[start:stop].clone()
            p.zero_().reshape(-1)[start:stop] = kept
    run = model if recompute is None else checkpointed(model, recompute)
    assert gather_layer_by_layer(stage, run) and len(stage.units) == 5 and stage.released
    x = torch.randn(8, 6, dtype=torch.float64)
    out, ref = run(x), want(x)
    assert stage.gathered_bytes == 0 and torch.equal(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    assert stage.gathered_bytes == 0   # every layer freed when its gradients were accumulated
    for p, q in zip(model.parameters(), want.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad)
    two = sum(sorted(stage.unit_bytes)[-2:])
    assert stage.peak_bytes <= two < sum(stage.unit_bytes) / 1.5, (stage.peak_bytes, stage.unit_bytes)
