"""ModelSpec: which network a run builds (family and sizes), built alike on every rank and stored in checkpoints."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from ..config import Choice
from ..errors import ConfigError
from .build import DEFAULT_NUM_FILTERS, DEFAULT_NUM_LAYERS, build_model, image_multiple
from .external import external_layers
from .lora import LoraSpec, add_adapters
from .model_args import NO_ARGS, ModelArgs
from .named_pool import with_named_pool
from .normalize import Normalization
from .pools import PoolKind
from .presets import PRESETS, Preprocessing, preset_named
from .slide_encoder import SlideEncoderSpec
from .token_grid import with_token_grid
from .vit import is_cut_vit


class ModelFamily(Choice):
    """The model families ``build_model`` knows (``--model``)."""

    RESNET = "resnet"
    AMOEBANET = "amoebanet"
    UNET = "unet"          # dense: per-pixel logits as large as the input (--task segmentation)
    UNET3D = "unet3d"      # dense on volumes (N, C, D, H, W): per-voxel logits (--image-size D,H,W)
    RESNET3D = "resnet3d"  # volumes (N, C, D, H, W): a 3-D ResNet trunk and a global-pool head (models/resnet3d.py)
    SWINUNETR3D = "swinunetr3d"   # dense on volumes: 3-D Swin encoder, conv decoder (models/swinunetr3d.py)
    TORCHVISION = "torchvision"   # torchvision:NAME, cut into pieces by models/cut.py (ModelSpec.source: NAME)
    TIMM = "timm"                 # timm:NAME
    MODULE = "module"             # package.module:callable (source): an nn.Module (cut) or a layer list
    PYTHON = "python"             # a model object built in Python (source: its class): rebuilt from that object

    @classmethod
    def parse(cls, text: str) -> ModelFamily:
        """``"resnet"`` (any case) -> ``ModelFamily.RESNET``, ``"timm:NAME"`` -> ``TIMM``; ValueError naming the
        families."""
        if ":" in str(text) or preset_named(text) is not None:
            return split_model(text)[0]
        try:
            return cls(str(text).strip().lower())
        except ValueError:
            raise ValueError(f"unknown model {text!r}; {FORMS}") from None

    @property
    def named(self) -> bool:
        """Whether the family's model comes from elsewhere by a name (``ModelSpec.source``), not from its sizes."""
        return self in NAMED

    @property
    def dense(self) -> bool:
        """Whether the family outputs a class map as large as its input (segmentation), not one per image."""
        return self in (ModelFamily.UNET, ModelFamily.UNET3D, ModelFamily.SWINUNETR3D)

    @property
    def unet(self) -> bool:
        """Whether the family is a U-Net, whose layers ``--norm`` and ``--upsampling`` choose."""
        return self in (ModelFamily.UNET, ModelFamily.UNET3D)

    @property
    def volumetric(self) -> bool:
        """Whether the family takes volumes (N, C, D, H, W) rather than images."""
        return self in (ModelFamily.UNET3D, ModelFamily.RESNET3D, ModelFamily.SWINUNETR3D)

    @property
    def versioned(self) -> bool:
        """Whether the family comes in versions (ResNet v1/v2)."""
        return self is ModelFamily.RESNET


