"""MPI (3 ranks): engine errors, step-through hook order, gathered timeline, 1-step grads.

Usage: python -m tests.mpi.engine_misc [--backend=gloo]."""

from __future__ import annotations

import sys

import torch
from torch import nn

import mpi4dl_nb as dl
from tests.support.checks import Checks, run_checks
from tests.support.models import build
from tests.support.planes import split_backend

CHECKS = ("wrong world size refused", "uneven batch refused", "hook sees the schedule in order",
          "manual stepping equals train_step", "kept gradients equal serial", "gathered timeline",
          "tracing off: no trace work per action")


def expect_config_error(fn, *words: str) -> None:
    try:
        fn()
    except dl.ConfigError as err:
        text = str(err)
        missing = [w for w in words if w not in text]
        if missing:
            raise AssertionError(f"ConfigError {text!r} lacks {missing}") from err
        return
    raise AssertionError(f"no ConfigError (expected one mentioning {words})")


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init(backend=split_backend(sys.argv[1:])[0])
    ctx.tracer.clear()       # the gathered timeline holds this program's two engines (a shared launch ran others)
    layers = build("resnet")
    loss_fn = nn.CrossEntropyLoss()
    wrong_world, uneven, hook, manual_step, kept_grads, timeline, untraced = CHECKS

    # wrong world size: named knob + the launch that works
    with check(wrong_world):
        expect_config_error(lambda: dl.HybridEngine(layers, dl.ParallelConfig(split_size=2,
                            spatial_size=0), ctx, loss_fn=loss_fn), "world_size", "mpiexec -n 2")

    cfg = dl.ParallelConfig(split_size=3, spatial_size=0, parts=4, schedule="1f1b")
    engine = dl.HybridEngine(layers, cfg, ctx, loss_fn=loss_fn)
    x = torch.randn(8, 3, 16, 16, dtype=torch.float64)
    y = torch.randint(0, 5, (8,))
    # uneven batch: refused on every rank before any message, naming parts and a fix
    with check(uneven):
        expect_config_error(lambda: engine.train_step(x[:6], y[:6]), "parts", "batch_size 4 or 8")

    # the step-through hook sees exactly this rank's schedule, in order
    with check(hook):
        seen = []
        loss = engine.train_step(x, y, on_action=seen.append)
        assert seen == engine.schedule.actions(ctx.rank), "hook order differs from the schedule"

    # the same step driven by hand, one action at a time (what a step-through widget does)
    with check(manual_step):
        manual = dl.HybridEngine(build("resnet"), cfg, ctx, loss_fn=loss_fn)
        manual.start_step(x, y)
        taken = []
        while True:
            upcoming = manual.next_action()
            action = manual.advance()
            assert action is upcoming
            if action is None:
                break
            taken.append(action)
        assert taken == engine.schedule.actions(ctx.rank)
        assert abs(manual.finish_step() - loss) <= 1e-12 * abs(loss), "manual step loss differs"

    # gradients were kept (optimizer=None): compare with a serial accumulation
    with check(kept_grads):
        serial = nn.Sequential(*build("resnet"))
        for j in range(4):
            (loss_fn(serial(x[2 * j:2 * j + 2]), y[2 * j:2 * j + 2]) * 0.25).backward()
        want = dict(serial.named_parameters())
        for inst in engine.instances.values():
            for key, p in inst.canonical.named_parameters():
                g = want[inst.canonical.full_key(key)].grad
                err = (p.grad - g).abs().max().item() / max(g.abs().max().item(), 1e-6)
                assert err < 1e-9, f"rank {ctx.rank} {key}: grad error {err:.2e}"

    # one gathered timeline with every rank's compute and messages
    with check(timeline):
        events = engine.timeline(clear=True)
        if ctx.rank == 0:
            ranks = {e.rank for e in events}
            assert ranks == {0, 1, 2}, ranks
            ops = {e.op for e in events}
            assert {"F", "B", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD", "OPTIM"} <= ops, ops
            sends = [e for e in events if e.op == "SEND_ACT"]
            assert all(e.bytes > 0 and e.peer is not None for e in sends)
            f0 = [e for e in events if e.op == "F" and e.stage == 0]
            assert [e.micro_batch for e in f0] == [0, 1, 2, 3] * 2   # two engines, one step each
            assert all(a.start <= b.start for a, b in zip(events, events[1:]))

    # tracing off: a step records nothing and takes no time stamp (one flag check per action, no more)
    with check(untraced):
        calls = untraced_step_calls(ctx.tracer, lambda: engine.train_step(x, y))
        assert calls == {"events": 0, "stamps": 0, "records": 0, "event calls": 0}, calls
        traced = untraced_step_calls(ctx.tracer, lambda: engine.train_step(x, y), enabled=True)
        actions = len(engine.schedule.actions(ctx.rank))
        assert traced["events"] == traced["event calls"] == actions and traced["stamps"] == 2 * actions, \
            (traced, actions)   # it can fail
    ctx.barrier()


def untraced_step_calls(tracer, step, enabled: bool = False) -> dict[str, int]:
    """Events kept and the tracer's stamp/record/event calls during ``step()`` with tracing ``enabled``."""
    counts = {"stamps": 0, "records": 0, "event calls": 0}
    stamp, record, event = tracer.stamp, tracer.record, tracer.event

    def counted_stamp():
        counts["stamps"] += 1
        return stamp()

    def counted_record(*args, **kwargs):
        counts["records"] += 1
        return record(*args, **kwargs)

    def counted_event(*args, **kwargs):
        counts["event calls"] += 1
        return event(*args, **kwargs)

    before, tracer.enabled = tracer.recorded, enabled
    tracer.stamp, tracer.record, tracer.event = counted_stamp, counted_record, counted_event
    try:
        step()
    finally:
        tracer.enabled = True
        del tracer.stamp, tracer.record, tracer.event
    return {"events": tracer.recorded - before, **counts}


if __name__ == "__main__":
    run_checks(main)
