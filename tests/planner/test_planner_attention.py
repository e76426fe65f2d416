"""Planner for ViTs on token tiles: the ring's bytes and blocks in flight (pure), a block's footprint on a member's
tokens with the ring's terms, the memory plan of a small timm ViT on 1, 2 and 4 tiles."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpi4dl_nb import ParallelConfig, planner
from mpi4dl_nb.planner.attention import TokenGrid, all_gathered_bytes, attention_flops, ring_cost
from mpi4dl_nb.planner.footprint import StageRole
from mpi4dl_nb.planner.tile_footprints import simulate_layer
from mpi4dl_nb.planner.token_tiles import (
    AttentionWidth,
    attention_widths,
    member_work,
    token_grid_of,
    with_device_kernels,
    with_ring_kernels,
)
from mpi4dl_nb.planner.workspace import Workspace
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.support.planner_checks import serial_peak
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip


def test_ring_sends_every_block_but_its_successor_s_and_about_twice_that_in_backward():
    tokens = [17, 16, 16, 16]                  # a class token on member 0
    dim, heads, size = 384, 6, 8
    for member in range(4):
        cost = ring_cost(tokens, member, dim, heads, size)
        successor = (member + 1) % 4
        assert cost.sent_forward == 2 * dim * size * (sum(tokens) - tokens[successor])
        # + every block's gradient but its own (each accumulator reaches its owner in P - 1 hops)
        assert cost.sent_backward == cost.sent_forward + 2 * dim * size * (sum(tokens) - tokens[member])
        assert cost.messages_forward == 3 and cost.messages_backward == 3 + 3
        arriving = max(tokens[(member - s) % 4] for s in (1, 2, 3))
        assert cost.in_flight_forward == 2 * dim * size * (tokens[member] + arriving)
        assert cost.in_flight_backward == cost.in_flight_forward + 2 * 2 * dim * size * 17
        assert cost.score_block == heads * tokens[member] * 17 * size
        assert cost.extra_keys == 65 - tokens[member]
    even = ring_cost([16] * 4, 2, dim, heads, size)
    assert even.sent_forward == 2 * 16 * dim * 3 * size == all_gathered_bytes([16] * 4, 2, dim, size)  # 2 (N/P) C (P-1)
    float32_gradients = ring_cost([16] * 4, 2, dim, heads, size, gradient_bytes=4)
    assert float32_gradients.sent_backward == even.sent_forward + 2 * 48 * dim * 4
    alone = ring_cost([64], 0, dim, heads, size)
    assert alone.sent_forward == alone.sent_backward == alone.in_flight_forward == alone.messages_backward == 0
    assert alone.extra_keys == 0
    assert attention_flops(16, 64, dim) == 4 * 16 * 64 * dim
    with pytest.raises(ValueError, match="member 4 of a ring of 4"):
        ring_cost(tokens, 4, dim, heads, size)


def test_token_grid_splits_like_the_tiles_and_member_0_holds_the_class_and_register_tokens():
    tokens = TokenGrid(7, 6, prefix=5)
    assert tokens.member_tokens(TileGrid(2, 2)) == (4 * 3 + 5, 4 * 3, 3 * 3, 3 * 3)
    assert tokens.member_tokens(TileGrid(1, 4)) == (7 * 2 + 5, 7 * 2, 7, 7)
    assert sum(tokens.member_tokens(TileGrid(2, 1))) == tokens.total == 47
    assert token_grid_of(frozenset({(224, 224), (14, 14)}), 197) == TokenGrid(14, 14, 1)
    assert token_grid_of(frozenset({(224, 224)}), 197) is None


# ------------------------------------------------------------------------------------------------------- timm
def timm_or_skip():
    require_or_skip(missing_modules("timm"), "planner estimates of ViTs", MODELS_EXTRA)
    import timm
    return timm


class _Piece(nn.Module):
    """A ViT's patch embedding (or its head), holding only the modules and parameters it uses."""

    def __init__(self, vit: nn.Module, keep: set[str], embed: bool) -> None:
        super().__init__()
        view = copy.copy(vit)
        view._modules = {k: (m if k in keep else nn.Identity()) for k, m in vit._modules.items()}
        view._parameters = dict(vit._parameters) if embed else {}
        self.vit, self.embed = view, embed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vit = self.vit
        if self.embed:
            return vit.norm_pre(vit.patch_drop(vit._pos_embed(vit.patch_embed(x))))
        return vit.forward_head(vit.norm(x))


def vit_layers(timm, depth: int = 2, size: int = 128) -> list[nn.Module]:
    """A small timm ViT-S/16 (``depth`` blocks, 2 classes) as patch embedding, blocks, head."""
    torch.manual_seed(0)
    vit = timm.create_model("vit_small_patch16_224", img_size=size, num_classes=2, depth=depth,
                            dynamic_img_size=True)
    return [_Piece(vit, {"patch_embed", "pos_drop", "patch_drop", "norm_pre"}, True), *vit.blocks,
            _Piece(vit, {"norm", "fc_norm", "head_drop", "head"}, False)]


