"""Vision transformers cut into pieces (models/vit.py): timm's VisionTransformer and Eva (class/register tokens,
average and attention pools, rotary embeddings, a hybrid stem) as embedding, blocks and head whose forward and every
gradient equal the model's in float64; keys that map to the model's; a timm state dict of another token grid loaded
with its position embeddings resampled as timm does; ``--train-blocks``; sizes the patches do not tile refused.
Small models (depth 2, small images) keep it cheap."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.models.cut import layer_list
from mpi4dl_nb.models.external import external_layers, timm_model
from mpi4dl_nb.models.normalize import IMAGENET, Normalize, normalized
from mpi4dl_nb.models.pieces import Piece, original_state_dict
from mpi4dl_nb.models.vit import RopeBlock, TokenEmbedding, TokenHead, blocks_of, train_last_blocks
from mpi4dl_nb.models.weights import load_weights
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

MISSING = missing_modules("timm")
TOLERANCE = 1e-12


@pytest.fixture(autouse=True)
def _libraries() -> None:
    require_or_skip(MISSING, "timm's vision transformers", MODELS_EXTRA)


# name, img_size: class token; registers + average pool; DINOv2 registers (patch 14); rotary (Eva); SigLIP's
# attention pool (MAP head); a hybrid ResNet stem of stride 32
MODELS = [("vit_small_patch16_224", 32), ("vit_little_patch16_reg4_gap_256", 32), ("vit_small_patch14_reg4_dinov2", 28),
          ("vit_small_patch16_rope_224", 32), ("vit_base_patch16_siglip_224", 32), ("vit_small_r26_s32_224", 64)]


def vit(name: str, img_size: int, **extra: object) -> nn.Module:
    """A two-block timm ViT in float64 at ``img_size`` (3 classes; dropouts that the cut must keep in train mode)."""
    import timm

    torch.manual_seed(0)
    settings = {"num_classes": 3, "depth": 2, "img_size": img_size, "drop_rate": 0.2, "drop_path_rate": 0.1, **extra}
    model = timm.create_model(name, **settings)
    return model.double()


def gradients(module: nn.Module, x: torch.Tensor, keys: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of a fixed function of ``module(x)`` (eval mode), by key (mapped by ``keys``)."""
    module.eval()
    module.zero_grad(set_to_none=True)
    out = module(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    found = {name: p.grad for name, p in module.named_parameters() if p.grad is not None}
    return found if keys is None else {keys[name]: grad for name, grad in found.items()}


@pytest.mark.parametrize(("name", "img_size"), MODELS)
def test_cut_equals_the_model_forward_and_every_gradient(name, img_size):
    """Embedding, one piece per block, head; the output and every parameter's gradient equal the model's (float64),
    keys map to the model's, and train mode (dropout, drop path) draws the same masks (checked by the cut)."""
    model = vit(name, img_size)
    twin = copy.deepcopy(model)
    layers = layer_list(twin)
    assert [type(layer) for layer in layers][::len(layers) - 1] == [TokenEmbedding, TokenHead]
    assert len(blocks_of(layers)) == 2 and all(isinstance(layers[i], Piece) for i in blocks_of(layers))
    if "rope" in name:
        assert all(isinstance(layers[i], RopeBlock) for i in blocks_of(layers))
    net = nn.Sequential(*layers)
    assert set(original_state_dict(layers, net.state_dict())) == set(model.state_dict())
    x = torch.randn(2, 3, img_size, img_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(net.eval()(x), model.eval()(x), rtol=0, atol=TOLERANCE)
    keys = {key: key.partition(".")[2] for key, _ in net.named_parameters()}
    theirs, ours = gradients(model, x), gradients(net, x, keys)
    assert set(ours) == set(theirs) == {k for k, p in model.named_parameters() if p.requires_grad}
    worst = max(float((ours[k] - theirs[k]).abs().max()) for k in theirs)
    assert worst <= TOLERANCE, f"gradients differ by {worst}"


def test_a_normalisation_goes_in_front_of_the_patch_embedding():
    layers = normalized(layer_list(vit("vit_small_patch16_224", 32)), IMAGENET)
    first = layers[0]
    assert isinstance(first, TokenEmbedding) and isinstance(first.get_submodule(first.paths[0]), Normalize)
    x = torch.rand(1, 3, 32, 32, dtype=torch.float64)
    plain = layer_list(vit("vit_small_patch16_224", 32))
    with torch.no_grad():
        expected = nn.Sequential(*plain).eval()(Normalize(IMAGENET).double()(x))
        assert torch.allclose(nn.Sequential(*layers).eval()(x), expected, rtol=0, atol=TOLERANCE)


def test_the_run_image_size_builds_the_model_and_a_cut_patch_is_refused():
    """``--image-size`` is timm's ``img_size=`` (the position embeddings' grid); a side the patch does not divide is
    refused naming the sizes next to it that work."""
    model = timm_model("vit_small_patch14_reg4_dinov2", 2, image_size=56)
    assert tuple(model.patch_embed.grid_size) == (4, 4) and model.pos_embed.shape[1] == 16   # no_embed_class
    with pytest.raises(ConfigError, match=r"--image-size: 60: timm:vit_small_patch16_224 cuts images into "
                                          r"16x16-pixel patches.*use 48 or 64"):
        timm_model("vit_small_patch16_224", 2, image_size=60)
    with pytest.raises(ConfigError, match="32x32-pixel patches.*use 32 or 64"):
        timm_model("vit_small_r26_s32_224", 2, image_size=48)
    layers = external_layers("timm", "vit_tiny_patch16_224", 2, image_size=32)
    assert len(layers) == 14 and isinstance(layers[-1], TokenHead)


def test_weights_of_another_token_grid_are_resampled_as_timm_does():
    """A state dict of the 224-px model into the 32-px one: pos_embed resampled (timm's own function, prefix kept),
    one line saying so; every other tensor loaded as it is; a 1000-class head replaced."""
    import timm
    from timm.layers import resample_abs_pos_embed

    torch.manual_seed(3)
    published = timm.create_model("vit_small_patch16_224", depth=2).state_dict()    # 1000 classes, 14x14 grid
    layers = layer_list(vit("vit_small_patch16_224", 32))
    note = load_weights(layers, published, model="timm:vit_small_patch16_224")
    assert note is not None and "pos_embed holds a 14x14 token grid, the model 2x2" in note and "head" in note
    loaded = original_state_dict(layers, nn.Sequential(*layers).state_dict())
    expected = resample_abs_pos_embed(published["pos_embed"], new_size=[2, 2], old_size=[14, 14], num_prefix_tokens=1)
    assert torch.equal(loaded["pos_embed"], expected.double())
    assert torch.equal(loaded["blocks.1.attn.qkv.weight"], published["blocks.1.attn.qkv.weight"].double())


def test_train_blocks_freezes_all_but_the_last_blocks_and_the_head():
    layers = layer_list(vit("vit_little_patch16_reg4_gap_256", 32, depth=3, init_values=1e-5))   # LayerScale kept
    note = train_last_blocks(layers, 2, "timm:vit_little_patch16_reg4_gap_256")
    assert note.startswith("--train-blocks 2: training blocks 1-2, the final norm and the head")
    trained = {k.partition(".")[2] for k, p in nn.Sequential(*layers).named_parameters() if p.requires_grad}
    assert {"blocks.2.ls1.gamma", "blocks.1.attn.qkv.weight", "fc_norm.weight", "head.weight"} <= trained  # gap
    assert not trained & {"reg_token", "pos_embed", "patch_embed.proj.weight", "blocks.0.mlp.fc1.weight"}
    train_last_blocks(layers, 0, "v")
    assert {k.partition(".")[2] for k, p in nn.Sequential(*layers).named_parameters() if p.requires_grad} == {
        "fc_norm.weight", "fc_norm.bias", "head.weight", "head.bias"}
    with pytest.raises(ConfigError, match="--train-blocks: 4: v has 3 blocks; use at most 3"):
        train_last_blocks(layers, 4, "v")
    with pytest.raises(ConfigError, match="--train-blocks: .*resnet18 is not one"):
        train_last_blocks([Piece([("conv", nn.Conv2d(3, 3, 1))])], 1, "torchvision:resnet18")


def test_what_the_cut_does_not_take_is_refused_naming_it():
    model = vit("vit_small_patch16_224", 32)
    model.extra = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="children the cut does not know: extra"):
        layer_list(model)


@pytest.mark.parametrize(("name", "rows", "cols"), [("vit_small_patch14_reg4_dinov2", 2, 2),
                                                    ("vit_small_patch16_224", 1, 4)])
def test_token_tiles_join_into_the_model_sequence_and_gradients_split_back(name, rows, cols):
    """The spatial -> layer hand-off of a ViT (pipeline/handoff.TokenTiling): token tiles as the spatial stage holds
    them (each tile its box of the token grid row-major, the class/register tokens on tile 0) join into the
    embedding's own output, and the gradient's split is join's exact adjoint."""
    from mpi4dl_nb.spatial.geometry import TileGrid

    side = 56 if "14" in name else 64
    layers = layer_list(vit(name, side))
    embed = layers[0]
    assert isinstance(embed, TokenEmbedding)
    tiling = embed.token_tiling(TileGrid(rows, cols))
    with torch.no_grad():
        whole = embed.eval()(torch.randn(2, 3, side, side, dtype=torch.float64))
    prefix, (height, width) = tiling.num_prefix, tiling.token_grid
    image = whole[:, prefix:].reshape(2, height, width, -1)
    tiles = []
    for tile, (r0, r1, c0, c1) in enumerate(tiling.grid.tile_boxes(height, width)):
        own = image[:, r0:r1, c0:c1].reshape(2, (r1 - r0) * (c1 - c0), -1)
        tiles.append(torch.cat([whole[:, :prefix], own], 1) if tile == 0 else own)
    assert [t.shape[1] for t in tiles] == tiling.counts() and torch.equal(tiling.join(tiles), whole)
    grad = torch.randn_like(whole)
    parts = [tiling.split(grad, tile) for tile in range(len(tiles))]
    assert all(torch.equal(p, t) for p, t in zip([tiling.split(whole, k) for k in range(len(tiles))], tiles))
    assert torch.equal(tiling.join(parts), grad)
    with pytest.raises(ValueError, match="token tiles hold"):
        tiling.join(tiles[::-1])


def test_the_engine_hands_a_vit_s_token_tiles_off_as_tokens_and_a_cnn_s_as_feature_maps():
    """``handoff_of`` (the runtime's seam): a cut ViT's spatial layers hand off token tiles joined in the model's
    order, whose gradients split back per tile as ``TokenTiling.split``; a CNN's, feature-map tiles by their boxes."""
    from mpi4dl_nb.pipeline.handoff import FeatureTiles, TokenTiling, handoff_of
    from mpi4dl_nb.spatial.geometry import TileGrid

    grid = TileGrid(2, 2)
    layers = layer_list(vit("vit_little_patch16_reg4_gap_256", 64))
    tiling = handoff_of(layers[:2], grid)
    assert tiling == TokenTiling(grid, (4, 4), 4)        # 4x4 tokens, 4 register tokens on tile 0 (no class token)
    tiles = [torch.randn(2, n, 8, dtype=torch.float64) for n in tiling.counts()]
    joined = tiling.join_payloads(tiles)
    assert torch.equal(joined.payload, tiling.join(tiles))
    grad = torch.randn_like(joined.payload)
    assert all(torch.equal(joined.tile_grads([grad, None], t)[0], tiling.split(grad, t))
               and joined.tile_grads([grad, None], t)[1] is None for t in range(4))
    with pytest.raises(ValueError, match="one .N, n, C. token tensor per tile"):
        tiling.join_payloads([(t, t) for t in tiles])
    cnn = handoff_of([nn.Conv2d(3, 4, 3)], grid)
    assert cnn == FeatureTiles(grid) and handoff_of(layers[:2], None) is None
    maps = [torch.randn(1, 4, 3, 3) for _ in range(4)]
    features = cnn.join_payloads(maps)
    assert features.payload.shape == (1, 4, 6, 6) and torch.equal(features.tile_grads([features.payload], 3)[0],
                                                                  maps[3])


@pytest.mark.parametrize(("rows", "cols"), [(2, 2), (1, 4)])
def test_the_planner_counts_the_tokens_each_tile_hands_off(rows, cols):
    """The planner's token tiles of a cut ViT's spatial stage (``StageRole.tokens``: the token grid it finds in the
    layers' profiles, split over the tiles) are the ones the engine's hand-off joins (``TokenTiling.counts``)."""
    from mpi4dl_nb.planner.memory import token_grid
    from mpi4dl_nb.planner.profile import profile_layers
    from mpi4dl_nb.spatial.geometry import TileGrid

    layers = layer_list(vit("vit_small_patch14_reg4_dinov2", 56))
    grid = TileGrid(rows, cols)
    tokens = token_grid(profile_layers(layers, 56, 3, torch.float64), torch.float64)
    assert isinstance(layers[0], TokenEmbedding) and tokens is not None
    assert tokens.member_tokens(grid) == tuple(layers[0].token_tiling(grid).counts())
    assert (tokens.rows, tokens.cols, tokens.prefix) == (4, 4, 5)
