"""The slide encoder (models/slide_encoder.py) in the classifier head, one process, float64: positions from the whole
grid, each sample encoded alone, the class token reaching the classifier, the record, the flags and their refusals.
The exactness on 4 tiles + a layer rank is tests/mpi/whole_slide_cli.py's; slide-level inference's map is
tests/mpi/whole_slide_infer.py's and tests/infer/test_whole_slide_infer.py's."""

from __future__ import annotations

import pytest
import torch

from mpi4dl_nb.cli.job_flags import parsed_job
from mpi4dl_nb.cli.train_cmd import train_parser
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.models.head import ClassifierHead
from mpi4dl_nb.models.pools import PoolKind
from mpi4dl_nb.models.slide_encoder import SlideEncoder, SlideEncoderSpec, grid_positions
from mpi4dl_nb.models.spec import ModelSpec
from mpi4dl_nb.run.job import TrainJob
from mpi4dl_nb.run.model_choice import ModelChoice, SlideEncoderChoice
from mpi4dl_nb.schema import build_job

SPEC = SlideEncoderSpec(layers=2, heads=2)


def small(pool: str = "attention", encoder: SlideEncoderSpec | None = SPEC) -> ModelSpec:
    return ModelSpec.of("resnet", num_layers=8, num_filters=4, num_classes=2, resnet_version=1, pool=pool,
                        slide_encoder=encoder)


def test_positions_come_from_the_cell_s_row_and_column_in_the_whole_grid():
    table = grid_positions(8, 4, 6, torch.float64, torch.device("cpu")).view(4, 6, 8)
    assert torch.equal(table[:, :, :4], table[:, :1, :4].expand(4, 6, 4))   # the first half: the row only
    assert torch.equal(table[:, :, 4:], table[:1, :, 4:].expand(4, 6, 4))   # the second: the column only
    wider = grid_positions(8, 5, 9, torch.float64, torch.device("cpu")).view(5, 9, 8)
    assert torch.equal(wider[:4, :6], table)        # a cell's position does not depend on the grid's size
    assert len({tuple(row.tolist()) for row in table.view(24, 8)}) == 24     # every cell its own


def test_each_sample_is_encoded_alone_so_micro_batches_change_nothing():
    torch.manual_seed(0)
    encoder = SlideEncoder(8, SPEC).double()
    x = torch.randn(3, 8, 4, 5, dtype=torch.float64)
    token, cells = encoder(x)
    assert token.shape == (3, 8) and cells.shape == (3, 8, 4, 5)
    for i in range(3):
        one_token, one_cells = encoder(x[i:i + 1])
        assert torch.allclose(one_token, token[i:i + 1], atol=1e-13, rtol=0)
        assert torch.allclose(one_cells, cells[i:i + 1], atol=1e-13, rtol=0)


def test_the_cells_attend_to_each_other_across_the_whole_grid():
    torch.manual_seed(1)
    encoder = SlideEncoder(8, SPEC).double()
    x = torch.randn(1, 8, 4, 4, dtype=torch.float64)
    changed = x.clone()
    changed[0, :, 3, 3] += torch.randn(8, dtype=torch.float64)   # one far corner cell (not a constant: LayerNorm)
    _, cells = encoder(x)
    _, after = encoder(changed)
    assert (after - cells)[..., 0, 0].abs().max() > 1e-6     # reaches the opposite corner in one forward


def test_the_probe_gives_the_class_token_s_attention_over_every_token():
    torch.manual_seed(2)
    encoder = SlideEncoder(8, SPEC).double()
    seen: list[torch.Tensor] = []
    encoder.last_class_attention().register_forward_hook(lambda module, inputs, output: seen.append(output))
    encoder(torch.randn(2, 8, 3, 4, dtype=torch.float64))
    assert seen[0].shape == (2, SPEC.heads, 1 + 12)
    assert torch.allclose(seen[0].sum(-1), torch.ones(2, SPEC.heads, dtype=torch.float64), atol=1e-14, rtol=0)


