"""Ring attention (issue 52): across 1..4 ranks on both planes equal to one process's ``softmax(q k^T) v`` on the
concatenated keys, outputs and dQ/dK/dV within 1e-12 (tests/mpi/ring_attention_checks.py, one 4-rank job in the
shared launch of each plane, ~1 s of compute per rank after start-up); one process: blockwise attention equals
plain attention and never makes an n x n tensor, a ring of one rank, gradcheck, and the refusals."""

from __future__ import annotations

import pytest
import torch

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.comm.handles import Group
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.spatial.tokens.blocks import CPU_FLASH, CUDA_EFFICIENT, FusedBlocks, PlainBlocks, block_kernel
from mpi4dl_nb.spatial.tokens.blockwise import blockwise_attention
from mpi4dl_nb.spatial.tokens.ring import Ring, ring_attention
from tests.mpi.ring_attention_checks import check_names
from tests.support.allocations import Allocations
from tests.support.battery import shared_job

MPI_PLANE = shared_job(4, "ring_attention_checks", plane="mpi", timeout=200)
TORCH_PLANE = shared_job(4, "ring_attention_checks", "--backend=gloo", plane="gloo", timeout=200)


@pytest.mark.parametrize("job", [MPI_PLANE, TORCH_PLANE], ids=["mpi", "gloo"])
def test_ring_attention_across_ranks_equals_one_process(shared_launch, job):
    shared_launch(job).require(check_names())


@pytest.fixture(scope="module")
def ctx():
    return Context()


def tensors(n_q, n_k, dtype=torch.float64, seed=0, batch=2, heads=3, dim=5):
    generator = torch.Generator().manual_seed(seed)
    sizes = ((batch, heads, n_q, dim), (batch, heads, n_k, dim), (batch, heads, n_k, dim), (batch, heads, n_q, dim))
    return [torch.randn(s, generator=generator, dtype=dtype) for s in sizes]


def with_grads(attend, q, k, v, grad):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), grad)]


def plain(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, -1) @ v


def assert_all_close(got, want, rtol):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        error = float((a.double() - b.double()).abs().max() / b.double().abs().max())
        assert error <= rtol, f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("block", [1, 4, 13, 50])
@pytest.mark.parametrize("kernel", [PlainBlocks, lambda: FusedBlocks(CPU_FLASH)], ids=["plain", "cpu-flash"])
def test_blockwise_equals_plain_attention(block, kernel):
    q, k, v, grad = tensors(9, 13)
    got = with_grads(lambda *t: blockwise_attention(*t, block, kernel=kernel()), q, k, v, grad)
    assert_all_close(got, with_grads(plain, q, k, v, grad), 1e-12)


def test_blockwise_float32_within_float32_tolerance():
    q, k, v, grad = tensors(7, 20, dtype=torch.float32)
    got = with_grads(lambda *t: blockwise_attention(*t, 6), q, k, v, grad)
    want = with_grads(plain, *(t.double() for t in (q, k, v, grad)))
    assert_all_close(got, want, 2e-5)


def test_blockwise_never_makes_an_n_by_n_tensor():
    """Forward and backward; plain attention on the same tensors does make one (the recorder sees it)."""
    q, k, v, grad = tensors(64, 64, batch=1, heads=1, dim=4)
    with Allocations() as blockwise:
        with_grads(lambda *t: blockwise_attention(*t, 8), q, k, v, grad)
    with Allocations() as whole:
        with_grads(plain, q, k, v, grad)
    assert blockwise.largest <= 64 * 8 < whole.largest == 64 * 64


def test_a_ring_of_one_is_attention(ctx):
    q, k, v, grad = tensors(6, 11)
    ring = Ring(ctx, None, (11,))
    got = with_grads(lambda *t: ring_attention(*t, ring, scale=0.3), q, k, v, grad)
    want = with_grads(lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) * 0.3, -1) @ v, q, k, v, grad)
    assert_all_close(got, want, 1e-12)


