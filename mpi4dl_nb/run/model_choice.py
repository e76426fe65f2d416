"""The model flags: ModelChoice (train's ``--model``, sizes, ``--weights``, ``--normalize``, ``--pool``, U-Net layers),
checked together, and the ModelSpec it names once the classes are known; ModelCheck (evaluate's: a checkpoint must
hold the model they name)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..models.external import pretrained_normalization
from ..models.lora import DEFAULT_ALPHA, DEFAULT_TARGETS, TARGETS, LoraSpec, parse_targets
from ..models.model_args import ModelArgs
from ..models.normalize import Normalization
from ..models.options import AT_LEAST_ONE, MODEL, MODEL_ARGS, NUM_CLASSES, NUM_FILTERS, NUM_LAYERS
from ..models.options import MODEL_HELP as MODEL_HELP
from ..models.pools import PoolKind
from ..models.presets import preset_named
from ..models.resnet import version_for_depth
from ..models.slide_encoder import DEFAULT_HEADS, DEFAULT_LAYERS, SlideEncoderKind, SlideEncoderSpec
from ..models.spec import ENCODED, ModelFamily, ModelSpec, split_model
from ..models.unet import UNetNorm, Upsampling
from ..schema import Bounds, check_bounds, flag, number, whole_number
from . import flag_groups as groups

if TYPE_CHECKING:
    from ..checkpoint.record import RunRecord

VERSION_HELP = ("ResNet v1 (basic blocks, depth 6n+2) or v2 (bottlenecks, 9n+2); default v2, or v1 for a depth "
                "only v1 has (8, 14, 26, ...)")
AUTO = "auto"
TARGET_NAMES = ", ".join(f"{name} ({path})" for name, path in TARGETS.items())


@dataclass(frozen=True)
class ModelSizes:
    """The sizes of this project's families: ``--resnet-version``, ``--num-layers``, ``--num-filters`` (None: the
    family's default)."""

    resnet_version: int | None = flag("--resnet-version", VERSION_HELP, None, parse=int, choices=("1", "2"),
                                      group=groups.MODEL)
    num_layers: int | None = NUM_LAYERS.field(None, group=groups.MODEL)
    num_filters: int | None = NUM_FILTERS.field(None, group=groups.MODEL)

    def __post_init__(self) -> None:
        check_bounds(self)

    def given(self) -> tuple[tuple[str, str, int], ...]:
        """(flag, ModelSpec field, value) of each size given."""
        return tuple((flag, key, value) for flag, key, value in (
            ("--resnet-version", "resnet_version", self.resnet_version), ("--num-layers", "num_layers",
                                                                          self.num_layers),
            ("--num-filters", "num_filters", self.num_filters)) if value is not None)


@dataclass(frozen=True)
class SlideEncoderChoice:
    """``--slide-encoder transformer`` with its ``--slide-encoder-layers`` and ``--slide-encoder-heads`` (None: no
    encoder; the sizes None: their defaults), transformer layers between the trunk and the head's pool."""

    kind: SlideEncoderKind | None = flag(
        "--slide-encoder", "transformer layers over the trunk's cells before the head's pool (resnet, amoebanet; a "
                           "timm ViT: its patch tokens): each cell a token with its 2-D position in the whole grid, a "
                           "learned class token; the classifier reads the class token beside --pool's pool of the "
                           "encoded cells; runs on a layer rank (keep --split-size above --spatial-size) or one "
                           "process", None,
        parse=SlideEncoderKind, choices=SlideEncoderKind.values(), group=groups.MODEL)
    layers: int | None = flag("--slide-encoder-layers", f"transformer blocks of --slide-encoder (default "
                                                        f"{DEFAULT_LAYERS})", None, parse=whole_number,
                              bounds=AT_LEAST_ONE, group=groups.MODEL)
    heads: int | None = flag("--slide-encoder-heads", f"attention heads of --slide-encoder (default {DEFAULT_HEADS}; "
                                                      f"they must divide the trunk's output channels)", None,
                             parse=whole_number, bounds=AT_LEAST_ONE, group=groups.MODEL)

    def __post_init__(self) -> None:
        check_bounds(self)
        for flag_name, value in (("--slide-encoder-layers", self.layers), ("--slide-encoder-heads", self.heads)):
            if value is not None and self.kind is None:
                raise ConfigError(flag_name, f"sizes the slide encoder: add --slide-encoder transformer, or drop "
                                             f"{flag_name}")

    def spec(self) -> SlideEncoderSpec | None:
        """The encoder these flags name (None: none)."""
        if self.kind is None:
            return None
        return SlideEncoderSpec(self.layers or DEFAULT_LAYERS, self.heads or DEFAULT_HEADS, self.kind)


