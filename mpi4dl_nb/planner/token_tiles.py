"""A ViT's layers on token tiles for the planner: the image's token grid, the attention modules of a layer and
what their rings add on a rank (bytes in flight, messages) to the layer run on the rank's tokens alone; in one
process on CPU, attention simulated as torch's flash kernel for CPU runs it."""

from __future__ import annotations

import copy
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..spatial.ops import TorchOp, argument
from ..spatial.tokens.blocks import Grads, block_kernel
from ..spatial.tokens.blockwise import blockwise_attention
from ..spatial.tokens.ring import Ring, ring_attention
from .attention import RingCost, TokenGrid, ring_cost
from .clock import work_clock
from .fake_world import FakeComm, Traffic

Shape = tuple[int, ...]


@dataclass(frozen=True)
class AttentionWidth:
    """One attention module: its heads and width (heads x head size)."""

    heads: int
    dim: int


def attention_widths(layer: nn.Module) -> list[AttentionWidth]:
    """The attention modules of ``layer`` (timm's ``Attention`` family: ``num_heads`` and a ``qkv`` projection or
    ``head_dim``; ``nn.MultiheadAttention``), each with its heads and width."""
    found = []
    for module in layer.modules():
        if isinstance(module, nn.MultiheadAttention):
            found.append(AttentionWidth(module.num_heads, module.embed_dim))
            continue
        heads, head_dim = getattr(module, "num_heads", None), getattr(module, "head_dim", None)
        qkv = getattr(module, "qkv", None)
        if isinstance(heads, int) and isinstance(head_dim, int):
            found.append(AttentionWidth(heads, heads * head_dim))
        elif isinstance(heads, int) and isinstance(qkv, nn.Linear):
            found.append(AttentionWidth(heads, qkv.out_features // 3))
    return found


def token_grid_of(maps: frozenset[tuple[int, int]], tokens: int) -> TokenGrid | None:
    """The token grid of a patch embedding that makes ``tokens`` tokens, among the (H, W) ``maps`` it computes
    (the largest grid of at most ``tokens`` cells; the rest are class/register tokens); None if none fits."""
    fitting = [(h * w, h, w) for h, w in maps if 0 < h * w <= tokens]
    if not fitting:
        return None
    cells, rows, cols = max(fitting)
    return TokenGrid(rows, cols, tokens - cells)


def token_shapes(shapes: Sequence[Shape], total: int, count: int) -> list[Shape]:
    """``shapes`` with the token axis (dim 1 of an (N, T, C) tensor of all ``total`` tokens) cut to ``count``."""
    return [(s[0], count, *s[2:]) if len(s) == 3 and s[1] == total else tuple(s) for s in shapes]


@dataclass(frozen=True)
class RingTerms:
    """What a layer's rings add on one rank: bytes in flight during its forward and backward, and the
    messages each sends."""

    forward_bytes: int
    backward_bytes: int
    forward_traffic: Traffic
    backward_traffic: Traffic


def ring_terms(widths: Sequence[AttentionWidth], tokens: Sequence[int], member: int, samples: int,
               element_bytes: int) -> RingTerms:
    """``RingTerms`` of attention modules ``widths`` for ring member ``member`` of a ring holding ``tokens``, a
    chunk of ``samples`` (the modules run one after another: the largest block in flight counts)."""
    costs: list[RingCost] = [ring_cost(tokens, member, w.dim, w.heads, element_bytes) for w in widths]
    if not costs:
        return RingTerms(0, 0, Traffic(), Traffic())
    forward = Traffic(messages=sum(c.messages_forward for c in costs),
                      message_bytes=samples * sum(c.sent_forward for c in costs),
                      exchanges=sum(c.messages_forward for c in costs))
    backward = Traffic(messages=sum(c.messages_backward for c in costs),
                       message_bytes=samples * sum(c.sent_backward for c in costs),
                       exchanges=sum(c.messages_backward for c in costs))
    return RingTerms(samples * max(c.in_flight_forward for c in costs),
                     samples * max(c.in_flight_backward for c in costs), forward, backward)


class TimedBlocks:
    """The engine's block kernel for the queries (``tokens.blocks.block_kernel``: fp16/bf16/fp32 the fused kernel of
    CUDA or CPU, float64 the plain matmul path), the seconds of each block's forward and backward kept (a ring
    step's compute, which hides the next message)."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {"forward": [], "backward": []}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        start = self._now(q)
        found = block_kernel(q).forward(q, k, v, scale)
        self.seconds["forward"].append(self._now(q) - start)
        return found

    def backward(self, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, delta: torch.Tensor, scale: float) -> Grads:
        start = self._now(q)
        found = block_kernel(q).backward(grad, q, k, v, out, lse, delta, scale)
        self.seconds["backward"].append(self._now(q) - start)
        return found

    @staticmethod
    def _now(like: torch.Tensor) -> float:
        return work_clock(like.device)

    def per_block(self) -> tuple[float, float]:
        """Mean seconds of one block's (forward, backward) since the last call, then forgotten."""
        means = tuple(sum(found) / len(found) if found else 0.0 for found in self.seconds.values())
        for found in self.seconds.values():
            found.clear()
        return means[0], means[1]


class _RingOfOne(TorchFunctionMode):
    """``scaled_dot_product_attention`` as a ring member runs it (``tokens.ring``: every block of the
    ring, merged; the backward's gradient accumulators passed on) over a ``FakeComm`` (nothing delivered: the
    arriving blocks are zeros), so the member's compute is the engine's and the wire is left out."""

    def __init__(self, ring: Ring, kernel: TimedBlocks) -> None:
        super().__init__()
        self.ring, self.kernel = ring, kernel

    def __torch_function__(self, func: TorchOp, types: Collection[type], args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = (argument(args, kwargs, i, name) for i, name in enumerate(("query", "key", "value")))
        scale = argument(args, kwargs, 6, "scale")
        assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
        return ring_attention(q, k, v, self.ring, scale=scale if isinstance(scale, float) else None,
                              kernel=self.kernel)


class RingMember(nn.Module):
    """A layer on one ring member's tokens as the engine runs it there, to be timed: its attention modules take
    the fused path (as ``tokens.attention`` sets them) and their ``scaled_dot_product_attention`` is ring
    attention over ``members`` (``_RingOfOne``); ``kernel`` keeps each block's seconds."""

    def __init__(self, layer: nn.Module, members: Sequence[int], member: int) -> None:
        super().__init__()
        self.layer = copy.deepcopy(layer)
        for module in self.layer.modules():
            if hasattr(module, "fused_attn"):
                setattr(module, "fused_attn", True)   # noqa: B010 (an attribute of timm's, not a submodule)
        reference = next(iter(self.layer.parameters()), None)
        device = reference.device if reference is not None else torch.device("cpu")
        comm = FakeComm(member, None, device, world_size=len(members))
        self.ring = Ring(comm, None, tuple(members), name="timed")
        self.kernel = TimedBlocks()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _RingOfOne(self.ring, self.kernel):
            out: torch.Tensor = self.layer(x)
        return out


def member_work(layer: nn.Module, shapes: Sequence[Shape], tokens: TokenGrid, members: Sequence[int],
                member: int) -> tuple[nn.Module, list[Shape], float]:
    """What a timer runs for ``member`` of a ring holding ``members`` tokens: (module, its input shapes, the
    share of the measured time that is the member's). A layer on tokens runs on the member's tokens with its
    attention spanning the ring (``RingMember``); the patch embedding (images in) runs on the whole image, its
    time shared by tokens."""
    if any(len(s) == 4 for s in shapes):
        return layer, list(shapes), members[member] / tokens.total
    cut = token_shapes(shapes, tokens.total, members[member])
    if not attention_widths(layer):
        return layer, cut, 1.0
    return RingMember(layer, members, member), cut, 1.0


class RingKernels(nn.Module):
    """A timm ``Attention`` computing as a ring member does (``spatial/tokens/blockwise.py``'s kernels and merge: it
    saves queries, keys, values, output and log-sum-exp, never the weights), for the memory simulation."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        a = self.attn
        heads = int(vars(a)["num_heads"])
        batch, tokens, width = x.shape
        q, k, v = a.get_submodule("qkv")(x).reshape(batch, tokens, 3, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = a.get_submodule("q_norm")(q), a.get_submodule("k_norm")(k)
        out = blockwise_attention(q, k, v, block=max(1, tokens), scale=float(vars(a)["scale"]))
        out = out.transpose(1, 2).reshape(batch, tokens, -1)
        return a.get_submodule("proj")(a.get_submodule("norm")(out))


def with_ring_kernels(layer: nn.Module) -> nn.Module:
    """A copy of ``layer`` whose timm attention modules (``qkv``, ``q_norm``, ``k_norm``, ``norm``, ``proj``)
    compute as a ring member does (``RingKernels``); ``layer`` itself if it has none."""
    names = [name for name, m in layer.named_modules() if name and all(
        hasattr(m, part) for part in ("qkv", "q_norm", "k_norm", "norm", "proj", "num_heads", "scale"))]
    if not names:
        return layer
    copied = copy.deepcopy(layer)
    for name in names:
        parent, _, leaf = name.rpartition(".")
        holder = copied.get_submodule(parent) if parent else copied
        setattr(holder, leaf, RingKernels(copied.get_submodule(name)))
    return copied


CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _cpu_flash_call(args: tuple[object, ...], kwargs: dict[str, object]) -> list[torch.Tensor] | None:
    """(q, k, v) of a ``scaled_dot_product_attention`` call torch runs by its flash kernel for CPU (4-d, one
    head size, no mask, no dropout, no grouped heads, a dtype it takes), else None (the math path)."""
    tensors = [argument(args, kwargs, i, name) for i, name in enumerate(("query", "key", "value"))]
    qkv = [t for t in tensors if isinstance(t, torch.Tensor)]
    plain = argument(args, kwargs, 3, "attn_mask") is None and not argument(args, kwargs, 4, "dropout_p", 0.0) \
        and not argument(args, kwargs, 7, "enable_gqa", False)
    shaped = len(qkv) == 3 and all(t.dim() == 4 and t.shape[-1] == qkv[0].shape[-1] and t.dtype in CPU_FLASH_DTYPES
                                   for t in qkv)
    return qkv if plain and shaped else None


class _CpuFlash(TorchFunctionMode):
    """``scaled_dot_product_attention`` as torch runs it on CPU: its flash kernel where the call qualifies (it
    saves q, k, v, the output and the log-sum-exp; never the scores). On ``meta`` torch takes the math path (an
    n x n softmax saved), which is not what a CPU run allocates."""

    def __torch_function__(self, func: TorchOp, types: Collection[type], args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        call = _cpu_flash_call(args, kwargs) if func is F.scaled_dot_product_attention else None
        if call is None:
            return func(*args, **kwargs)
        causal, scale = argument(args, kwargs, 5, "is_causal", False), argument(args, kwargs, 6, "scale")
        out: torch.Tensor = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *call, 0.0, bool(causal), scale=scale)[0]
        return out


class CpuKernels(nn.Module):
    """A layer whose attention runs as on CPU (``_CpuFlash``), for the memory simulation of one process."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args: object, **kwargs: object) -> object:
        with _CpuFlash():
            return self.layer(*args, **kwargs)


def with_device_kernels(layer: nn.Module, cpu: bool) -> nn.Module:
    """``layer`` simulated as the device runs its attention: on CPU (``cpu``) a layer with attention modules as
    ``CpuKernels``; else ``layer`` (on GPU torch picks among its fused kernels at run time: not simulated)."""
    return CpuKernels(layer) if cpu and attention_widths(layer) else layer
