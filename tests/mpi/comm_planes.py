"""Both data planes: send/recv, exchanges, channels and payloads in send order, all_reduce,
broadcast, groups, on any rank count; the mpi plane's staged (GPU) path forced on CPU.

On the torch plane messages match by posting order (no tags, as on NCCL), so every check
posts in the same order on both sides; the out-of-order-tags check runs on the mpi plane only.

Usage: python -m tests.mpi.comm_planes [--device=cuda] [--plane=mpi|torch]: with CUDA, tensors live on
the GPU and the planes are mpi (CUDA-aware or staged) and nccl (``benchmarks/gpu_check.sh``); ``--plane``
runs one plane's checks alone (the mpi plane's run with ranks sharing one GPU, NCCL's cannot).
"""

from __future__ import annotations

import sys
import time

import torch

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.comm.handles import Transfer
from mpi4dl_nb.comm.messages import Mailbox, MessageOrderError, isend_payload, recv_payload
from mpi4dl_nb.comm.mpi_plane import MpiPlane
from mpi4dl_nb.comm.waiting import WaitMode
from tests.support.checks import Checks, run_checks

PLANES = {"cpu": ("mpi", "gloo"), "cuda": ("mpi", "nccl")}
CHECKS = ("send/recv", "exchange both ways", "channel payloads in send order", "all_reduce world",
          "all_reduce group", "broadcast", "group broadcast", "1 MiB float32 message",
          "int64 all_reduce", "all_gather_object", "groups cached", "iall_reduce while computing")
MPI_ONLY = ("irecv two tags", "staged path", "wait block", "wait yield", "object collectives wait asleep")
TORCH_ONLY = ("wrong order refused",)   # on the mpi plane a wrong tag is never matched: it hangs


def check_names(device: str = "cpu", plane: str | None = None) -> list[str]:
    """Every check this program reports, on any rank count (``plane``: "mpi" or "torch" alone)."""
    mpi, torch_backend = PLANES[device]
    names = {"mpi": [f"{mpi} {what}" for what in (*CHECKS, *MPI_ONLY)],
             "torch": [f"{torch_backend} {what}" for what in (*CHECKS, *TORCH_ONLY)]}
    return [name for side in ("mpi", "torch") if plane in (None, side) for name in names[side]]


