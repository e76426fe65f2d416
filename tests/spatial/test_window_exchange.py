"""exchange.py's gathers run on every tile at once (one thread per tile, messages through queues): forward and gradient
equal one process's gather bit for bit, and each direction's ``Route`` copies where no slot is read twice."""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import pytest
import torch

from mpi4dl_nb.comm.handles import Transfer
from mpi4dl_nb.comm.tags import WINDOW
from mpi4dl_nb.comm.trace import Tracer
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.windows.exchange import Route, TokenExchange
from mpi4dl_nb.spatial.windows.plan import (
    Coord,
    ShiftedWindows,
    TileGather,
    TokenBoxes,
    WindowLayout,
    plan_gather,
    plan_merge,
    plan_roll,
)
from tests.spatial.test_windows import simulate

Mailboxes = dict[tuple[int, int, int], "queue.Queue[torch.Tensor]"]


class _Arrivals:
    """The receives of one posted exchange, completed by ``wait``."""

    def __init__(self, boxes: Mailboxes, rank: int, receives: list[Transfer]) -> None:
        self.boxes, self.rank, self.receives = boxes, rank, receives

    def wait(self) -> None:
        for t in self.receives:
            t.tensor.copy_(self.boxes[(t.peer, self.rank, t.tag)].get(timeout=30))


class QueueComm:
    """One tile's ``Comm.exchange`` between threads: a send is queued at once (a copy), a receive taken at ``wait``."""

    def __init__(self, rank: int, boxes: Mailboxes) -> None:
        self.rank, self.boxes = rank, boxes
        self.tracer = Tracer(rank)

    def exchange(self, transfers: Sequence[Transfer], via: object = None) -> _Arrivals:
        for t in transfers:
            if t.send:
                self.boxes[(self.rank, t.peer, t.tag)].put(t.tensor.detach().clone())
        return _Arrivals(self.boxes, self.rank, [t for t in transfers if not t.send])


