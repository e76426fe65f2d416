"""``--model-args``: parsed into typed values, recorded and read back, merged under a preset; timm's layers by name;
the foundation-model presets build the architectures their model cards give."""
from __future__ import annotations

import pytest
import torch

from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.models.model_args import ModelArgs, parse_model_args, timm_resolver
from mpi4dl_nb.models.presets import PRESETS
from mpi4dl_nb.models.spec import ModelFamily, ModelSpec, parse_model_name, split_model
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip


def test_values_are_typed_and_read_back_from_the_record() -> None:
    args = parse_model_args("depth=2,mlp_ratio=5.3375,no_embed_class=true,patch_size=(16,16),act_layer=silu,"
                            "global_pool=none")
    assert dict(args) == {"depth": 2, "mlp_ratio": 5.3375, "no_embed_class": True, "patch_size": (16, 16),
                          "act_layer": "silu", "global_pool": None}
    assert ModelArgs.from_dict(args.to_dict()) == args
    assert parse_model_args(args.text()) == args


@pytest.mark.parametrize(("text", "fragment"), [
    ("depth", "give key=value pairs"), ("depth=2,=3", "give key=value pairs"), ("num_classes=3", "--num-classes"),
    ("img_size=(224,224", "'(' without its ')'"),
])
def test_malformed_arguments_are_refused_naming_the_pair(text, fragment) -> None:
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        parse_model_args(text)


def test_a_preset_s_arguments_sit_under_the_user_s() -> None:
    spec = ModelSpec.of("Virchow2", num_classes=2, model_args=parse_model_args("depth=2,reg_tokens=0"))
    assert (spec.family, spec.source, spec.label) == (ModelFamily.TIMM, "vit_huge_patch14_224",
                                                     "timm:vit_huge_patch14_224")
    given = dict(spec.model_args)
    assert given["depth"] == 2 and given["reg_tokens"] == 0 and given["mlp_layer"] == "swiglu_packed"
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    assert parse_model_name("VIRCHOW2") == "virchow2" and split_model("uni")[1] == "vit_large_patch16_224"
    with pytest.raises(ValueError, match="--model-args"):
        ModelSpec.of("resnet", model_args=parse_model_args("depth=2"))


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds_its_published_architecture(name) -> None:
    """Built on the meta device (no memory): the width, depth and token layout the model card gives."""
    require_or_skip(missing_modules("timm"), "timm's vision transformers", MODELS_EXTRA)
    import timm

    preset = PRESETS[name]
    expected = {"uni": (1024, 24, 0, "Mlp"), "uni2-h": (1536, 24, 8, "GluMlp"), "virchow2": (1280, 32, 4, "GluMlp"),
                "gigapath-tile": (1536, 40, 0, "GluMlp"), "h-optimus-0": (1536, 40, 4, "GluMlp"),
                "phikon-v2": (1024, 24, 0, "Mlp")}[name]
    keywords = preset.args.keywords(timm_resolver(timm))
    with torch.device("meta"):
        model = timm.create_model(preset.architecture, num_classes=0, img_size=224, **keywords)
    assert (model.embed_dim, len(model.blocks), model.num_reg_tokens,
            type(model.blocks[0].mlp).__name__) == expected
    assert preset.card.startswith("https://huggingface.co/")


def test_timm_layer_names_resolve_and_unknown_ones_are_refused() -> None:
    require_or_skip(missing_modules("timm"), "timm's vision transformers", MODELS_EXTRA)
    import timm

    resolve = timm_resolver(timm)
    assert resolve("mlp_layer", "swiglu_packed") is timm.layers.SwiGLUPacked
    assert resolve("act_layer", "silu") is torch.nn.SiLU
    assert resolve("depth", 2) == 2
    with pytest.raises(ConfigError, match="use one of mlp, swiglu, swiglu_packed"):
        resolve("mlp_layer", "bogus")