def exercise(ctx: Context, check: Checks) -> None:
    rank, size = ctx.rank, ctx.world_size
    name = ctx.backend
    dtype = torch.float64
    right, left = (rank + 1) % size, (rank - 1) % size

    # blocking ring: even ranks send first, odd receive first (no deadlock for any size)
    with check(f"{name} send/recv"):
        out = torch.arange(1000, dtype=dtype) + 1000 * rank
        got = torch.empty(1000, dtype=dtype)
        if rank % 2 == 0:
            ctx.send(out, right, tag=1)
            ctx.recv(got, left, tag=1)
        else:
            ctx.recv(got, left, tag=1)
            ctx.send(out, right, tag=1)
        assert torch.equal(got, torch.arange(1000, dtype=dtype) + 1000 * left), f"from rank {left}"

    # one exchange: two messages to the right (same direction: matched in order) and two
    # from the left, all posted at once, receives listed first
    with check(f"{name} exchange both ways"):
        a = torch.full((3, 5), float(rank), dtype=dtype)
        b = torch.full((7,), float(rank) + 0.5, dtype=dtype)
        ra, rb = torch.empty(3, 5, dtype=dtype), torch.empty(7, dtype=dtype)
        ctx.exchange([Transfer.into(ra, left, 2), Transfer.into(rb, left, 3),
                      Transfer.to(a, right, 2), Transfer.to(b, right, 3)]).wait()
        assert torch.equal(ra, torch.full((3, 5), float(left), dtype=dtype)), f"{name} first message"
        assert torch.equal(rb, torch.full((7,), float(left) + 0.5, dtype=dtype)), f"{name} second"

    if ctx.plane == "mpi":   # tags let the receiver post in another order than the sender
        with check(f"{name} irecv two tags"):
            a = torch.full((3, 5), float(rank), dtype=dtype)
            b = torch.full((7,), float(rank) + 0.5, dtype=dtype)
            ra, rb = torch.empty(3, 5, dtype=dtype), torch.empty(7, dtype=dtype)
            reqs = [ctx.irecv(ra, left, tag=2), ctx.irecv(rb, left, tag=3),
                    ctx.isend(b, right, tag=3), ctx.isend(a, right, tag=2)]
            ctx.wait_all(reqs)
            assert torch.equal(ra, torch.full((3, 5), float(left), dtype=dtype)), f"{name} tag 2"
            assert torch.equal(rb, torch.full((7,), float(left) + 0.5, dtype=dtype)), f"{name} tag 3"

    # one-way channels around the ring (made collectively, same pairs everywhere): three
    # payloads sent in one order, taken in another; the mailbox receives in send order
    pairs = [(r, (r + 1) % size) for r in range(size)] if size > 1 else []
    channels = ctx.channels(pairs)
    with check(f"{name} channel payloads in send order"):
        if size > 1:
            assert ctx.channels(pairs) == channels and len(channels) == len(set(pairs))
            out, into = channels[(rank, right)], channels[(left, rank)]
            sent = {key: (torch.full((2, key + 1), 10.0 * rank + key, dtype=dtype),
                          torch.arange(key + 1)) for key in (0, 1, 2)}
            requests = [r for key in (0, 1, 2)
                        for r in isend_payload(ctx, sent[key], right, 100 + key, out)]
            mailbox = Mailbox(ctx, ctx.device, {left: [(k, 100 + k) for k in (0, 1, 2)]},
                              {left: into})
            mailbox.begin()
            for key in (2, 0, 1):
                got = mailbox.take(left, key)
                want = (torch.full((2, key + 1), 10.0 * left + key, dtype=dtype), torch.arange(key + 1))
                assert isinstance(got, tuple) and all(torch.equal(g, w) for g, w in zip(got, want))
            mailbox.check_drained()
            ctx.wait_all(requests)
            assert mailbox.early_total == 2, mailbox.early_total   # 0 and 1 came before 2
    if ctx.plane == "torch" and size > 1:
        with check(f"{name} wrong order refused"):
            requests = isend_payload(ctx, torch.ones(4, dtype=dtype), right, 6, channels[(rank, right)])
            try:
                recv_payload(ctx, left, 5, ctx.device, channels[(left, rank)])
            except MessageOrderError as error:
                assert "tag 5" in str(error) and "tag 6" in str(error), str(error)
            else:
                raise AssertionError("a payload with another tag was taken as tag 5")
            drain = torch.empty(4, dtype=dtype)   # the refused payload's tensor is still due
            ctx.exchange([Transfer.into(drain, left, 6)], channels[(left, rank)]).wait()
            ctx.wait_all(requests)

    # all_reduce over the world and over a subgroup
    with check(f"{name} all_reduce world"):
        t = torch.tensor([rank + 1.0, 2.0 * rank], dtype=dtype)
        ctx.all_reduce(t)
        n = size
        assert torch.equal(t, torch.tensor([n * (n + 1) / 2, n * (n - 1)], dtype=dtype)), \
            f"{name} all_reduce world gave {t}"
    evens = ctx.new_group([r for r in range(size) if r % 2 == 0])
    odds = ctx.new_group([r for r in range(size) if r % 2 == 1])
    mine = evens if rank % 2 == 0 else odds
    with check(f"{name} all_reduce group"):
        u = torch.tensor([float(rank)], dtype=dtype)
        ctx.all_reduce(u, group=mine)
        assert u.item() == sum(mine.ranks), f"{name} all_reduce group {mine.ranks} gave {u.item()}"

    # broadcast from the last rank, world and group (root given as a global rank)
    with check(f"{name} broadcast"):
        v = torch.full((4,), float(rank), dtype=dtype)
        ctx.broadcast(v, root=size - 1)
        assert torch.equal(v, torch.full((4,), float(size - 1), dtype=dtype)), f"{name} broadcast"
    with check(f"{name} group broadcast"):
        w = torch.full((2,), float(rank), dtype=dtype)
        ctx.broadcast(w, root=mine.ranks[-1], group=mine)
        assert torch.equal(w, torch.full((2,), float(mine.ranks[-1]), dtype=dtype)), \
            f"{name} group broadcast"

    # large message, float32 and int64 dtypes
    with check(f"{name} 1 MiB float32 message"):
        big = torch.randn(1 << 18, generator=torch.Generator().manual_seed(rank), device="cpu")
        big = big.float().to(ctx.device)
        recv_big = torch.empty_like(big)
        ctx.wait_all([ctx.irecv(recv_big, left, tag=4), ctx.isend(big, right, tag=4)])
        expect = torch.randn(1 << 18, generator=torch.Generator().manual_seed(left),
                             device="cpu").float().to(ctx.device)
        assert torch.equal(recv_big, expect), f"{name} 1 MiB float32 message"
    # non-blocking all-reduces (the gradient buckets'): two posted on a group and the world, tested
    # while this rank computes, waited in posting order; the sum is there after wait
    with check(f"{name} iall_reduce while computing"):
        first = torch.full((1000,), float(rank), dtype=dtype)
        second = torch.tensor([float(rank + 1)], dtype=dtype)
        pending = [ctx.iall_reduce(first, group=mine), ctx.iall_reduce(second)]
        busy = torch.randn(64, 64, dtype=dtype)
        for _ in range(5):
            busy = busy @ busy.t() / 64
            for request in pending:
                request.test()
        ctx.wait_all(pending)
        assert torch.equal(first, torch.full((1000,), float(sum(mine.ranks)), dtype=dtype)), f"{name} group"
        assert second.item() == size * (size + 1) / 2, f"{name} world iall_reduce gave {second.item()}"
    with check(f"{name} int64 all_reduce"):
        ints = torch.tensor([rank], dtype=torch.int64)
        ctx.all_reduce(ints)
        assert ints.item() == size * (size - 1) // 2, f"{name} int64 all_reduce"
    with check(f"{name} all_gather_object"):
        ctx.barrier()
        assert ctx.all_gather_object(rank) == list(range(size))
    with check(f"{name} groups cached"):
        count = ctx.cached_groups
        assert ctx.new_group([r for r in range(size) if r % 2 == 0]) is evens
        assert ctx.channels(pairs) == channels and ctx.cached_groups == count