@pytest.mark.parametrize("pool", list(PoolKind))
def test_the_classifier_reads_the_class_token_beside_every_pool(pool):
    torch.manual_seed(3)
    head = ClassifierHead(16, 2, pool=pool, encoder=SPEC).double()
    assert head.encoder is not None and head.fc.in_features == 2 * 16     # the class token and the pooled cells
    cells = torch.rand(2, 16 + (1 if pool.tissue else 0), 6, 5, dtype=torch.float64)   # tissue-mean: the mask last
    token, encoded = head.encoder(cells[:, :16])
    pooled = head.pool(torch.cat([encoded, cells[:, 16:]], 1)) if pool.tissue else head.flatten(head.pool(encoded))
    assert torch.allclose(head(cells), head.fc(torch.cat([token, pooled], 1)), atol=1e-14, rtol=0)
    torch.nn.functional.cross_entropy(head(cells), torch.tensor([0, 1])).backward()
    assert head.encoder.class_token.grad is not None and head.encoder.class_token.grad.abs().sum() > 0


def test_a_model_with_the_encoder_trains_end_to_end_into_its_trunk():
    torch.manual_seed(4)
    net = torch.nn.Sequential(*small("attention").build(32)).double()
    assert isinstance(net[-1], ClassifierHead) and net[-1].encoder is not None
    torch.nn.functional.cross_entropy(net(torch.rand(2, 3, 32, 32, dtype=torch.float64)),
                                      torch.tensor([0, 1])).backward()
    first = next(net[0].parameters())
    assert first.grad is not None and first.grad.abs().sum() > 0     # through the encoder into the trunk


def test_the_spec_is_recorded_and_older_records_have_no_encoder():
    spec = small()
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    assert "transformer slide encoder (2 layers, 2 heads)" in spec.describe()
    old = {k: v for k, v in small(encoder=None).to_dict().items() if k != "slide_encoder"}
    assert ModelSpec.from_dict(old).slide_encoder is None
    keys = set(torch.nn.Sequential(*small("attention", None).build(32)).state_dict())
    assert not any("encoder" in key for key in keys)          # a head without one keeps today's keys


def parsed(*flags: str) -> ModelChoice:
    """The model choice of ``train FLAGS`` as the command builds it (before the data check)."""
    return parsed_job(train_parser().parse_args(list(flags)), TrainJob, "train").model


def test_the_flags_name_the_encoder_with_its_defaults():
    assert parsed().slide_encoder.spec() is None
    assert parsed("--slide-encoder", "transformer").slide_encoder.spec() == SlideEncoderSpec(2, 4)
    given = parsed("--slide-encoder", "transformer", "--slide-encoder-layers", "3", "--slide-encoder-heads", "2")
    assert given.spec(2).slide_encoder == SlideEncoderSpec(3, 2)
    assert SlideEncoderChoice().spec() is None
    assert SlideEncoderChoice("transformer").spec() == SlideEncoderSpec(2, 4)
    keywords = build_job(TrainJob, {"slide_encoder": "transformer", "slide_encoder_heads": 2}, "train")   # dl.train
    assert keywords.model.slide_encoder.spec() == SlideEncoderSpec(2, 2)
    choice = ModelChoice(slide_encoder=SlideEncoderChoice("transformer", 3, 2))
    assert choice.spec(2).slide_encoder == SlideEncoderSpec(3, 2)


@pytest.mark.parametrize(("make", "knob", "words"), [
    (lambda: SlideEncoderChoice(layers=3), "--slide-encoder-layers", "add --slide-encoder transformer"),
    (lambda: SlideEncoderChoice(heads=2), "--slide-encoder-heads", "add --slide-encoder transformer"),
    (lambda: ModelChoice(model="torchvision:resnet18", slide_encoder=SlideEncoderChoice("transformer")),
     "--slide-encoder", "after --model resnet or amoebanet, or a timm ViT"),
    (lambda: ModelChoice(model="unet", slide_encoder=SlideEncoderChoice("transformer")), "--slide-encoder",
     "drop --slide-encoder"),
    (lambda: SlideEncoder(16, SlideEncoderSpec(heads=3)), "--slide-encoder-heads", "use one of 1, 2, 4, 8, 16"),
    (lambda: SlideEncoder(6, SlideEncoderSpec(heads=2)), "--slide-encoder", "multiple of 4"),
])
def test_refusals_name_the_flag_and_the_fix(make, knob, words):
    with pytest.raises(ConfigError) as err:
        make()
    assert err.value.knob == knob and words in str(err.value)


def test_a_run_with_other_heads_is_another_model_on_resume():
    """Heads change no tensor's shape, so the run identity names the encoder (resume refuses the change)."""
    from mpi4dl_nb.run.identity import model_fingerprint

    four, two = small(encoder=SlideEncoderSpec(2, 4)), small(encoder=SlideEncoderSpec(2, 2))
    torch.manual_seed(0)
    layers = four.build(32)
    assert model_fingerprint(four, layers) != model_fingerprint(two, layers)
    plain = small(encoder=None)
    assert "encoder" not in model_fingerprint(plain, plain.build(32))     # today's text for runs without one