def test_gradcheck(ctx):
    q, k, v, _ = tensors(3, 4, batch=1, heads=2, dim=3)
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda *t: blockwise_attention(*t, 3), inputs)
    assert torch.autograd.gradcheck(lambda *t: ring_attention(*t, Ring(ctx, None, (4,))), inputs)


def test_the_plain_path_on_cpu():
    assert isinstance(block_kernel(torch.zeros(1, 1, 1, 1, dtype=torch.float64)), PlainBlocks)


@pytest.mark.parametrize("shapes,knob,shown", [
    (((2, 3, 4, 5), (2, 3, 6, 5), (2, 3, 7, 5)), "attention inputs", "same shape"),
    (((2, 3, 4, 5), (2, 2, 6, 5), (2, 2, 6, 5)), "attention inputs", "batch, heads and head_dim"),
    (((3, 4, 5), (2, 3, 6, 5), (2, 3, 6, 5)), "attention inputs", "batch, heads, tokens, head_dim"),
    (((2, 3, 4, 5), (2, 3, 5, 5), (2, 3, 5, 5)), "ring.key_counts", "holds 5 keys, key_counts says 6"),
])
def test_inputs_that_do_not_fit_are_refused(ctx, shapes, knob, shown):
    q, k, v = (torch.zeros(s, dtype=torch.float64) for s in shapes)
    with pytest.raises(ConfigError, match=shown) as error:
        ring_attention(q, k, v, Ring(ctx, None, (6,)))
    assert error.value.knob == knob


def test_counts_for_another_ring_and_small_blocks_are_refused(ctx):
    q = torch.zeros(1, 1, 2, 4)
    with pytest.raises(ConfigError, match="2 counts for a ring of 1"):
        ring_attention(q, q, q, Ring(ctx, None, (2, 2)))
    with pytest.raises(ConfigError, match="at least one key per block"):
        blockwise_attention(q, q, q, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_cuda_kernel_call_pattern_on_meta_tensors(ctx, dtype):
    """The memory-efficient CUDA kernel's forward and backward called as on a GPU (meta tensors check the
    arguments and shapes: its lse comes padded to a multiple of 32 queries and goes back so)."""
    q, k, v = (torch.empty(2, 3, n, 64, device="meta", dtype=dtype, requires_grad=True) for n in (37, 50, 50))
    grad = torch.empty(2, 3, 37, 64, device="meta", dtype=dtype)
    kernel = FusedBlocks(CUDA_EFFICIENT)
    for attend in (lambda: ring_attention(q, k, v, Ring(ctx, None, (50,)), kernel=kernel),
                   lambda: blockwise_attention(q, k, v, 20, kernel=kernel)):
        out = attend()
        assert kernel.lse_length == 64 and out.shape == q.shape and out.dtype == dtype
        grads = torch.autograd.grad(out, (q, k, v), grad)
        assert [(g.shape, g.dtype) for g in grads] == [(t.shape, dtype) for t in (q, k, v)]


def test_a_rank_outside_the_ring_is_refused(ctx):
    q = torch.zeros(1, 1, 2, 4)
    with pytest.raises(ConfigError, match="is not in the ring"):
        ring_attention(q, q, q, Ring(ctx, Group((5,)), (2,)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_merges_in_float32(ctx, dtype):
    """bf16/fp16 in, the same dtype out; the merge in float32 keeps the result within the inputs' rounding of the
    float64 attention of the same (rounded) inputs."""
    q, k, v, grad = (t.to(dtype) for t in tensors(5, 12))
    got = with_grads(lambda *t: blockwise_attention(*t, 4), q, k, v, grad)
    assert {g.dtype for g in got} == {dtype}
    assert_all_close(got, with_grads(plain, *(t.double() for t in (q, k, v, grad))), 2e-2)
    kernel = PlainBlocks()
    assert kernel.forward(q, k, v, 0.5)[1].dtype == torch.float32