@dataclass(frozen=True)
class ModelSpec:
    """Which network to build: its ``family`` and sizes (``build_model``'s arguments, defaults resolved).

    A checkpoint stores it as a plain dict (``to_dict``/``from_dict``). A field added later needs a
    default, so that files written before it still read; keys a reader does not know are ignored.
    """

    family: ModelFamily
    num_layers: int
    num_filters: int
    num_classes: int = 10
    resnet_version: int | None = None      # ResNet only (1 or 2); None for the other families
    in_channels: int = 3
    norm: str | None = None                # U-Net only: 'batch' or 'group'
    upsampling: str | None = None          # U-Net only: 'bilinear' or 'transposed'
    source: str | None = None              # named families: torchvision/timm model name, package.module:callable
    normalize: Normalization | None = None   # the input normalisation the model starts with (named families)
    weights: str | None = None             # the pretrained weights file the run started from (provenance only)
    pool: PoolKind = PoolKind.AVG          # the classifier head's global pool (--pool); tissue-mean: +1 input channel
    slide_encoder: SlideEncoderSpec | None = None   # transformer layers before the head's pool (--slide-encoder)
    train_blocks: int | None = None        # a ViT fine-tuned in its last blocks only (--train-blocks; None: all)
    image_size: int | None = None          # named: the side it was built for (a ViT's token grid; None: its default)
    model_args: ModelArgs = ModelArgs()    # named: its constructor's keyword arguments (--model-args, a preset's)
    lora: LoraSpec | None = None           # a ViT's blocks with low-rank adapters, the rest frozen (--lora-rank)
    preprocessing: Preprocessing | None = None   # a preset's card's (mean, std, input size, patch; None: no preset)

    @classmethod
    def of(cls, family: ModelFamily | str = ModelFamily.RESNET, *, num_layers: int | None = None,
           num_filters: int | None = None, num_classes: int = 10, resnet_version: int = 2,
           in_channels: int = 3, norm: str | None = None, upsampling: str | None = None,
           normalize: Normalization | None = None, weights: str | None = None,
           pool: PoolKind | str = PoolKind.AVG, slide_encoder: SlideEncoderSpec | None = None,
           train_blocks: int | None = None, image_size: int | None = None,
           model_args: ModelArgs = NO_ARGS, lora: LoraSpec | None = None) -> ModelSpec:
        """``family`` with its default depth and width where not given (the version kept for ResNet only, the
        norm and up-sampling for the U-Net only: default 'batch' and 'bilinear'). ``family`` may name a model
        (``torchvision:resnet50``, ``timm:NAME``, ``package.module:callable``): it has no sizes, it may start with
        a ``normalize`` step and record the ``weights`` file it started from. ``pool`` (the head's global pool)
        other than average: any classifier (a named one's global average pool is replaced, ``models/named_pool.py``);
        tissue-mean: ResNet and AmoebaNet only (ValueError naming them). ``slide_encoder``: transformer layers over the
        trunk's cells before the pool, ResNet and AmoebaNet only. ``train_blocks``: a named ViT trains its
        last blocks only (``models/vit.train_last_blocks``, applied by the run); ``image_size``: the side a named model
        is built for when ``build`` is given none (a ViT's position embeddings' grid: evaluate rebuilds it so).
        ``model_args``: a named model's constructor arguments (a preset's, ``--model virchow2``, under them).
        ``lora``: a named ViT's blocks with low-rank adapters (``models/lora.py``), added by ``build``."""
        kind, source = (family, None) if isinstance(family, ModelFamily) else split_model(family)
        preset = None if isinstance(family, ModelFamily) else preset_named(family)
        if preset is not None:
            model_args = preset.args.merged(model_args)
        if model_args and not kind.named:
            raise ValueError(f"--model-args: constructor arguments of a named model (timm:NAME, torchvision:NAME, "
                             f"package.module:callable); a {kind} is sized by --num-layers and --num-filters")
        pooling = PoolKind(pool)
        if pooling is not PoolKind.AVG and kind.dense:
            raise ValueError(f"--pool {pooling}: a {kind} outputs a class per pixel and pools nothing; --pool is for "
                             f"classifiers (use --pool avg)")
        if pooling.tissue and kind.named:
            raise ValueError(f"--pool {pooling}: only the built-in classifiers (--model resnet or amoebanet) carry "
                             f"the tissue mask through their trunk; a {kind} model takes --pool max or attention")
        if slide_encoder is not None and kind not in ENCODED:
            raise ValueError(f"--slide-encoder: goes after the trunk of the built-in classifiers (--model resnet or "
                             f"amoebanet) or of a timm ViT (timm:vit_small_patch16_224); a {kind} model takes none "
                             f"(drop --slide-encoder)")
        if kind.named:
            return cls(kind, 0, 0, num_classes, None, in_channels, source=source, normalize=normalize,
                       weights=weights, pool=pooling, slide_encoder=slide_encoder, train_blocks=train_blocks,
                       image_size=image_size, model_args=model_args, lora=lora,
                       preprocessing=None if preset is None else preset.preprocessing)
        if train_blocks is not None:
            raise ValueError(f"--train-blocks: a {kind} has no transformer blocks; it fine-tunes timm ViTs")
        if lora is not None:
            raise ValueError(f"--lora-rank: a {kind} has no transformer blocks; adapters go on timm ViTs")
        unet = kind.unet
        return cls(kind, DEFAULT_NUM_LAYERS[kind] if num_layers is None else num_layers,
                   DEFAULT_NUM_FILTERS[kind] if num_filters is None else num_filters, num_classes,
                   resnet_version if kind.versioned else None, in_channels,
                   (norm or "batch") if unet else None,
                   (upsampling or ("trilinear" if kind.volumetric else "bilinear")) if unet else None,
                   pool=pooling, slide_encoder=slide_encoder)

    @property
    def image_multiple(self) -> int:
        """Image sides must be multiples of this (the network's total downsampling; 1 for named models, whose
        ``build`` checks an image size by running it)."""
        return 1 if self.family.named else image_multiple(self.family, self.num_layers)

    @property
    def input_channels(self) -> int:
        """Channels of the network's input: the image's, and the tissue mask last for ``--pool tissue-mean``."""
        return self.in_channels + (1 if self.pool.tissue else 0)

    @property
    def label(self) -> str:
        """What ``--model`` calls it: ``resnet``, ``torchvision:resnet50``, ``package.module:callable``."""
        if not self.family.named:
            return str(self.family)
        return (self.source or "") if self.family is ModelFamily.MODULE else f"{self.family}:{self.source}"

    def build(self, image_size: int | tuple[int, ...] | None = None, adapters: bool = True) -> list[nn.Module]:
        """The layer list (torch's current seed draws the weights); ``image_size`` (a side, or a volume's (D, H, W))
        checked against the downsampling. ``adapters``: with the LoRA adapters of ``lora`` (drawn after the model;
        False: the plain model, for weights to load before ``with_adapters``)."""
        if self.family.named:
            if image_size is not None and not isinstance(image_size, int):
                raise ValueError(f"{self.label} takes images: give one image side, not {image_size}")
            side = image_size if image_size is not None else self.image_size
            layers = self.named_head(external_layers(str(self.family), self.source or "", self.num_classes,
                                                     self.in_channels, self.normalize, side, self.model_args))
            if adapters:
                self.with_adapters(layers)
            return layers
        return build_model(self.family, num_layers=self.num_layers, num_filters=self.num_filters,
                           num_classes=self.num_classes, version=self.resnet_version or 2,
                           in_channels=self.in_channels, image_size=image_size, norm=self.norm,
                           upsampling=self.upsampling, pool=self.pool, slide_encoder=self.slide_encoder)

    def with_adapters(self, layers: list[nn.Module]) -> str | None:
        """``lora``'s adapters added to ``layers`` (built with ``adapters=False``), the rest frozen but the head; the
        line saying what trains (None: no adapters)."""
        return None if self.lora is None else add_adapters(layers, self.lora, self.label)

    def named_head(self, layers: list[nn.Module]) -> list[nn.Module]:
        """A named model's layers with the head ``pool`` and ``slide_encoder`` ask for: a ViT's patch tokens as a map
        before a new classifier head (``models/token_grid.py``), or a CNN's average pool replaced
        (``models/named_pool.py``); ConfigError for a slide encoder after anything but a ViT."""
        if is_cut_vit(layers) and (self.pool is not PoolKind.AVG or self.slide_encoder is not None):
            return with_token_grid(layers, self.pool, self.slide_encoder, self.label)
        if self.slide_encoder is not None:
            raise ConfigError("--slide-encoder", f"{self.label} is not a ViT (timm's VisionTransformer or Eva, whose "
                                                 f"patch tokens form the slide's grid): its own classifier reads its "
                                                 f"pool; use a timm ViT, --model resnet or amoebanet, or drop "
                                                 f"--slide-encoder")
        return with_named_pool(layers, self.pool, self.label, self.in_channels)

    def describe(self) -> str:
        """``resnet v1 8 layers x 4 filters, 2 classes``."""
        version = f" v{self.resnet_version}" if self.resnet_version else ""
        channels = f", {self.in_channels} input channels" if self.in_channels != 3 else ""
        if self.family.named:
            start = f", from {self.weights}" if self.weights else ""
            normal = f", {self.normalize.describe()} normalisation" if self.normalize else ""
            pooled = f", {self.pool} pool" if self.pool is not PoolKind.AVG else ""
            tuned = f", last {self.train_blocks} blocks trained" if self.train_blocks is not None else ""
            encoded = f", {self.slide_encoder.describe()}" if self.slide_encoder is not None else ""
            built = f" ({self.model_args.text()})" if self.model_args else ""
            adapted = f", {self.lora.describe()}" if self.lora is not None else ""
            return (f"{self.label}{built}, {self.num_classes} classes{channels}{normal}{encoded}{pooled}{tuned}"
                    f"{adapted}{start}")
        if self.family is ModelFamily.SWINUNETR3D:
            return (f"{self.family} {self.num_layers} Swin stages, feature size {self.num_filters}, "
                    f"{self.num_classes} classes{channels}")
        if self.family.dense:
            return (f"{self.family} depth {self.num_layers} width {self.num_filters} ({self.norm} norm, "
                    f"{self.upsampling}), {self.num_classes} classes{channels}")
        pooled = f", {self.pool} pool" if self.pool is not PoolKind.AVG else ""
        encoded = f", {self.slide_encoder.describe()}" if self.slide_encoder is not None else ""
        return (f"{self.family}{version} {self.num_layers} layers x {self.num_filters} filters, "
                f"{self.num_classes} classes{channels}{encoded}{pooled}")

    def to_dict(self) -> dict[str, object]:
        """Plain values for a checkpoint (loadable with ``weights_only``) or JSON."""
        return {"family": str(self.family), "num_layers": self.num_layers, "num_filters": self.num_filters,
                "num_classes": self.num_classes, "resnet_version": self.resnet_version,
                "in_channels": self.in_channels, "norm": self.norm, "upsampling": self.upsampling,
                "source": self.source, "normalize": None if self.normalize is None else self.normalize.to_dict(),
                "weights": self.weights, "pool": str(self.pool),
                "slide_encoder": None if self.slide_encoder is None else self.slide_encoder.to_dict(),
                "train_blocks": self.train_blocks, "image_size": self.image_size,
                "model_args": self.model_args.to_dict(),
                "lora": None if self.lora is None else self.lora.to_dict(),
                "preprocessing": None if self.preprocessing is None else self.preprocessing.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> ModelSpec:
        """The spec ``to_dict`` wrote; ValueError naming a missing or mistyped field."""
        family = data.get("family")
        if not isinstance(family, str):
            raise ValueError(f"model field 'family': expected a name, got {family!r}")
        return cls(ModelFamily.parse(family), whole(data, "num_layers"), whole(data, "num_filters"),
                   whole(data, "num_classes"), optional_whole(data, "resnet_version"),
                   whole(data, "in_channels", 3), _optional_name(data, "norm"), _optional_name(data, "upsampling"),
                   _optional_name(data, "source"), normalization_of(data), _optional_name(data, "weights"),
                   pool_of(data), slide_encoder_of(data), optional_whole(data, "train_blocks"),
                   optional_whole(data, "image_size"), ModelArgs.from_dict(_optional_mapping(data, "model_args")),
                   lora_of(data), preprocessing_of(data))


NAMED = (ModelFamily.TORCHVISION, ModelFamily.TIMM, ModelFamily.MODULE, ModelFamily.PYTHON)
# a slide encoder goes after these trunks: the built-in classifiers', and a named model's when it is a ViT (checked as
# it is built: ModelSpec.named_head)
ENCODED = (ModelFamily.RESNET, ModelFamily.AMOEBANET, ModelFamily.TIMM, ModelFamily.MODULE)
FORMS = (f"choose one of {', '.join(f.value for f in ModelFamily if f not in NAMED)}, a foundation model "
         f"({', '.join(PRESETS)}), or torchvision:NAME, timm:NAME, package.module:callable")


def split_model(text: str) -> tuple[ModelFamily, str | None]:
    """``--model``: ``resnet`` -> (RESNET, None), ``torchvision:resnet50`` -> (TORCHVISION, ``resnet50``), ``timm:NAME``
    likewise, ``package.module:callable`` -> (MODULE, the whole text); ValueError naming the forms."""
    raw = str(text).strip()
    preset = preset_named(raw)
    if preset is not None:
        return ModelFamily.TIMM, preset.architecture
    prefix, sep, name = raw.partition(":")
    if not sep:
        family = ModelFamily.parse(raw)
        if family.named:
            raise ValueError(f"--model {family}: name the model ({family}:NAME); {FORMS}")
        return family, None
    if not name:
        raise ValueError(f"--model {text!r}: the name after ':' is missing; {FORMS}")
    library = next((f for f in NAMED if f.value == prefix.lower() and f is not ModelFamily.MODULE), None)
    return (library, name) if library is not None else (ModelFamily.MODULE, raw)


def parse_model_name(text: str) -> str:
    """``--model``'s text normalised: a family (``resnet``) or a named model (``torchvision:resnet50``,
    ``timm:NAME``, ``package.module:callable``) or a foundation model's preset (``virchow2``); ValueError naming
    the forms."""
    preset = preset_named(text)
    if preset is not None:
        return preset.name
    family, source = split_model(text)
    if not family.named:
        return str(family)
    return (source or "") if family is ModelFamily.MODULE else f"{family}:{source}"


def normalization_of(data: Mapping[str, object]) -> Normalization | None:
    """The ``normalize`` field ``to_dict`` wrote (None when missing)."""
    value = _optional_mapping(data, "normalize")
    return None if value is None else Normalization.from_dict(value)


def preprocessing_of(data: Mapping[str, object]) -> Preprocessing | None:
    """The ``preprocessing`` field ``to_dict`` wrote (None when missing: no preset, or checkpoints from before it)."""
    value = _optional_mapping(data, "preprocessing")
    return None if value is None else Preprocessing.from_dict(value)


def lora_of(data: Mapping[str, object]) -> LoraSpec | None:
    """The ``lora`` field ``to_dict`` wrote (None when missing: checkpoints from before it)."""
    value = _optional_mapping(data, "lora")
    return None if value is None else LoraSpec.from_dict(value)


def pool_of(data: Mapping[str, object]) -> PoolKind:
    """The ``pool`` field ``to_dict`` wrote (average when missing: checkpoints from before it)."""
    value = _optional_name(data, "pool")
    try:
        return PoolKind(value or PoolKind.AVG)
    except ValueError:
        raise ValueError(f"field 'pool': {value!r} is not one of {', '.join(PoolKind.values())}") from None


def slide_encoder_of(data: Mapping[str, object]) -> SlideEncoderSpec | None:
    """The ``slide_encoder`` field ``to_dict`` wrote (None when missing: checkpoints from before it)."""
    value = _optional_mapping(data, "slide_encoder")
    return None if value is None else SlideEncoderSpec.from_dict(value)


def _optional_mapping(data: Mapping[str, object], key: str) -> Mapping[str, object] | None:
    """The mapping field ``key`` (None when missing); ValueError naming it when it is something else."""
    value = data.get(key)
    if value is not None and not isinstance(value, Mapping):
        raise ValueError(f"field {key!r}: expected a mapping, got {value!r}")
    return value


def _optional_name(data: Mapping[str, object], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"field {key!r}: expected a name, got {value!r}")
    return value


def optional_whole(data: Mapping[str, object], key: str) -> int | None:
    """``data[key]`` as an integer (None when missing or None); ValueError for another type."""
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"field {key!r}: expected an integer, got {value!r}")
    return value


def whole(data: Mapping[str, object], key: str, default: int | None = None) -> int:
    """``data[key]`` as an integer (``default`` when missing); ValueError naming ``key`` otherwise."""
    value = optional_whole(data, key)
    if value is None:
        value = default
    if value is None:
        raise ValueError(f"field {key!r} is missing")
    return value
