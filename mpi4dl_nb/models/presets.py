"""Pathology foundation models by name (``--model uni``, ``virchow2``, ...): the timm architecture and constructor
arguments their model cards give; the weights come from ``--weights`` (each card's own download, saved as a state
dict). docs/your-own-model.md lists them with their sources."""
from __future__ import annotations

from dataclasses import dataclass

from .model_args import ModelArgs, parse_model_args


@dataclass(frozen=True)
class Preset:
    """A published tile encoder: timm's ``architecture`` built with ``args``, as the model card at ``card`` does."""

    name: str
    architecture: str
    args: ModelArgs
    card: str

    @property
    def model(self) -> str:
        """What ``--model`` would be without the preset: ``timm:NAME``."""
        return f"timm:{self.architecture}"


def _preset(name: str, architecture: str, args: str, card: str) -> Preset:
    return Preset(name, architecture, parse_model_args(args), card)


PRESETS: dict[str, Preset] = {p.name: p for p in (
    _preset("uni", "vit_large_patch16_224", "init_values=1e-5", "https://huggingface.co/MahmoodLab/UNI"),
    _preset("uni2-h", "vit_huge_patch14_224",
            "patch_size=14,depth=24,num_heads=24,embed_dim=1536,init_values=1e-5,mlp_ratio=5.33334,"
            "no_embed_class=true,mlp_layer=swiglu_packed,act_layer=silu,reg_tokens=8",
            "https://huggingface.co/MahmoodLab/UNI2-h"),
    _preset("virchow2", "vit_huge_patch14_224",
            "mlp_layer=swiglu_packed,act_layer=silu,reg_tokens=4,init_values=1e-5,mlp_ratio=5.3375",
            "https://huggingface.co/paige-ai/Virchow2"),
    _preset("gigapath-tile", "vit_giant_patch14_dinov2",
            "patch_size=16,embed_dim=1536,depth=40,num_heads=24,init_values=1e-5,mlp_ratio=5.33334",
            "https://huggingface.co/prov-gigapath/prov-gigapath"),
    _preset("h-optimus-0", "vit_giant_patch14_reg4_dinov2", "init_values=1e-5",
            "https://huggingface.co/bioptimus/H-optimus-0"),
    _preset("phikon-v2", "vit_large_patch16_224", "init_values=1e-5", "https://huggingface.co/owkin/phikon-v2"),
)}


def preset_named(text: str) -> Preset | None:
    """The preset ``--model`` names (any case), or None."""
    return PRESETS.get(str(text).strip().lower())