def staged_path(ctx: Context, check: Checks) -> None:
    """The mpi plane's GPU staging through the pinned pool (forced for CPU tensors)."""
    rank, size = ctx.rank, ctx.world_size
    right, left = (rank + 1) % size, (rank - 1) % size
    plane = MpiPlane(ctx.mpi_comm, ctx.device, staging=True)
    with check("mpi staged path"):
        for step in range(20):
            out = torch.full((100 + step % 3,), float(rank + step), dtype=torch.float64)
            got = torch.empty_like(out)
            plane.exchange([Transfer.into(got, left, 9), Transfer.to(out, right, 9)], None).wait()
            assert torch.equal(got, torch.full_like(out, float(left + step))), f"step {step}"
            total = torch.tensor([float(rank)])
            plane.all_reduce(total, ctx.world)
            assert total.item() == size * (size - 1) / 2
            later = torch.tensor([float(rank), 1.0])
            request = plane.iall_reduce(later, ctx.world)
            request.wait()
            assert later.tolist() == [size * (size - 1) / 2, float(size)], later
        assert plane.pool.lent == 0 and plane.pool.created <= 2, plane.pool.created


def wait_modes(ctx: Context, check: Checks) -> None:
    """The mpi plane completes exchanges and collectives the same way blocking in MPI and
    testing with pauses (the mode ranks sharing cores use)."""
    rank, size = ctx.rank, ctx.world_size
    right, left = (rank + 1) % size, (rank - 1) % size
    for mode in WaitMode:
        plane = MpiPlane(ctx.mpi_comm, ctx.device, wait_mode=mode)
        with check(f"mpi wait {mode}"):
            got = torch.empty(64, dtype=torch.float64)
            if rank == 1:
                time.sleep(0.05)             # the others wait for this one (the yield mode pauses)
            request = plane.exchange([Transfer.into(got, left, 3),
                                      Transfer.to(torch.full((64,), float(rank), dtype=torch.float64), right, 3)], None)
            request.wait()
            assert torch.equal(got, torch.full((64,), float(left), dtype=torch.float64))
            total = torch.tensor([float(rank)], dtype=torch.float64)
            plane.all_reduce(total, ctx.world)
            assert total.item() == size * (size - 1) / 2, total
            root = torch.tensor([float(rank)], dtype=torch.float64)
            plane.broadcast(root, size - 1, ctx.world)
            assert root.item() == size - 1, root
            assert plane.wait_mode is mode


LATE = 0.4      # seconds the last rank arrives after the others


def object_waits(device: str, check: Checks) -> None:
    """In the yield mode the object collectives (the library's blocking ones) do not poll a core
    while a member is late: the early ranks wait asleep, then the collective finds everyone."""
    ctx = Context(backend="mpi", device=device, wait="yield")
    rank, size = ctx.rank, ctx.world_size
    with check("mpi object collectives wait asleep"):
        burnt = []
        for collective in (lambda: ctx.all_gather_object(rank), lambda: ctx.bcast_object(rank, root=size - 1)):
            ctx.barrier()
            if rank == size - 1:
                time.sleep(LATE)
            start_cpu, start = time.process_time(), time.perf_counter()
            found = collective()
            burnt.append((time.process_time() - start_cpu, time.perf_counter() - start))
            assert found in (list(range(size)), size - 1), found
        if rank != size - 1:
            for cpu, wall in burnt:
                assert wall > LATE / 2 and cpu < 0.25 * wall, f"{cpu:.3f} s of CPU in {wall:.3f} s of waiting"


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    device = "cuda" if "--device=cuda" in sys.argv[1:] else "cpu"
    planes = [arg.split("=", 1)[1] for arg in sys.argv[1:] if arg.startswith("--plane=")] or ["mpi", "torch"]
    mpi, torch_backend = PLANES[device]
    if "mpi" in planes:
        mpi_ctx = Context(backend=mpi, device=device)
        with torch.device(mpi_ctx.device):       # factory functions make tensors on the rank's device
            exercise(mpi_ctx, check)
            staged_path(mpi_ctx, check)
            wait_modes(mpi_ctx, check)
            object_waits(device, check)
    if "torch" in planes:
        torch_ctx = Context(backend=torch_backend, device=device)
        with torch.device(torch_ctx.device):
            exercise(torch_ctx, check)
        torch_ctx.close()


if __name__ == "__main__":
    run_checks(main)
