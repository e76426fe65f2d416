"""The routes messages take: a payload's header host to host on the control plane, its tensors on the channel;
a halo on its tile group's route (on the torch plane, the tile group's process group)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from mpi4dl_nb.comm.handles import Channel, Group, Request, Transfer
from mpi4dl_nb.comm.messages import MessageOrderError, isend_payload, recv_payload
from mpi4dl_nb.comm.trace import Tracer
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.halo import HaloExchange
from mpi4dl_nb.spatial.layer import SpatialRuntime

Route = Group | Channel | None


class Loopback:
    """One rank talking to itself: every message posted is noted with its plane and route; a receive takes the
    oldest send of its plane (messages match in posting order, as on the torch plane), zeros if none."""

    rank, world_size, device = 0, 1, torch.device("cpu")
    tracer = Tracer(0, enabled=False)

    def __init__(self) -> None:
        self.posted: list[tuple[str, bool, torch.device, Route]] = []   # (plane, send?, device, route)
        self.sent: dict[str, list[torch.Tensor]] = {"host": [], "data": []}

    def _post(self, plane: str, transfers: Sequence[Transfer], via: Route) -> Request:
        for t in transfers:
            self.posted.append((plane, t.send, t.tensor.device, via))
            if t.send:
                self.sent[plane].append(t.tensor.clone())
            elif self.sent[plane]:
                t.tensor.copy_(self.sent[plane].pop(0))
            else:
                t.tensor.zero_()
        return Request.completed()

    def exchange(self, transfers: Sequence[Transfer], via: Route = None) -> Request:
        return self._post("data", transfers, via)

    def exchange_host(self, transfers: Sequence[Transfer]) -> Request:
        return self._post("host", transfers, None)


def test_a_payload_s_header_goes_host_to_host_and_its_tensors_on_the_channel():
    comm, channel = Loopback(), Channel(0, 0)
    payload = (torch.randn(2, 3, dtype=torch.float64), torch.arange(4))
    isend_payload(comm, payload, 0, 7, channel)  # type: ignore[arg-type]   # the members payloads use
    got = recv_payload(comm, 0, 7, torch.device("cpu"), channel)  # type: ignore[arg-type]
    assert isinstance(got, tuple) and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, payload))
    assert [(plane, send) for plane, send, _, _ in comm.posted] == [
        ("host", True), ("data", True), ("data", True), ("host", False), ("data", False), ("data", False)]
    assert all(device.type == "cpu" for plane, _, device, _ in comm.posted if plane == "host")
    assert all(via is channel for plane, _, _, via in comm.posted if plane == "data")


def test_a_header_of_another_tag_is_refused_before_the_tensors_are_received():
    comm = Loopback()
    isend_payload(comm, torch.ones(3), 0, 6)  # type: ignore[arg-type]
    with pytest.raises(MessageOrderError, match="tag 5.*tag 6"):
        recv_payload(comm, 0, 5, torch.device("cpu"))  # type: ignore[arg-type]
    assert [(plane, send) for plane, send, _, _ in comm.posted][-1] == ("host", False)


def test_a_context_moves_host_tensors_on_its_control_plane_in_posting_order_and_refuses_device_ones():
    from mpi4dl_nb.comm.context import Context

    ctx = Context(backend="mpi", trace=False)   # a world of one: the rank sends to itself
    sent = [torch.arange(5) * (k + 1) for k in range(2)]
    got = [torch.zeros(5, dtype=torch.int64) for _ in sent]
    ctx.exchange_host([Transfer.to(t, 0, tag=9 - k) for k, t in enumerate(sent)]
                      + [Transfer.into(t, 0, tag=k) for k, t in enumerate(got)]).wait()   # tags play no part
    assert all(torch.equal(a, b) for a, b in zip(got, sent))
    with pytest.raises(ValueError, match="host tensors; got one on meta"):
        ctx.exchange_host([Transfer.to(torch.empty(3, device="meta"), 0)])


def test_a_spatial_layer_s_halo_travels_on_its_tile_group():
    grid = TileGrid(1, 2)
    group = Group((3, 5))

    class Member(Loopback):
        rank, world_size = 5, 6

    comm = Member()
    runtime = SpatialRuntime(grid, comm, group)  # type: ignore[arg-type]
    exchange = runtime.exchange(grid.layer_halo(4, 6, 3, 1, 1), 0.0)
    assert exchange.via is group and exchange.peers[1].prev == 3
    exchange.forward_tensor(torch.randn(1, 1, 4, 3))            # its strip from tile 0: zeros
    assert [send for _, send, _, _ in comm.posted] == [False, True]
    assert all(plane == "data" and via is group for plane, _, _, via in comm.posted)
    with pytest.raises(ValueError, match="not the tile group"):
        HaloExchange(grid.layer_halo(4, 6, 3, 1, 1), 1, [3, 5], comm, via=Group((5, 3)))  # type: ignore[arg-type]