@dataclass(frozen=True)
class LoraChoice:
    """``--lora-rank R`` with its ``--lora-alpha`` and ``--lora-targets`` (None: no adapters; alpha and targets None:
    their defaults): low-rank adapters on a ViT's blocks, the rest frozen but the head."""

    rank: int | None = flag("--lora-rank", "LoRA: low-rank adapters of rank R on the linear layers of a vision "
                                           "transformer's blocks (--lora-targets); only the adapters and the head "
                                           "(final norm, classifier) train, the rest frozen; recorded in the "
                                           "checkpoint (evaluate, infer and export rebuild them; export "
                                           "--merge-lora folds them into the weights)", None, parse=whole_number,
                            bounds=Bounds(1), metavar="R", group=groups.MODEL)
    alpha: float | None = flag("--lora-alpha", f"LoRA: the adapters' scale is alpha / rank (default "
                                               f"{DEFAULT_ALPHA:g}, peft's)", None, parse=number,
                               bounds=Bounds(0, closed=False), metavar="A", group=groups.MODEL)
    targets: tuple[str, ...] | None = flag("--lora-targets", f"LoRA: the linear layers of each block that take "
                                                             f"adapters: {TARGET_NAMES} or paths inside a block "
                                                             f"(default all four)", None,
                                           parse=parse_targets, metavar=",".join(TARGETS), group=groups.MODEL)

    def __post_init__(self) -> None:
        check_bounds(self)
        for flag_name, value in (("--lora-alpha", self.alpha), ("--lora-targets", self.targets)):
            if value is not None and self.rank is None:
                raise ConfigError(flag_name, f"sets LoRA's adapters: add --lora-rank R, or drop {flag_name}")
        self.spec()

    def spec(self) -> LoraSpec | None:
        """The adapters these flags name (None: none)."""
        if self.rank is None:
            return None
        return LoraSpec(self.rank, DEFAULT_ALPHA if self.alpha is None else self.alpha,
                        DEFAULT_TARGETS if self.targets is None else self.targets)


