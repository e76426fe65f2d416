"""ViT-S/16 on token tiles, side by side: activation bytes per rank on P = 1, 2, 4; ring attention against
all-gathered keys/values (bytes sent, time per layer); torch's context parallel on the same attention job.

    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/bench_vit.py --sizes 1024
    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/bench_vit.py --sizes 1024,2048 --rounds 3,1

Memory: ``--depth`` timm ViT-S/16 blocks (``timm.models.vision_transformer.Block``: width 384, 6 heads, MLP 4x,
float32) on each rank's tokens of a 2x2 (P = 4) or 1x2 (P = 2) tile grid of an image of each size, rank 0 also
holding the class token; each block's attention takes its q/k/v through ``ring_attention`` over the P ranks
(everything else in a block acts per token, as on tiles). P = 1: one process, the same blocks on all tokens with
``blockwise_attention`` (blocks of N/4 keys). Activation bytes: what autograd saves for backward plus the output
(each storage once, ``support/memory.py``), per block; the largest rank's, and its share of one process's.
Ring against all-gathered (``bench_ring_attention.py``'s baseline) runs one attention layer of each size's job on
the world's ranks (bytes sent and time, ``--rounds`` per size); the bytes of P = 2 and 4 from ``ring_traffic``.
torch's context parallel (``torch.distributed.tensor.experimental.context_parallel``, gloo, float32) runs one
attention layer of ``--cp-tokens`` tokens as torchtitan calls it; each stage's outcome (its forward's error against
the unsharded layer, what its backward raised, or where it stood after ``--cp-timeout`` s) is printed.
"""

from __future__ import annotations

import argparse
import faulthandler
import io
import signal
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial

import torch
from bench_ring_attention import all_gathered, layer, sent_bytes
from support.machine import Footer
from support.memory import SavedBytes
from support.tables import Table
from support.timing import in_turns
from support.world import require_world
from torch import nn

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.planner.attention import TokenGrid
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.tokens.blockwise import blockwise_attention
from mpi4dl_nb.spatial.tokens.ring import Ring, ring_attention
from mpi4dl_nb.spatial.tokens.ring_steps import ring_traffic

WIDTH, HEADS, PATCH = 384, 6, 16