def test_a_block_on_a_member_s_tokens_adds_its_ring_s_blocks_in_flight_and_messages():
    timm = timm_or_skip()
    block = vit_layers(timm, depth=1)[1]
    assert attention_widths(block) == [AttentionWidth(6, 384)]
    tokens = TokenGrid(8, 8, prefix=1)
    role = StageRole((2, 2), tokens=tokens)
    members = tokens.member_tokens(TileGrid(2, 2))
    tiles = simulate_layer(block, [(1, 65, 384)], torch.float64, role)
    for member, fp in enumerate(tiles):
        (alone,) = simulate_layer(with_ring_kernels(block), [(1, members[member], 384)], torch.float64, StageRole())
        cost = ring_cost(members, member, 384, 6, 8)
        assert fp.kept == alone.kept and fp.output_bytes == alone.output_bytes == members[member] * 384 * 8
        assert fp.forward_peak == alone.forward_peak + cost.in_flight_forward
        assert fp.backward_peak == alone.backward_peak + cost.in_flight_backward
        assert fp.forward_traffic.message_bytes == cost.sent_forward
        assert fp.backward_traffic.message_bytes == cost.sent_backward
    module, shapes, share = member_work(block, [(2, 65, 384)], tokens, members, 1)
    assert shapes == [(2, 16, 384)] and share == 1.0
    assert module(torch.randn(2, 16, 384)).shape == (2, 16, 384)       # the member's tokens against the other 49


def test_vit_activations_per_rank_fall_as_1_over_p_and_member_0_holds_the_class_token():
    timm = timm_or_skip()
    layers = vit_layers(timm)
    plans = {p: planner.estimate_memory(layers, ParallelConfig(split_size=1, spatial_size=int(p > 1),
                                                               num_spatial_parts=p, slice_method="vertical"),
                                        128, 2, dtype=torch.float64) for p in (1, 2, 4)}
    one = plans[1].ranks[0].activations
    for p in (2, 4):
        ranks = plans[p].ranks
        assert all(r.activations <= 1.15 * one / p for r in ranks), (p, [r.activations / one for r in ranks])
        assert ranks[0].activations > ranks[1].activations          # the class token's share


def test_a_member_s_block_estimate_is_within_15_percent_of_its_measured_activations():
    """The planner's bytes of a ViT block on a member's tokens (kept + input + output, weights left out) against
    what the block with the ring's kernels saves on real tensors (BENCHMARKS.md section 14: the same numbers on
    4 ranks of real ring attention, ViT-S/16 at 1024 px: 108.2 / 54.1 / 27.1 MB per block on P = 1 / 2 / 4)."""
    timm = timm_or_skip()
    block = vit_layers(timm, depth=1)[1].double()
    tokens = TokenGrid(16, 16, prefix=1)
    members = tokens.member_tokens(TileGrid(2, 2))
    tiles = simulate_layer(block, [(1, tokens.total, 384)], torch.float64, StageRole((2, 2), tokens=tokens))
    ring_block = with_ring_kernels(block)
    weights = {p.untyped_storage().data_ptr() for p in ring_block.parameters()}
    for member in (0, 1):
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, into: dict[int, int] = saved) -> torch.Tensor:
            into[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = ring_block(torch.randn(1, members[member], 384, dtype=torch.float64, requires_grad=True))
        pack(out)
        measured = sum(size for pointer, size in saved.items() if pointer not in weights)
        fp = tiles[member]
        estimate = fp.kept + fp.output_bytes + (fp.input_bytes if fp.saves_input else 0)
        assert abs(estimate / measured - 1) < 0.15, (member, estimate, measured)


def test_one_process_attention_is_simulated_as_cpu_runs_it_never_as_n_by_n_scores():
    """On meta torch takes scaled_dot_product_attention's math path (an n x n softmax saved); on CPU it runs its
    flash kernel (q, k, v, output and log-sum-exp saved): the simulation of one process follows the CPU."""
    timm = timm_or_skip()
    block = vit_layers(timm, depth=1, size=512)[1]
    n, scores = 1025, 6 * 1025 * 1025 * 4
    (cpu,) = simulate_layer(block, [(1, n, 384)], torch.float32, StageRole())
    (math,) = simulate_layer(block, [(1, n, 384)], torch.float32, StageRole(), workspace=Workspace.NONE)
    assert cpu.kept < scores <= math.kept - cpu.kept, (cpu.kept, math.kept)
    assert with_device_kernels(block, cpu=False) is block and with_device_kernels(nn.Linear(2, 2), cpu=True).__class__ \
        is nn.Linear


@pytest.mark.parametrize("size", [256, 512])
def test_one_process_vit_estimate_within_15_percent_of_measured(size):
    """ViT-S/16 (one block: patch embedding, block, head) at 257 and 1,025 tokens, float32, batch 1, SGD with
    momentum: the planner's peak against the measured step (as for CNNs, test_planner.py). Before attention was
    simulated as the CPU runs it: 2.1x at 512 px, 7.9x at 1024 px (174 MB estimated against 156 MB measured now)."""
    timm = timm_or_skip()
    layers = vit_layers(timm, depth=1, size=size)
    plan = planner.estimate_memory(layers, ParallelConfig(split_size=1, spatial_size=0), size, 1)
    measured = serial_peak(nn.Sequential(*layers), 1, size)
    assert abs(plan.peak / measured - 1) < 0.15, (size, plan.peak / 2**20, measured / 2**20)
