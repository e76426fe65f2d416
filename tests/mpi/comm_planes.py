"""Both data planes: send/recv, isend/irecv, all_reduce, broadcast, groups, on any rank count."""

from __future__ import annotations

import torch

from mpi4dl_nb.comm.context import Context
from tests.support.checks import Checks, run_checks

BACKENDS = ("mpi", "gloo")
CHECKS = ("send/recv", "irecv two tags", "all_reduce world", "all_reduce group", "broadcast",
          "group broadcast", "1 MiB float32 message", "int64 all_reduce", "all_gather_object")


def check_names() -> list[str]:
    """Every check this program reports, on any rank count."""
    return [f"{backend} {what}" for backend in BACKENDS for what in CHECKS]


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

    # non-blocking both ways at once, two tags in flight between the same pair
    with check(f"{name} irecv two tags"):
        a = torch.full((3, 5), float(rank), dtype=dtype)
        b = torch.full((7,), float(rank) + 0.5, dtype=dtype)
        ra, rb = torch.empty(3, 5, dtype=dtype), torch.empty(7, dtype=dtype)
        reqs = [ctx.irecv(ra, left, tag=2), ctx.irecv(rb, left, tag=3),
                ctx.isend(b, right, tag=3), ctx.isend(a, right, tag=2)]
        ctx.wait_all(reqs)
        assert torch.equal(ra, torch.full((3, 5), float(left), dtype=dtype)), f"{name} irecv tag 2"
        assert torch.equal(rb, torch.full((7,), float(left) + 0.5, dtype=dtype)), f"{name} irecv tag 3"

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
        big = torch.randn(1 << 18, generator=torch.Generator().manual_seed(rank)).float()
        recv_big = torch.empty_like(big)
        ctx.wait_all([ctx.irecv(recv_big, left, tag=4), ctx.isend(big, right, tag=4)])
        expect = torch.randn(1 << 18, generator=torch.Generator().manual_seed(left)).float()
        assert torch.equal(recv_big, expect), f"{name} 1 MiB float32 message"
    with check(f"{name} int64 all_reduce"):
        ints = torch.tensor([rank], dtype=torch.int64)
        ctx.all_reduce(ints)
        assert ints.item() == size * (size - 1) // 2, f"{name} int64 all_reduce"
    with check(f"{name} all_gather_object"):
        ctx.barrier()
        assert ctx.all_gather_object(rank) == list(range(size))


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    mpi_ctx = Context(backend="mpi")
    exercise(mpi_ctx, check)
    gloo_ctx = Context(backend="gloo")
    exercise(gloo_ctx, check)
    gloo_ctx.close()


if __name__ == "__main__":
    run_checks(main)
