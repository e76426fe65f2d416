"""Row (a), ring blocks: ring attention's block kernels (the fused kernel returning the log-sum-exp, keys taken a
ring member's block at a time with the running merge) against one fused ``scaled_dot_product_attention`` over the
same tokens: forward + backward time, median, as a ratio; outputs compared."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from mpi4dl_nb.spatial.tokens.blocks import FusedBlocks, block_kernel
from mpi4dl_nb.spatial.tokens.blockwise import blockwise_attention

from .arguments import int_list, noted, row_parser
from .device_timing import median_seconds
from .report import report

HEAD_DIM = 64
RING_MEMBERS = 4            # keys in blocks of tokens / 4: a 4-member ring's blocks
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-3}
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def ring_blocks(tokens: int) -> Attend:
    """Attention with the keys in ``RING_MEMBERS`` blocks through the package's block kernel and merge."""
    return lambda q, k, v: blockwise_attention(q, k, v, block=tokens // RING_MEMBERS)


def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


def forward_backward(attend: Attend, inputs: list[torch.Tensor], grad: torch.Tensor) -> torch.Tensor:
    """One forward and backward; returns the output."""
    q, k, v = (t.detach().requires_grad_() for t in inputs)
    out = attend(q, k, v)
    torch.autograd.grad(out, (q, k, v), grad)
    return out.detach()


def kernel_name(q: torch.Tensor) -> str:
    kernel = block_kernel(q)
    return kernel.ops.name if isinstance(kernel, FusedBlocks) else "plain matmuls"


def measure(tokens: int, heads: int, dtype: torch.dtype, device: torch.device, repeats: int) -> tuple[float, bool]:
    """(blocks' seconds / fused seconds, whether the outputs agree within the dtype's tolerance)."""
    generator = torch.Generator(device=device).manual_seed(tokens)
    shape = (1, heads, tokens, HEAD_DIM)
    inputs = [torch.randn(shape, generator=generator, device=device, dtype=dtype) for _ in range(3)]
    grad = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    variants: tuple[Attend, Attend] = (ring_blocks(tokens), fused)
    outputs = [forward_backward(attend, inputs, grad) for attend in variants]
    difference = float((outputs[0].float() - outputs[1].float()).abs().max() / outputs[1].float().abs().max())
    seconds = [median_seconds(partial(forward_backward, attend, inputs, grad), device, repeats) for attend in variants]
    print(f"{dtype} {tokens} tokens: blocks {1e3 * seconds[0]:.2f} ms, fused {1e3 * seconds[1]:.2f} ms, "
          f"relative difference {difference:.1e}", flush=True)
    return seconds[0] / seconds[1], difference <= TOLERANCE[dtype]


def main() -> None:
    parser = row_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int_list, required=True)
    parser.add_argument("--heads", type=int, required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    cells, agree = [], True
    for dtype in (torch.bfloat16, torch.float32):
        ratios = []
        for tokens in args.tokens:
            ratio, close = measure(tokens, args.heads, dtype, device, args.repeats)
            ratios.append(f"{tokens}: {ratio:.2f}x")
            agree = agree and close
        cells.append(f"{str(dtype).removeprefix('torch.')} {', '.join(ratios)}")
    probe = torch.empty(1, 1, 1, HEAD_DIM, device=device, dtype=torch.float32)
    report(agree, noted(args.note, f"time blocks/fused, fwd+bwd, {args.heads} heads x {HEAD_DIM}, keys in "
                                   f"{RING_MEMBERS} blocks ({kernel_name(probe)}): {'; '.join(cells)}; outputs "
                                   f"{'agree' if agree else 'DIFFER'}"))


if __name__ == "__main__":
    main()
