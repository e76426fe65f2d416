"""The presets carry their cards' preprocessing (issue 81): ImageNet's mean and std for UNI, UNI2-h, Virchow2,
Prov-GigaPath and Phikon-v2, H-optimus-0's own; 224 px tiles of the architecture's patch; ``--normalize auto`` resolves
to the card's (with or without ``--weights``), a given ``--normalize`` overrides it and is said; recorded with the
model and read back, a record from before it reads as no preset's."""
from __future__ import annotations

import re

import pytest

from mpi4dl_nb.models.model_args import parse_model_args
from mpi4dl_nb.models.normalize import IMAGENET, Normalization
from mpi4dl_nb.models.presets import PRESETS, Preprocessing
from mpi4dl_nb.models.spec import ModelSpec
from mpi4dl_nb.run.model_choice import ModelChoice

IMAGENET_CARDS = ("uni", "uni2-h", "virchow2", "gigapath-tile", "phikon-v2")
H_OPTIMUS_0 = ((0.707223, 0.578729, 0.703617), (0.211883, 0.230117, 0.177517))   # its card's transform


def test_every_card_s_mean_std_input_size_and_patch():
    assert set(PRESETS) == {*IMAGENET_CARDS, "h-optimus-0"}
    for name in IMAGENET_CARDS:
        normal = PRESETS[name].preprocessing.normalization
        assert (normal.mean, normal.std) == ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), name
    h_optimus = PRESETS["h-optimus-0"].preprocessing.normalization
    assert (h_optimus.mean, h_optimus.std) == H_OPTIMUS_0
    for preset in PRESETS.values():
        card = preset.preprocessing
        given = dict(preset.args.items).get("patch_size")      # the architecture's patch unless the card sets one
        patch = given if given is not None else int(re.findall(r"patch(\d+)", preset.architecture)[0])
        assert (card.input_size, card.patch_size, card.card) == (224, patch, preset.card), preset.name


@pytest.mark.parametrize("weights", [None, "W.pth"])
def test_auto_is_the_card_s_and_a_given_normalize_overrides_it_said_in_one_line(weights):
    tiny = parse_model_args("depth=1")
    spec = ModelChoice("virchow2", tiny, weights=weights).spec(2, 3, 28)
    assert spec.normalize == IMAGENET and spec.preprocessing == PRESETS["virchow2"].preprocessing
    assert spec.preprocessing.override_note(spec.normalize) is None
    same = Normalization.parse("0.485,0.456,0.406,0.229,0.224,0.225")      # the card's numbers, unnamed: no note
    assert spec.preprocessing.override_note(same) is None
    h_optimus = ModelChoice("h-optimus-0", tiny, weights=weights).spec(2, 3, 28)
    assert h_optimus.normalize is not None and (h_optimus.normalize.mean, h_optimus.normalize.std) == H_OPTIMUS_0
    plain = ModelChoice("h-optimus-0", tiny, weights=weights, normalize="imagenet").spec(2, 3, 28)
    assert plain.normalize == IMAGENET and plain.preprocessing is not None
    note = plain.preprocessing.override_note(plain.normalize)
    assert note is not None and "\n" not in note and note.startswith("--normalize imagenet overrides the card's mean "
                                                                     "(0.707223, 0.578729, 0.703617)")
    assert "https://huggingface.co/bioptimus/H-optimus-0" in note
    assert ModelChoice("timm:vit_tiny_patch16_224").spec(2).preprocessing is None     # no preset, no card


def test_the_preprocessing_is_recorded_and_a_record_from_before_it_reads_as_none():
    spec = ModelSpec.of("virchow2", num_classes=2, normalize=IMAGENET, model_args=parse_model_args("depth=1"))
    data = spec.to_dict()
    assert data["preprocessing"] == {"normalize": IMAGENET.to_dict(), "input_size": 224, "patch_size": 14,
                                     "card": "https://huggingface.co/paige-ai/Virchow2"}
    assert ModelSpec.from_dict(data) == spec
    older = {key: value for key, value in data.items() if key != "preprocessing"}
    assert ModelSpec.from_dict(older).preprocessing is None and ModelSpec.from_dict(older).normalize == IMAGENET
    with pytest.raises(ValueError, match="preprocessing"):
        Preprocessing.from_dict({**PRESETS["uni"].preprocessing.to_dict(), "input_size": "224"})
