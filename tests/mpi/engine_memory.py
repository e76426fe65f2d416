"""MPI: each rank keeps only its stages' weights; per-rank input equals the global batch; state scatter.

Usage: python -m tests.mpi.engine_memory CASE [CASE ...]  (cases of tests/support/engine_cases.py,
all of this world size). Named checks per case: ``check_names(CASE)``.

Per case, on every rank:
* held bytes: ``held_parameter_bytes()`` == the serial model's bytes of the stages this rank
  holds (a stage held in both GEMS directions twice); the user's ``layers`` keep real memory
  only for those stages, every other layer is on ``meta`` and refuses to run;
* sharded input: an engine fed per-rank (a callable reading only the rank's rows and tile box
  on stage-0 ranks, None elsewhere; labels only on last-stage ranks) gives bit-identical
  losses and state to an engine fed the global batch;
* ``scatter_to_holders`` sends a rank exactly its stages' keys; load/full round trip; a state
  dict with a missing key is refused on every rank.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.pipeline.stages import split_layers
from mpi4dl_nb.pipeline.step_input import ShardedImages
from tests.support.checks import Checks, run_checks
from tests.support.engine_cases import CASES, config_of
from tests.support.models import build

STEPS = 3
CHECKS = ("held stages and bytes", "sharded input", "scatter to holders")


def check_names(case: str) -> list[str]:
    return [f"{case}: {what}" for what in CHECKS]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta")


def stage_bytes(model_name: str, cfg) -> tuple[list[int], list[int]]:
    """Per stage of a fresh serial model: parameter bytes, parameter + buffer bytes."""
    stages = split_layers(build(model_name), cfg.split_size, cfg.balance)
    return ([nbytes(s.parameters()) for s in stages],
            [nbytes(list(s.parameters()) + list(s.buffers())) for s in stages])


def check_memory(ctx, name: str) -> list[int]:
    cfg = config_of(name)
    model_name = CASES[name][1]
    params, states = stage_bytes(model_name, cfg)
    layers = build(model_name)
    engine = dl.HybridEngine(layers, cfg, ctx, loss_fn=nn.CrossEntropyLoss(), optimizer=sgd)
    role = dl.layout(cfg)[ctx.rank]
    slots = [role.primary.stage] + ([role.mirror.stage] if role.mirror is not None else [])
    held = sorted(set(slots))
    assert engine.held_stages() == held, (engine.held_stages(), held)
    assert engine.released_stages == [s for s in range(cfg.split_size) if s not in held]
    want = sum(params[s] for s in slots)
    assert engine.held_parameter_bytes() == want, (name, engine.held_parameter_bytes(), want)
    assert engine.held_parameter_bytes(include_buffers=True) == sum(states[s] for s in slots)
    # the user's layer objects: the held ones are the trained ones, the others hold nothing
    user = [t for layer in layers for t in [*layer.parameters(), *layer.buffers()]]
    assert nbytes(user) == sum(states[s] for s in held), (name, nbytes(user))
    for s, stage in enumerate(engine.stages):
        for position in range(len(stage)):
            layer = layers[stage.offset + position]
            on_meta = all(t.device.type == "meta" for t in [*layer.parameters(), *layer.buffers()])
            assert on_meta == (s not in held), (name, s, position)
            if s in held:
                assert any(layer is inst.canonical[position] for (_, st), inst in
                           engine.instances.items() if st == s), "held layer is not the user's"
    if engine.released_stages:
        stage = engine.stages[engine.released_stages[0]]
        try:
            stage[0](torch.zeros(1, 3, 4, 4, dtype=torch.float64))
        except RuntimeError as err:
            assert "released" in str(err) and "full_state_dict" in str(err), err
        else:
            raise AssertionError(f"{name}: a released layer ran")
    total = sum(params)
    return [engine.held_parameter_bytes(), total]


def check_sharded_input(ctx, name: str) -> None:
    cfg = config_of(name)
    _, model_name, batch, image = CASES[name]
    gen = torch.Generator().manual_seed(11)
    data = [(torch.randn(batch, 3, image, image, generator=gen, dtype=torch.float64),
             torch.randint(0, 5, (batch,), generator=gen)) for _ in range(STEPS)]
    full = dl.HybridEngine(build(model_name), cfg, ctx, loss_fn=nn.CrossEntropyLoss(),
                           optimizer=sgd)
    sharded = dl.HybridEngine(build(model_name), cfg, ctx, loss_fn=nn.CrossEntropyLoss(),
                              optimizer=sgd)
    firsts = [a for a in sharded.schedule.actions(ctx.rank) if a.kind == "F" and a.stage == 0]
    last = cfg.split_size - 1 in sharded.held_stages()
    requests: list[tuple[slice, object, tuple]] = []
    losses_full, losses_sharded = [], []
    for step, (x, y) in enumerate(data):
        losses_full.append(full.train_step(x, y))

        def read(rows: slice, box, x=x):
            part = x[rows]
            if box is not None:
                r0, r1, c0, c1 = box
                part = part[..., r0:r1, c0:c1]
            out = part.clone()
            requests.append((rows, box, tuple(out.shape)))
            return out
        images = None
        if firsts:
            images = read if step == 0 else ShardedImages(read, batch, (image, image))
        labels = None
        if last:
            labels = y if step < 2 else (lambda rows, y=y: y[rows])
        if step == 0:   # plain callables: the global sizes come as arguments
            losses_sharded.append(sharded.train_step(images, labels, batch_size=batch,
                                                     image_size=image))
        elif step == 1 and not firsts and not last:
            losses_sharded.append(sharded.train_step(None, None, batch_size=batch))
        else:
            losses_sharded.append(sharded.train_step(images, labels, batch_size=batch))
    assert losses_full == losses_sharded, (name, losses_full, losses_sharded)
    chunk = batch // cfg.batch_divisor
    assert len(requests) == STEPS * len(firsts)
    for rows, box, shape in requests:
        assert rows.stop - rows.start == chunk and shape[0] == chunk
        if firsts[0].tile is not None:
            assert box is not None and shape[-2:] != (image, image), (name, box, shape)
            assert shape[-2:] == (box[1] - box[0], box[3] - box[2])
        else:
            assert box is None and shape[-2:] == (image, image)
    a, b = full.full_state_dict(), sharded.full_state_dict()
    if ctx.rank == 0:
        assert list(a) == list(b)
        for key in a:
            assert torch.equal(a[key], b[key]), (name, key)


def check_scatter(ctx, name: str) -> None:
    cfg = config_of(name)
    model_name = CASES[name][1]
    engine = dl.HybridEngine(build(model_name, seed=0), cfg, ctx, loss_fn=nn.CrossEntropyLoss())
    other = nn.Sequential(*build(model_name, seed=7)).state_dict() if ctx.rank == 0 else None
    mine = engine.scatter_to_holders(other)
    assert sorted(mine) == sorted(engine.stage_keys(engine.held_stages())), (name, sorted(mine))
    engine.load_full_state_dict(other)
    back = engine.full_state_dict()
    if ctx.rank == 0:
        for key, value in other.items():
            assert torch.equal(back[key], value), (name, key)
    broken = dict(other) if ctx.rank == 0 else None
    if broken is not None:
        broken.pop(next(iter(broken)))
    try:
        engine.load_full_state_dict(broken)
    except ValueError as err:
        assert "lacks" in str(err), err
    else:
        raise AssertionError(f"{name}: a state dict with a missing key was accepted")


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    for name in sys.argv[1:]:
        memory, sharded, scatter = check_names(name)
        with check(memory) as result:
            held, total = check_memory(ctx, name)
            result.detail = f"holds {held} of {total} parameter bytes (model)"
        with check(sharded):
            check_sharded_input(ctx, name)
        with check(scatter):
            check_scatter(ctx, name)
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
