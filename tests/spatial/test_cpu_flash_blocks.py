"""Ring attention's blocks on CPU by torch's flash kernel for CPU (issue 67): its forward's (output, lse) and a
block's backward share given the WHOLE attention's output and lse agree with the plain matmul path in float32 on
random inputs over several key splits; ``block_kernel`` picks it on CPU for fp16/bf16/fp32 and keeps the plain path
for float64 (whose exactness tests stay those of the matmuls) and where flash SDPA is switched off."""

from __future__ import annotations

import pytest
import torch

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.spatial.tokens.blocks import (
    CPU_FLASH,
    BlockKernel,
    FusedBlocks,
    PlainBlocks,
    SoftmaxMerge,
    backward_operands,
    block_kernel,
    output_delta,
)
from mpi4dl_nb.spatial.tokens.blockwise import blockwise_attention
from mpi4dl_nb.spatial.tokens.ring import Ring, ring_attention

FLOAT32 = 2e-5     # test_ring_attention's float32 tolerance: largest error over the largest magnitude


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max())


def tensors(n_q: int, n_k: int, dim: int, dtype: torch.dtype = torch.float32, seed: int = 0,
            timm_layout: bool = False) -> list[torch.Tensor]:
    """q, k, v, grad (batch 2, 3 heads); ``timm_layout``: q, k, v as views of one (B, N, 3, H, D) projection."""
    generator = torch.Generator().manual_seed(seed)
    if timm_layout:
        assert n_q == n_k
        qkv = torch.randn(2, n_q, 3, 3, dim, generator=generator, dtype=dtype).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
    else:
        q, k, v = (torch.randn(2, 3, n, dim, generator=generator, dtype=dtype) for n in (n_q, n_k, n_k))
    return [q, k, v, torch.randn(2, 3, n_q, dim, generator=generator, dtype=dtype)]


def block_results(kernel: BlockKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
                  split: list[int], scale: float) -> list[torch.Tensor]:
    """What a ring member computes with ``kernel`` over key blocks of ``split`` keys: the merged output and lse,
    then each block's backward from the whole attention's output/lse/delta (dQ summed, dK/dV concatenated)."""
    merge = SoftmaxMerge()
    blocks = list(zip(k.split(split, -2), v.split(split, -2)))
    for k_block, v_block in blocks:
        merge.add(*kernel.forward(q, k_block, v_block, scale))
    merged, lse = merge.result()
    out = merged.to(q.dtype)
    delta = output_delta(grad, out)
    shares = [kernel.backward(grad, q, k_block, v_block, out, lse, delta, scale) for k_block, v_block in blocks]
    dq = torch.stack([share[0] for share in shares]).sum(0)
    return [out, lse, dq, torch.cat([share[1] for share in shares], -2), torch.cat([share[2] for share in shares], -2)]


@pytest.mark.parametrize("n_q,n_k,dim", [(37, 50, 16), (1, 9, 5), (64, 64, 64), (20, 300, 32)])
def test_forward_gives_the_plain_output_and_lse(n_q, n_k, dim):
    """The same lse convention: natural log of the scaled scores' exp-sum, per (batch, head, query)."""
    q, k, v, _ = tensors(n_q, n_k, dim)
    out, lse = FusedBlocks(CPU_FLASH).forward(q, k, v, 0.37)
    plain_out, plain_lse = PlainBlocks().forward(q, k, v, 0.37)
    assert out.shape == plain_out.shape and lse.shape == plain_lse.shape == (2, 3, n_q)
    assert out.dtype == lse.dtype == torch.float32
    assert relative(out, plain_out) <= FLOAT32 and relative(lse, plain_lse) <= FLOAT32


@pytest.mark.parametrize("split", [[48], [24, 24], [1, 47], [13, 13, 13, 9], [40, 8]])
@pytest.mark.parametrize("timm_layout", [False, True], ids=["contiguous", "timm-views"])
def test_block_shares_from_the_whole_attention_match_the_plain_path(split, timm_layout):
    q, k, v, grad = tensors(48, 48, 8, timm_layout=timm_layout, seed=len(split))
    fused = block_results(FusedBlocks(CPU_FLASH), q, k, v, grad, split, 8 ** -0.5)
    plain = block_results(PlainBlocks(), q, k, v, grad, split, 8 ** -0.5)
    exact = block_results(PlainBlocks(), *(t.double() for t in (q, k, v, grad)), [48], 8 ** -0.5)
    for name, a, b, c in zip(("out", "lse", "dq", "dk", "dv"), fused, plain, exact):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        assert relative(a, b) <= FLOAT32, f"{name}: {relative(a, b):.1e} from the plain path"
        assert relative(a, c) <= FLOAT32, f"{name}: {relative(a, c):.1e} from float64"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_blocks_merge_in_float32(dtype):
    q, k, v, grad = (t.to(dtype) for t in tensors(24, 24, 16))
    fused = block_results(FusedBlocks(CPU_FLASH), q, k, v, grad, [10, 14], 0.25)
    exact = block_results(PlainBlocks(), *(t.double() for t in (q, k, v, grad)), [24], 0.25)
    assert fused[1].dtype == torch.float32 and {t.dtype for t in fused[2:]} == {torch.float32}
    for name, a, c in zip(("out", "lse", "dq", "dk", "dv"), fused, exact):
        assert relative(a, c) <= 2e-2, f"{name}: {relative(a, c):.1e} from float64"


