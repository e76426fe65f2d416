"""The cut reads one way (``models/cut_families.py``): the model's family is found once and followed.

A timm ViT is cut into its tokens, timm's Swin at its stages (tests/models/test_swin_cut.py), keys the model's; a
model built for one image size (MaxViT) by the chain cut checked at that size (not at ``CHECK_SIZE``: their patch
embedding or window partition asserts it), any other chain of modules at ``CHECK_SIZE``; the first piece of a
fixed-size model refuses another size with a ValueError naming both.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpi4dl_nb.models.cut import layer_list
from mpi4dl_nb.models.cut_families import CHECK_SIZE, CUT_FAMILIES, built_image_size, cut_family
from mpi4dl_nb.models.pieces import SizedPiece
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip


def test_a_plain_chain_takes_the_fallback_entry_at_the_check_size():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    family = cut_family(model)
    assert family is CUT_FAMILIES[-1] and family.side(model, CHECK_SIZE) == CHECK_SIZE
    assert built_image_size(model) is None


@pytest.mark.parametrize("name,size,kwargs,entry", [
    ("swin_tiny_patch4_window7_224", 224, {"depths": (1, 1, 1, 1), "embed_dim": 32, "num_heads": (1, 2, 4, 8)}, 1),
    ("maxvit_pico_rw_256", 256, {}, 2),
])
def test_a_model_built_for_one_size_is_cut_and_checked_at_it(name, size, kwargs, entry):
    require_or_skip(missing_modules("timm"), "timm's Swin and MaxViT", MODELS_EXTRA)
    import timm

    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=3, **kwargs)
    family = cut_family(model)
    assert family is CUT_FAMILIES[entry] and family.side(model, CHECK_SIZE) == (size, size)
    layers = layer_list(model)
    assert isinstance(layers[0], SizedPiece)
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        assert torch.equal(nn.Sequential(*layers).eval()(x), model.eval()(x))
    with pytest.raises(ValueError, match=f"built for {size}x{size} images"):
        layers[0](torch.randn(1, 3, size + 32, size + 32))


def test_a_vit_takes_the_token_entry():
    require_or_skip(missing_modules("timm"), "timm's ViT", MODELS_EXTRA)
    import timm

    with torch.device("meta"):
        model = timm.create_model("vit_tiny_patch16_224", num_classes=3, depth=1)
    assert cut_family(model) is CUT_FAMILIES[0] and cut_family(model).side(model, CHECK_SIZE) == (224, 224)
