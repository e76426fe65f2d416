"""Row (d), staged MPI: bandwidth of the mpi plane's staged path (device -> pinned pool -> MPI -> device, ranks 0
and 1, one-way time = ping-pong round trip / 2) against a plain pinned ``copy_`` device -> host of the same bytes."""

from __future__ import annotations

import torch
from mpi4py import MPI

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.comm.handles import Transfer
from mpi4dl_nb.comm.mpi_plane import MpiPlane

from ..timing import median_of
from ..world import require_world
from .arguments import int_list, noted, row_parser
from .device_timing import median_seconds
from .report import report

TAG = 11
MB = 2 ** 20


def ping_pong(plane: MpiPlane, ctx: Context, buffer: torch.Tensor, repeats: int) -> float:
    """Median one-way seconds of ``buffer`` between ranks 0 and 1 through ``plane``, each leg on the device."""
    peer = 1 - ctx.rank
    legs = [Transfer.to(buffer, peer, TAG), Transfer.into(buffer, peer, TAG)]

    def round_trip() -> None:
        for leg in (legs if ctx.rank == 0 else legs[::-1]):
            plane.exchange([leg], None).wait()
            if buffer.device.type == "cuda":
                torch.cuda.synchronize(buffer.device)
    round_trip()
    return median_of(round_trip, repeats, ctx) / 2


def pinned_copy(buffer: torch.Tensor, repeats: int) -> float:
    """Median seconds of one ``copy_`` of ``buffer`` into a pinned host tensor (page-locked where CUDA is)."""
    host = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=torch.cuda.is_available())
    return median_seconds(lambda: host.copy_(buffer, non_blocking=True), buffer.device, repeats)


def main() -> None:
    parser = row_parser(__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int_list, required=True)
    args = parser.parse_args()
    ctx = Context(backend="mpi", device=args.device)
    require_world(ctx, 2, "staged MPI")
    plane = MpiPlane(MPI.COMM_WORLD, ctx.device, staging=True)   # staged, also on CPU and with CUDA-aware MPI
    cells = []
    for megabytes in args.megabytes:
        buffer = torch.ones(megabytes * MB // 4, device=ctx.device)
        staged = ping_pong(plane, ctx, buffer, args.repeats)
        copied = pinned_copy(buffer, args.repeats) if ctx.rank == 0 else 0.0
        ctx.barrier()
        nbytes = megabytes * MB
        if ctx.rank == 0:
            print(f"{megabytes} MB: staged {1e3 * staged:.3f} ms one way, copy {1e3 * copied:.3f} ms", flush=True)
        cells.append(f"{megabytes} MB {nbytes / staged / 1e9:.1f} / {nbytes / max(copied, 1e-12) / 1e9:.1f} GB/s "
                     f"({copied / staged:.2f})")
    if ctx.rank == 0:
        report(True, noted(args.note, f"staged one-way / pinned copy_ GB/s (ratio of bandwidths): {'; '.join(cells)}"))


if __name__ == "__main__":
    main()