class TokenAttention(nn.Module):
    """timm's ``Attention`` of a block (its ``num_heads``) with its q/k/v attended by ``attend`` (ring or
    blockwise)."""

    def __init__(self, attn: nn.Module, attend) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.attn, self.attend = attn, attend

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        a = self.attn
        batch, tokens, _ = x.shape
        heads = int(vars(a).get("num_heads", HEADS))
        q, k, v = a.qkv(x).reshape(batch, tokens, 3, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        out = self.attend(a.q_norm(q), a.k_norm(k), v)
        return a.proj(a.norm(out.transpose(1, 2).reshape(batch, tokens, -1)))


def blocks(depth: int, attend) -> nn.Sequential:  # type: ignore[no-untyped-def]
    from timm.models.vision_transformer import Block

    torch.manual_seed(0)
    made = [Block(WIDTH, HEADS, mlp_ratio=4.0, qkv_bias=True) for _ in range(depth)]
    for block in made:
        block.attn = TokenAttention(block.attn, attend)
    return nn.Sequential(*made)


def activation_bytes(model: nn.Module, x: torch.Tensor, output: bool = True) -> int:
    """Bytes ``model(x)`` saves for backward plus its output (unless not ``output``), each storage once, the weights
    left out."""
    counter = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        out = model(x)
    if output:
        counter.add(out)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(size for pointer, size in counter.storages.items() if pointer not in weights)


def ring_of(ctx: Context, parts: int, tokens: TokenGrid) -> tuple[Ring | None, int]:
    """The ring of the first ``parts`` ranks on a 1 x parts / 2 x 2 grid, and this rank's tokens (0: not in it)."""
    grid = TileGrid(2, 2) if parts == 4 else TileGrid(1, parts)
    counts = tokens.member_tokens(grid)
    group = ctx.new_group(range(parts)) if parts < ctx.world_size else None
    if ctx.rank >= parts:
        return None, 0
    return Ring(ctx, group, counts), counts[ctx.rank]


def memory_rows(ctx: Context, size: int, depth: int) -> list[tuple[int, int, float]]:
    """(P, largest rank's activation bytes per block, share of one process) for P = 1, 2, 4."""
    tokens = TokenGrid(size // PATCH, size // PATCH, prefix=1)
    rows = []
    for parts in (1, 2, 4):
        mine = 0
        if parts == 1:
            if ctx.rank == 0:
                model = blocks(depth, lambda q, k, v: blockwise_attention(q, k, v, block=tokens.total // 4))
                mine = activation_bytes(model, torch.randn(1, tokens.total, WIDTH, requires_grad=True))
        else:
            ring, count = ring_of(ctx, parts, tokens)
            if ring is not None:
                model = blocks(depth, lambda q, k, v, r=ring: ring_attention(q, k, v, r))
                mine = activation_bytes(model, torch.randn(1, count, WIDTH, requires_grad=True))
        ctx.barrier()
        largest = max(ctx.all_gather_object(mine)) // depth
        rows.append((parts, largest, largest / rows[0][1] if rows else 1.0))
    return rows


def attention_rows(ctx: Context, size: int, rounds: int, compare: bool) -> tuple[list[list[str]], float]:
    """Ring against all-gathered keys/values (``compare``; else the ring alone, its bytes from the timed warm-up
    and no agreement check): one attention layer of the ``size`` job on the world's ranks."""
    per_rank = (size // PATCH) ** 2 // ctx.world_size
    ring = Ring(ctx, None, (per_rank,) * ctx.world_size)
    generator = torch.Generator().manual_seed(ctx.rank)
    shape = (1, HEADS, per_rank, WIDTH // HEADS)
    inputs = [torch.randn(shape, generator=generator) for _ in range(3)]
    grad = torch.randn(shape, generator=generator)
    variants = {"ring attention": ring_attention, **({"all-gathered keys/values": all_gathered} if compare else {})}
    worst = float("nan")
    if compare:
        results = {name: layer(attend, inputs, ring, grad) for name, attend in variants.items()}
        worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(*results.values()))
    runs = {name: partial(layer, attend, inputs, ring, grad) for name, attend in variants.items()}
    sent = {name: sent_bytes(ctx, run) for name, run in runs.items()}        # also the warm-up
    seconds = in_turns(ctx, dict(runs), rounds)
    held = {"ring attention": per_rank, "all-gathered keys/values": ring.total_keys}
    return [[name, f"{sent[name][0]:,} B", f"{sent[name][1]:,} B", f"{2 * held[name]:,}",
             f"{1e3 * max(ctx.all_gather_object(seconds[name])):.0f}"] for name in variants], worst


def torch_context_parallel(ctx: Context, tokens: int, timeout: int) -> list[str]:
    """torch's context parallel on an attention layer of ``tokens`` tokens (gloo, float32), called as torchtitan
    calls it: the layer's input (no grad) is the buffer sharded along the sequence (``no_restore_buffers``: not
    put back), q/k/v come from a Linear (with grad) inside the context, load balancing off (non-causal). Each
    stage's outcome: the forward against the unsharded layer's rows of this rank, then the backward."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options

    torch.manual_seed(0)
    qkv = nn.Linear(WIDTH, 3 * WIDTH)
    x = torch.randn(1, tokens, WIDTH)

    def attend(inputs: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv(inputs).reshape(1, -1, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v)

    with torch.no_grad():
        whole = attend(x)
    rows = slice(ctx.rank * tokens // ctx.world_size, (ctx.rank + 1) * tokens // ctx.world_size)
    _cp_options.enable_load_balance = False        # its head-tail balancer is for causal attention
    signal.signal(signal.SIGALRM, _expired(timeout))
    signal.alarm(timeout)
    said, start = [], time.perf_counter()
    try:
        mesh = init_device_mesh("cpu", (ctx.world_size,))
        shard = x.clone()
        with context_parallel(mesh, buffers=[shard], buffer_seq_dims=[1], no_restore_buffers={shard}):
            out = attend(shard)
            error = float((out.detach() - whole[:, :, rows]).abs().max() / whole.abs().max())
            said.append(f"forward ran ({time.perf_counter() - start:.0f} s): output {tuple(out.shape)}, "
                        f"{type(out).__name__}, relative error {error:.1e} against the unsharded rows")
            out.sum().backward()
        said.append(f"backward ran ({time.perf_counter() - start:.0f} s)")
    except Exception as error:   # reported, not raised: the benchmark says why CP does not run here
        frames = traceback.extract_tb(error.__traceback__)
        where = " <- ".join(f"{f.name} ({f.filename.split('/')[-1]}:{f.lineno})" for f in reversed(frames[-2:]))
        said.append(f"{'backward' if said else 'forward'} raised after {time.perf_counter() - start:.0f} s: "
                    f"{type(error).__name__}: {str(error).splitlines()[0][:300]} (in {where})")
    finally:
        signal.alarm(0)
    return said


def _expired(timeout: int) -> Callable[[int, object], None]:
    def expired(signum: int, frame: object) -> None:
        stack = io.StringIO()
        traceback.print_stack(frame, file=stack)   # type: ignore[arg-type]
        where = [line.strip() for line in stack.getvalue().splitlines() if line.strip().startswith("File")]
        raise TimeoutError(f"no result after {timeout} s; it stood in " + " <- ".join(
            w.split("/")[-1] for w in reversed(where[-3:])))
    return expired


def traffic_rows(size: int) -> list[list[str]]:
    """Bytes rank 0 sends per attention layer on P = 2 and 4 (``ring_traffic``: what the trace counts), batch 1."""
    tokens = TokenGrid(size // PATCH, size // PATCH, prefix=1)
    rows = []
    for parts in (2, 4):
        counts = tokens.member_tokens(TileGrid(2, 2) if parts == 4 else TileGrid(1, parts))
        sent = ring_traffic(counts, 0, WIDTH * 4)      # heads x head size, float32
        rows.append([f"{size}²", str(parts), f"{sent.forward:,} B", f"{sent.backward:,} B"])
    return rows


def print_memory(memory: dict[int, list[tuple[int, int, float]]], depth: int) -> None:
    print(f"ViT-S/16 blocks (width {WIDTH}, {HEADS} heads), float32; activation bytes per block on the largest rank "
          f"(saved for backward + output; {depth} block(s) measured)")
    table = Table(["image", ">tokens", ">P", ">MB per block (largest rank)", ">share of one process", ">1.15/P"])
    for size, rows in memory.items():
        for parts, largest, share in rows:
            table.add(f"{size}²", f"{(size // PATCH) ** 2 + 1:,}", str(parts), f"{largest / 2**20:.1f}",
                      f"{share:.3f}", f"{1.15 / parts:.3f}")
    print(table.markdown())


def print_attention(size: int, world: int, rows: list[list[str]], worst: float) -> None:
    print(f"\none attention layer at {size}² on {world} ranks ({(size // PATCH) ** 2:,} tokens), float32; outputs "
          f"and gradients agree within {worst:.1e}")
    table = Table(["variant", ">sent forward (rank 0)", ">sent backward (rank 0)", ">keys+values held (tokens)",
                   ">ms fwd+bwd (slowest rank, median)"])
    for row in rows:
        table.add(*row)
    print(table.markdown())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024", help="image sizes (px), comma-separated")
    parser.add_argument("--depth", type=int, default=1, help="blocks measured (activation bytes are per block)")
    parser.add_argument("--rounds", default="3", help="timed rounds per size, comma-separated (one for all)")
    parser.add_argument("--cp-tokens", type=int, default=256, help="tokens of torch's context-parallel layer")
    parser.add_argument("--cp-timeout", type=int, default=600)
    args = parser.parse_args()
    footer = Footer()
    torch.set_num_threads(1)
    ctx = Context(backend="gloo")
    require_world(ctx, 4, "bench_vit")
    sizes = [int(s) for s in args.sizes.split(",")]
    rounds = [int(r) for r in args.rounds.split(",")]
    memory = {size: memory_rows(ctx, size, args.depth) for size in sizes}
    if ctx.rank == 0:                       # each part printed once measured (a long run keeps what it has)
        print_memory(memory, args.depth)
        table = Table(["image", ">P", ">ring sends forward (rank 0)", ">backward (rank 0)"])
        for size in sizes:
            for row in traffic_rows(size):
                table.add(*row)
        print("\nbytes per attention layer (ring_traffic, batch 1, float32):\n" + table.markdown(), flush=True)
    for i, size in enumerate(sizes):
        rows, worst = attention_rows(ctx, size, rounds[min(i, len(rounds) - 1)], compare=i == 0)
        if ctx.rank == 0:
            print_attention(size, ctx.world_size, rows, worst)
            sys.stdout.flush()
    cp = torch_context_parallel(ctx, args.cp_tokens, args.cp_timeout)
    if ctx.rank == 0:
        print(f"\ntorch context parallel, one attention layer of {args.cp_tokens} tokens (gloo, float32, non-causal, "
              f"load balancing off):\n" + "\n".join(f"- {line}" for line in cp))
        footer.print()


if __name__ == "__main__":
    faulthandler.enable()
    main()