def test_block_kernel_picks_the_cpu_flash_kernel_below_float64():
    """On CPU, and on meta (the planner's simulation of a ring member on CPU)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        kernel = block_kernel(torch.zeros(1, 1, 2, 5, dtype=dtype))
        assert isinstance(kernel, FusedBlocks) and kernel.ops is CPU_FLASH, dtype
    assert isinstance(block_kernel(torch.zeros(1, 1, 2, 5, dtype=torch.float64)), PlainBlocks)
    on_meta = block_kernel(torch.empty(1, 1, 2, 5, device="meta"))
    assert isinstance(on_meta, FusedBlocks) and on_meta.ops is CPU_FLASH


def test_flash_sdpa_switched_off_keeps_the_plain_path():
    enabled = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        assert isinstance(block_kernel(torch.zeros(1, 1, 2, 5)), PlainBlocks)
    finally:
        torch.backends.cuda.enable_flash_sdp(enabled)


def test_ring_and_blockwise_attention_in_float32_take_it():
    """A ring of one and blockwise attention (their default kernel: the fused one) against float64 attention."""
    q, k, v, grad = tensors(30, 30, 8)
    exact = [t.double() for t in (q, k, v, grad)]
    ring = Ring(Context(), None, (30,))
    for attend in (lambda *t: ring_attention(*t, ring), lambda *t: blockwise_attention(*t, 7)):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        want_inputs = [t.clone().requires_grad_() for t in exact[:3]]
        out = attend(*inputs)
        want = torch.softmax(want_inputs[0] @ want_inputs[1].transpose(-2, -1) * 8 ** -0.5, -1) @ want_inputs[2]
        got = [out, *torch.autograd.grad(out, inputs, grad)]
        wanted = [want, *torch.autograd.grad(want, want_inputs, exact[3])]
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, wanted):
            assert a.dtype == torch.float32 and relative(a, b) <= FLOAT32, name


@pytest.mark.parametrize("n_q,n_k,batch", [(0, 5, 1), (3, 0, 1), (3, 5, 0)])
def test_empty_blocks_take_the_plain_path(n_q, n_k, batch):
    """torch's CPU flash kernel dies of a floating point exception on some empty inputs: they never reach it."""
    q, k = torch.randn(batch, 2, n_q, 8), torch.randn(batch, 2, n_k, 8)
    kernel = FusedBlocks(CPU_FLASH)
    out, lse = kernel.forward(q, k, k, 0.3)
    assert out.shape == q.shape and lse.shape == q.shape[:-1]
    grads = kernel.backward(torch.zeros_like(q), q, k, k, out, lse, lse, 0.3)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]


def test_the_backward_takes_a_timm_layout_as_it_is_with_the_same_results():
    """``CPU_FLASH.strided``: a timm attention's transposed dO and the kernel's own output layout reach the kernel
    without a copy (``backward_operands``: once per attention, delta left to the kernel) and give the very results
    of contiguous ones; a kernel without that promise gets them contiguous."""
    q, k, v, _ = tensors(12, 12, 8, timm_layout=True)
    grad = torch.randn(2, 12, 3 * 8).view(2, 12, 3, 8).transpose(1, 2)    # (B, N, C) viewed as timm's dO
    kernel = FusedBlocks(CPU_FLASH)
    out, lse = kernel.forward(q, k, v, 0.3)
    assert not grad.is_contiguous() and not out.is_contiguous()
    got_grad, got_out, delta = backward_operands(kernel, grad, out)
    assert got_grad is grad and got_out is out and delta.numel() == 0
    strided = kernel.backward(grad, q, k, v, out, lse, delta, 0.3)
    contiguous = kernel.backward(grad.contiguous(), q, k, v, out.contiguous(), lse, delta, 0.3)
    assert all(torch.equal(a, b) for a, b in zip(strided, contiguous))
    plain_grad, _, plain_delta = backward_operands(PlainBlocks(), grad, out)
    assert plain_grad.is_contiguous() and torch.equal(plain_delta, output_delta(grad, out))