@dataclass(frozen=True)
class ModelChoice:
    """The network ``train`` builds: a family (sized) or a named model, the weights it starts from, the input
    normalisation they expect, the classifier's pool, a U-Net's layers."""

    model: str = MODEL.field("resnet", group=groups.MODEL)
    model_args: ModelArgs = MODEL_ARGS.field(ModelArgs(), default_text="none", group=groups.MODEL)
    sizes: ModelSizes = field(default_factory=ModelSizes)
    weights: str | None = flag("--weights", "start from this state dict of the original model "
                                            "(torch.save(model.state_dict())); a classifier for another number of "
                                            "classes is replaced by a new one for --num-classes", None,
                               metavar="PATH", group=groups.MODEL)
    normalize: str = flag("--normalize", "normalise the images as the weights expect, (x - mean) / std per channel, "
                                         "as the model's first step (recorded; evaluate and infer apply it too); "
                                         "auto: a foundation model's card's (--model uni, virchow2, ...: "
                                         "ImageNet's, H-optimus-0's own); with --weights, ImageNet's for "
                                         "torchvision models, the model's own for timm models; else none; given "
                                         "with a foundation model, it overrides the card's (said in one line)",
                          AUTO,
                          metavar="imagenet|none|M,S|M1,..,S1,..", group=groups.MODEL)
    pool: PoolKind = flag("--pool", "the classifier head's global pool (a named model's global average pool "
                                    "replaced): avg; max (per channel over every position); tissue-mean (over the "
                                    "positions the input's last channel, a tissue mask, marks; resnet, amoebanet "
                                    "only); attention (gated attention-MIL); exact on tiles", PoolKind.AVG,
                          parse=PoolKind, choices=PoolKind.values(), group=groups.MODEL)
    norm: str | None = flag("--norm", "U-Net: BatchNorm or GroupNorm after each convolution (default batch)", None,
                            choices=UNetNorm.values(), group=groups.MODEL)
    upsampling: str | None = flag("--upsampling", "U-Net: bilinear up-sampling or 2x2 transposed convolutions "
                                                  "(default bilinear)", None, choices=Upsampling.values(),
                                  group=groups.MODEL)
    slide_encoder: SlideEncoderChoice = field(default_factory=SlideEncoderChoice)
    train_blocks: int | None = flag("--train-blocks", "fine-tune a vision transformer as foundation models are: "
                                                      "train only its last K blocks, the final norm and the head "
                                                      "(0: the norm and head alone), the rest frozen; default: "
                                                      "train everything", None, parse=whole_number,
                                    bounds=Bounds(0), metavar="K", group=groups.MODEL)
    lora: LoraChoice = field(default_factory=LoraChoice)

    def __post_init__(self) -> None:
        family, _ = split_model(self.model)
        if self.model_args and not family.named:
            raise ConfigError("--model-args", f"passes keyword arguments to a named model's constructor (timm:NAME, "
                                              f"torchvision:NAME, package.module:callable, a foundation model); "
                                              f"--model {self.model} is sized by --num-layers and --num-filters: "
                                              f"drop --model-args")
        if family.named:
            for flag_name, value in (("--num-layers", self.sizes.num_layers), ("--num-filters",
                                                                               self.sizes.num_filters)):
                if value is not None:
                    raise ConfigError(flag_name, f"sizes this project's resnet/amoebanet/unet; {self.model} has its "
                                                 f"own (drop {flag_name})")
        elif self.normalize not in (AUTO, "none"):
            raise ConfigError("--normalize", f"applies to named models (torchvision:, timm:, package.module:callable); "
                                             f"--model {self.model} takes pixels in [0, 1]: drop --normalize")
        if self.normalize != AUTO:
            Normalization.parse(self.normalize)
        check_bounds(self)
        if self.train_blocks is not None and not family.named:
            raise ConfigError("--train-blocks", f"freezes all but the last blocks of a vision transformer; --model "
                                                f"{self.model} has none (a timm ViT: --model "
                                                f"timm:vit_small_patch16_224): drop --train-blocks")
        if self.lora.rank is not None and not family.named:
            raise ConfigError("--lora-rank", f"puts adapters on a vision transformer's blocks; --model {self.model} "
                                             f"has none (a timm ViT: --model timm:vit_small_patch16_224): drop "
                                             f"--lora-rank")
        if self.lora.rank is not None and self.train_blocks is not None:
            raise ConfigError("--train-blocks", "and --lora-rank both choose what trains (LoRA: the adapters and the "
                                                "head, every block's weights frozen): drop one of them")
        for flag_name, layer in (("--norm", self.norm), ("--upsampling", self.upsampling)):
            if layer is not None and family is ModelFamily.SWINUNETR3D:
                raise ConfigError(flag_name, f"sets a U-Net's layers; --model {self.model} has its own "
                                             f"(InstanceNorm3d, transposed convolutions): drop {flag_name}")
        if self.pool is not PoolKind.AVG and family.dense:
            raise ConfigError("--pool", f"--pool {self.pool} replaces a classifier's global pool; --model {self.model} "
                                        f"outputs a class per pixel and pools nothing: drop --pool")
        if self.pool.tissue and family.named:
            raise ConfigError("--pool", f"--pool tissue-mean needs the tissue mask carried through the trunk, which "
                                        f"only this project's classifiers do (--model resnet or amoebanet); --model "
                                        f"{self.model} takes --pool max or attention (its global average pool "
                                        f"replaced)")
        if self.slide_encoder.kind is not None and family not in ENCODED:
            raise ConfigError("--slide-encoder", f"goes between a trunk's grid of cells or patch tokens and the "
                                                 f"classifier: after --model resnet or amoebanet, or a timm ViT "
                                                 f"(timm:vit_small_patch16_224; a torchvision model, a U-Net or a "
                                                 f"3-D model takes none); --model {self.model}: use one of those, or "
                                                 f"drop --slide-encoder")

    @property
    def family(self) -> ModelFamily:
        return split_model(self.model)[0]

    def normalization(self) -> Normalization | None:
        """The normalisation ``--normalize`` names (``auto`` resolved against ``--model`` and ``--weights``)."""
        family, source = split_model(self.model)
        preset = preset_named(self.model)
        if self.normalize == AUTO and preset is not None:
            return preset.preprocessing.normalization       # the card's, with or without --weights
        if self.normalize == AUTO:
            if self.weights is None or not family.named:
                return None
            return pretrained_normalization(str(family), source or "")
        return Normalization.parse(self.normalize)

    def normalization_line(self) -> str:
        """The line train prints of the input normalisation it applies: mean, std and where they come from."""
        family, source = split_model(self.model)
        preset, applied = preset_named(self.model), self.normalization()
        origin = (f"--normalize {self.normalize}" if self.normalize != AUTO else f"the card's ({preset.card})"
                  if preset is not None else "--normalize auto without --weights: nothing to match"
                  if self.weights is None or not family.named else "--normalize auto with --weights: " + (
                      "ImageNet's, as torchvision's weights expect" if str(family) == "torchvision" else
                      f"timm's pretrained_cfg of {source}" if str(family) == "timm" else "none for a callable's"))
        if applied is None:
            return f"input not normalised, pixels in [0, 1] ({origin})"
        mean, std = (", ".join(f"{v:g}" for v in values) for values in (applied.mean, applied.std))
        return f"input normalised as (x - mean) / std with mean ({mean}), std ({std}): {origin}"

    def resolved_normalize(self) -> str:
        """``--normalize`` as it resolved, the text that gives the same back (a run's config.toml records it)."""
        applied = self.normalization()
        return "none" if applied is None else applied.name or ",".join(map(repr, (*applied.mean, *applied.std)))

    def spec(self, num_classes: int, in_channels: int = 3, image_size: int | None = None) -> ModelSpec:
        """The network these flags name for ``num_classes`` classes of ``in_channels``-channel images (family
        defaults for the sizes not given; a named model built for ``image_size``)."""
        sizes = self.sizes
        return ModelSpec.of(self.model, num_layers=sizes.num_layers, num_filters=sizes.num_filters,
                            num_classes=num_classes,
                            resnet_version=version_for_depth(sizes.num_layers, sizes.resnet_version),
                            in_channels=in_channels, norm=self.norm, upsampling=self.upsampling,
                            normalize=self.normalization(), weights=self.weights, pool=self.pool,
                            slide_encoder=self.slide_encoder.spec(), train_blocks=self.train_blocks,
                            image_size=image_size, model_args=self.model_args, lora=self.lora.spec())


@dataclass(frozen=True)
class ModelCheck:
    """``evaluate``'s model flags: the checkpoint must hold this network (``--model``; checked as it loads) of these
    sizes and classes (None: any)."""

    model: str | None = MODEL.field(None, default_text="the checkpoint's", group=groups.MODEL)
    sizes: ModelSizes = field(default_factory=ModelSizes)
    num_classes: int | None = NUM_CLASSES.field(None, default_text="the checkpoint's", group=groups.MODEL)

    def __post_init__(self) -> None:
        check_bounds(self)

    def check(self, record: RunRecord, where: str) -> None:
        """ConfigError when a size or class count given names another model than the checkpoint's."""
        saved = record.model.to_dict()
        given = (*self.sizes.given(), *((("--num-classes", "num_classes", self.num_classes),)
                                        if self.num_classes is not None else ()))
        for flag_name, key, wanted in given:
            if saved.get(key) is not None and wanted != saved[key]:
                raise ConfigError(flag_name, f"{where} holds a checkpoint of another model ({key} {saved[key]!r}, "
                                             f"not {wanted!r}); drop {flag_name} or pass a checkpoint of that model")