def small_vit_spec(pool: str = "attention", encoder: SlideEncoderSpec | None = SPEC) -> ModelSpec:
    return ModelSpec.of("tests.mpi.whole_slide_cli:small_vit", num_classes=2, pool=pool, slide_encoder=encoder,
                        image_size=64)


@pytest.mark.parametrize("encoder", [SPEC, None])
def test_a_vit_s_patch_tokens_are_the_grid_its_encoder_and_pool_read(encoder):
    """Issue 52: ``--slide-encoder`` / ``--pool attention`` after a ViT (models/token_grid.py): its final norm, its 4x4
    patch tokens (class and register tokens dropped) as the map, the ResNet's classifier head; trained end to end."""
    pytest.importorskip("timm")
    from mpi4dl_nb.models.token_grid import TokenGridHead
    from mpi4dl_nb.models.vit import is_cut_vit, train_last_blocks

    torch.manual_seed(5)
    spec = small_vit_spec(encoder=encoder)
    net = torch.nn.Sequential(*spec.build()).double()
    head = net[-1]
    assert isinstance(head, TokenGridHead) and head.paths == ("norm", "token_grid", "grid_head") and is_cut_vit(net)
    assert (head.classifier.encoder is not None) == (encoder is not None)
    assert head.classifier.pool_kind is PoolKind.ATTENTION
    image = torch.rand(1, 3, 64, 64, dtype=torch.float64)
    tokens = torch.nn.Sequential(*net[:-1])(image)
    assert tokens.shape == (1, 2 + 16, 32)                          # class + register token, then 4x4 patches
    cells = head.get_submodule("norm")(tokens)[:, 2:].transpose(1, 2).reshape(1, 32, 4, 4)
    assert torch.allclose(net(image), head.classifier(cells), atol=1e-14, rtol=0)
    torch.nn.functional.cross_entropy(net(image), torch.tensor([1])).backward()
    assert net[0].get_submodule("patch_embed.proj").weight.grad.abs().sum() > 0      # into the ViT's embedding
    assert ModelSpec.from_dict(spec.to_dict()) == spec and ("slide encoder" in spec.describe()) == bool(encoder)
    assert "the final norm and the head" in train_last_blocks(list(net), 1, spec.label)
    assert all(p.requires_grad for p in head.parameters())          # --train-blocks trains the new head


def test_the_encoder_after_a_vit_is_accepted_and_after_a_named_cnn_refused():
    assert parsed("--model", "timm:vit_tiny_patch16_224", "--slide-encoder", "transformer").slide_encoder.spec()
    with pytest.raises(ConfigError) as err:
        ModelSpec.of("timm:resnet10t", num_classes=2, slide_encoder=SPEC).named_head([torch.nn.Identity()])
    assert err.value.knob == "--slide-encoder" and "is not a ViT" in str(err.value)
    with pytest.raises(ValueError, match="tissue-mean"):
        small_vit_spec("tissue-mean")


def test_pretrained_vit_weights_load_into_the_trunk_and_the_new_head_stays_as_drawn():
    """``--weights`` with a token-grid head: the file's blocks, embeddings and final norm load; its classifier is
    replaced (not loaded), the new head is in no file."""
    pytest.importorskip("timm")
    from mpi4dl_nb.models.weights import load_weights
    from tests.mpi.whole_slide_cli import small_vit

    torch.manual_seed(6)
    pretrained = small_vit(1000).state_dict()            # another number of classes, as a foundation model's file
    layers = small_vit_spec().build()
    drawn = {k: v.clone() for k, v in layers[-1].state_dict().items() if "grid_head" in k}
    assert load_weights(layers, pretrained, model="small_vit") is None
    state = torch.nn.Sequential(*layers).state_dict()
    assert torch.equal(state["0.pos_embed"], pretrained["pos_embed"])
    assert torch.equal(state["3.norm.weight"], pretrained["norm.weight"]) and "3.head.weight" not in state
    assert all(torch.equal(layers[-1].state_dict()[k], v) for k, v in drawn.items())
    with pytest.raises(ConfigError, match="unexpected blocks.5"):
        load_weights(layers, {**pretrained, "blocks.5.norm1.weight": torch.ones(32)}, model="small_vit")