def gathered_by_threads(plans: list[TileGather], values: list[torch.Tensor], weights: list[torch.Tensor],
                        comms: dict[int, QueueComm] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every tile's ``TokenExchange`` (batch 2, tokens in dim 1) in its own thread: outputs and input gradients of
    ``sum(out * weight)``; ``comms`` (when given) receives each tile's ``QueueComm``, its tracer included."""
    tiles = len(plans)
    boxes: Mailboxes = {(a, b, tag): queue.Queue() for a in range(tiles) for b in range(tiles)
                        for tag in (WINDOW.tag(0), WINDOW.tag(1))}
    outs: list[torch.Tensor | None] = [None] * tiles
    grads: list[torch.Tensor | None] = [None] * tiles
    failures: list[BaseException] = []

    def tile_step(tile: int) -> None:
        try:
            x = values[tile].detach().requires_grad_(True)
            comm = QueueComm(tile, boxes)
            if comms is not None:
                comms[tile] = comm
            exchange = TokenExchange(plans[tile], comm, range(tiles))  # type: ignore[arg-type]
            out = exchange(x)
            (out * weights[tile]).sum().backward()
            outs[tile], grads[tile] = out.detach(), x.grad
        except BaseException as error:   # reported by the test
            failures.append(error)

    threads = [threading.Thread(target=tile_step, args=(t,)) for t in range(tiles)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failures, failures
    return [o for o in outs if o is not None], [g for g in grads if g is not None]


def gathered_in_one_process(plans: list[TileGather], values: list[torch.Tensor], weights: list[torch.Tensor]
              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The same gather in one process (``simulate`` per sample, autograd through its indexing)."""
    leaves = [v.detach().requires_grad_(True) for v in values]
    outs = [torch.stack(per_sample) for per_sample in
            zip(*(simulate(plans, [leaf[b] for leaf in leaves]) for b in range(values[0].shape[0])))]
    sum((o * w).sum() for o, w in zip(outs, weights)).backward()   # type: ignore[union-attr]
    return [o.detach() for o in outs], [leaf.grad for leaf in leaves]   # type: ignore[misc]


def exchange_equals_one_process(plans: list[TileGather], device: str = "cpu") -> None:
    gen = torch.Generator().manual_seed(3)
    values = [torch.randn(2, p.source_size, 5, generator=gen, dtype=torch.float64).to(device) for p in plans]
    weights = [torch.randn(2, p.size, 5, generator=gen, dtype=torch.float64).to(device) for p in plans]
    got, got_grads = gathered_by_threads(plans, values, weights)
    want, want_grads = gathered_in_one_process(plans, values, weights)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "gathered values differ"
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads)), "gradients differ"


def half_shifted_layout(shape: tuple[int, ...], sizes: tuple[int, ...], window: int) -> WindowLayout:
    spec = ShiftedWindows(sizes, (window,) * len(sizes), (window // 2,) * len(sizes))
    return WindowLayout(spec, TokenBoxes(TileGrid.of_shape(shape), sizes))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,sizes,window", [((1, 2), (14, 14), 7), ((2, 2), (13, 11), 4), ((1, 4), (6, 14), 4),
                                                ((2, 1, 2), (5, 6, 7), 3)])
def test_windows_and_back_equal_one_process_values_and_gradients(shape: tuple[int, ...], sizes: tuple[int, ...],
                                                                 window: int, device: str) -> None:
    layout = half_shifted_layout(shape, sizes, window)
    exchange_equals_one_process(layout.into_windows(), device)
    exchange_equals_one_process(layout.out_of_windows(), device)


@pytest.mark.parametrize("shape,sizes", [((2, 2), (13, 11)), ((1, 2), (8, 8)), ((2, 2, 2), (5, 6, 7))])
def test_merges_and_rolls_equal_one_process_values_and_gradients(shape: tuple[int, ...],
                                                                 sizes: tuple[int, ...]) -> None:
    boxes = TokenBoxes(TileGrid.of_shape(shape), sizes)
    exchange_equals_one_process(plan_merge(boxes))
    exchange_equals_one_process(plan_roll(boxes, tuple(-(i + 1) for i in range(len(sizes)))))


def test_a_gather_reading_a_token_twice_adds_its_gradients() -> None:
    boxes = TokenBoxes(TileGrid(1, 2), (2, 4))
    # (0, 0) read three times, twice on tile 0
    targets: list[list[Coord | None]] = [[(0, 0), (0, 2), None, (0, 0)], [(0, 2), (0, 0), (1, 3)]]
    plans = plan_gather(targets, boxes.locate, [boxes.count(t) for t in range(2)])
    exchange_equals_one_process(plans)
    back = Route.build(plans[0].source_size, (plans[0].own_targets, plans[0].own_sources), [], [],
                       torch.device("cpu"))
    assert back.accumulate and back.pick is None


def test_swin_routes_copy_with_one_selection_and_zero_only_the_padding() -> None:
    layout = half_shifted_layout((1, 2), (13, 13), 4)   # padded to 16: padding slots in the last windows
    plans = layout.into_windows()
    for plan in plans:
        forward = Route.build(plan.size, (plan.own_sources, plan.own_targets), plan.sends, plan.receives,
                              torch.device("cpu"))
        backward = Route.build(plan.source_size, (plan.own_targets, plan.own_sources), plan.receives, plan.sends,
                               torch.device("cpu"))
        assert forward.pick is not None and not forward.accumulate
        assert backward.pick is not None and not backward.accumulate and not backward.blank.numel()
        padding = [slot for w in layout.owned(plan.tile) for slot, coord in enumerate(layout.windows.sources(w))
                   if coord is None]
        assert forward.blank.numel() == len(padding) > 0



def test_each_direction_s_wait_for_the_peers_is_one_traced_span() -> None:
    plans = half_shifted_layout((1, 2), (14, 14), 7).into_windows()
    gen = torch.Generator().manual_seed(5)
    values = [torch.randn(2, p.source_size, 3, generator=gen) for p in plans]
    weights = [torch.randn(2, p.size, 3, generator=gen) for p in plans]
    comms: dict[int, QueueComm] = {}
    gathered_by_threads(plans, values, weights, comms)
    for tile, comm in comms.items():
        waits = [event.extra.get("what") for event in comm.tracer.events if event.op == "window_wait"]
        assert waits == ["forward", "backward"], (tile, waits)
