"""Pathology foundation models by name (``--model uni``, ``virchow2``, ...): the timm architecture and constructor
arguments their model cards give, and the preprocessing the cards feed them (``Preset.preprocessing``); the weights
come from ``--weights`` (each card's own download, saved as a state dict). docs/your-own-model.md lists them with their
sources."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .model_args import ModelArgs, parse_model_args
from .normalize import IMAGENET, Normalization

CARD_SIDE = 224            # every preset's card feeds 224 x 224 tiles
# H-optimus-0's own statistics, as its card's transform writes them (https://huggingface.co/bioptimus/H-optimus-0)
H_OPTIMUS_0 = Normalization((0.707223, 0.578729, 0.703617), (0.211883, 0.230117, 0.177517))


@dataclass(frozen=True)
class Preprocessing:
    """What a model card feeds its encoder: ``input_size`` x ``input_size`` tiles (``patch_size`` px patches) of
    pixels in [0, 1], normalised ``(x - mean) / std`` by ``normalization``; ``card`` is where it is written."""

    normalization: Normalization
    input_size: int
    patch_size: int
    card: str

    def override_note(self, applied: Normalization | None) -> str | None:
        """The line saying ``--normalize`` replaced the card's mean and std (None when ``applied`` is the card's)."""
        if applied is not None and (applied.mean, applied.std) == (self.normalization.mean, self.normalization.std):
            return None
        given = "none (pixels in [0, 1])" if applied is None else applied.describe()
        return (f"--normalize {given} overrides the card's {self.normalization.describe()} ({self.card}); the "
                f"pretrained trunk was trained on the card's")

    def to_dict(self) -> dict[str, object]:
        return {"normalize": self.normalization.to_dict(), "input_size": self.input_size,
                "patch_size": self.patch_size, "card": self.card}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Preprocessing:
        """The preprocessing ``to_dict`` wrote; ValueError naming a bad field."""
        normal, side, patch, card = (data.get(k) for k in ("normalize", "input_size", "patch_size", "card"))
        if not isinstance(normal, Mapping) or not all(isinstance(k, str) for k in normal):
            raise ValueError(f"field 'preprocessing.normalize': expected a mapping, got {normal!r}")
        if not (isinstance(side, int) and isinstance(patch, int) and isinstance(card, str)):
            raise ValueError(f"field 'preprocessing': expected whole input_size and patch_size and a card, got "
                             f"{side!r}, {patch!r}, {card!r}")
        return cls(Normalization.from_dict(normal), side, patch, card)


@dataclass(frozen=True)
class Preset:
    """A published tile encoder: timm's ``architecture`` built with ``args``, as the model card at ``card`` does, fed
    as ``preprocessing`` says (the card's mean, std, input size and patch)."""

    name: str
    architecture: str
    args: ModelArgs
    card: str
    preprocessing: Preprocessing

    @property
    def model(self) -> str:
        """What ``--model`` would be without the preset: ``timm:NAME``."""
        return f"timm:{self.architecture}"


def _preset(name: str, architecture: str, args: str, card: str, patch: int,
            normalization: Normalization = IMAGENET) -> Preset:
    return Preset(name, architecture, parse_model_args(args), card,
                  Preprocessing(normalization, CARD_SIDE, patch, card))


PRESETS: dict[str, Preset] = {p.name: p for p in (
    _preset("uni", "vit_large_patch16_224", "init_values=1e-5", "https://huggingface.co/MahmoodLab/UNI", 16),
    _preset("uni2-h", "vit_huge_patch14_224",
            "patch_size=14,depth=24,num_heads=24,embed_dim=1536,init_values=1e-5,mlp_ratio=5.33334,"
            "no_embed_class=true,mlp_layer=swiglu_packed,act_layer=silu,reg_tokens=8",
            "https://huggingface.co/MahmoodLab/UNI2-h", 14),
    _preset("virchow2", "vit_huge_patch14_224",
            "mlp_layer=swiglu_packed,act_layer=silu,reg_tokens=4,init_values=1e-5,mlp_ratio=5.3375",
            "https://huggingface.co/paige-ai/Virchow2", 14),
    _preset("gigapath-tile", "vit_giant_patch14_dinov2",
            "patch_size=16,embed_dim=1536,depth=40,num_heads=24,init_values=1e-5,mlp_ratio=5.33334",
            "https://huggingface.co/prov-gigapath/prov-gigapath", 16),
    _preset("h-optimus-0", "vit_giant_patch14_reg4_dinov2", "init_values=1e-5",
            "https://huggingface.co/bioptimus/H-optimus-0", 14, H_OPTIMUS_0),
    _preset("phikon-v2", "vit_large_patch16_224", "init_values=1e-5", "https://huggingface.co/owkin/phikon-v2", 16),
)}


def preset_named(text: str) -> Preset | None:
    """The preset ``--model`` names (any case), or None."""
    return PRESETS.get(str(text).strip().lower())
