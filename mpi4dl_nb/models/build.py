"""``build_model``: a model family's layer list from its sizes, and each family's defaults and image multiple."""
from __future__ import annotations

from torch import nn

from .amoebanet import IMAGE_MULTIPLE as AMOEBANET_IMAGE_MULTIPLE
from .amoebanet import amoebanet
from .head import ClassifierHead
from .pools import PoolKind
from .resnet import resnet
from .resnet3d import DEPTH as RESNET3D_DEPTH
from .resnet3d import WIDTH as RESNET3D_WIDTH
from .resnet3d import resnet3d, resnet3d_multiple
from .slide_encoder import SlideEncoderSpec
from .swinunetr3d import FEATURE as SWINUNETR3D_FEATURE
from .swinunetr3d import STAGES as SWINUNETR3D_STAGES
from .swinunetr3d import check_windows, swinunetr3d, swinunetr3d_multiple
from .tissue import carry_tissue
from .unet import unet
from .unet3d import DEPTH as UNET3D_DEPTH
from .unet3d import WIDTH as UNET3D_WIDTH
from .unet3d import unet3d

MODEL_NAMES = ("resnet", "amoebanet", "unet", "unet3d", "resnet3d", "swinunetr3d")
DENSE_MODELS = ("unet", "unet3d")   # a class per pixel (voxel): levels of 2x downsampling, no head pool
RESNET_IMAGE_MULTIPLE = 4  # two stride-2 stages
DEFAULT_NUM_LAYERS = {"resnet": 110, "amoebanet": 18, "unet": 4,       # U-Net: depth (levels)
                      "unet3d": UNET3D_DEPTH, "resnet3d": RESNET3D_DEPTH,
                      "swinunetr3d": SWINUNETR3D_STAGES}     # Swin-UNETR: Swin stages
DEFAULT_NUM_FILTERS = {"resnet": 16, "amoebanet": 416, "unet": 16,     # U-Net: channels of the first level
                       "unet3d": UNET3D_WIDTH, "resnet3d": RESNET3D_WIDTH,
                       "swinunetr3d": SWINUNETR3D_FEATURE}   # Swin-UNETR: channels after the patch embedding
IMAGE_MULTIPLES = {"resnet": RESNET_IMAGE_MULTIPLE, "amoebanet": AMOEBANET_IMAGE_MULTIPLE,
                   "resnet3d": resnet3d_multiple()}


VOLUME_MODELS = ("unet3d", "resnet3d", "swinunetr3d")   # take (N, C, D, H, W)
ENCODED_MODELS = ("resnet", "amoebanet")  # a ClassifierHead over a 2-D grid: a slide encoder fits before its pool


def image_multiple(name: str, num_layers: int | None = None) -> int:
    """Images given to model ``name`` (a U-Net: of depth ``num_layers``) must have sides divisible by this."""
    if name in DENSE_MODELS:
        return 2 ** (DEFAULT_NUM_LAYERS[name] if num_layers is None else num_layers)
    if name == "swinunetr3d":
        return swinunetr3d_multiple(DEFAULT_NUM_LAYERS[name] if num_layers is None else num_layers)
    return IMAGE_MULTIPLES[name]


def build_model(name: str, *, num_layers: int | None = None, num_filters: int | None = None,
                num_classes: int = 10, version: int = 2, in_channels: int = 3,
                image_size: int | tuple[int, ...] | None = None, norm: str | None = None,
                upsampling: str | None = None, pool: PoolKind = PoolKind.AVG,
                slide_encoder: SlideEncoderSpec | None = None) -> list[nn.Module]:
    """Build model ``name`` as a list of splittable layers.

    ResNet: ``num_layers`` is the depth (v1 6n+2, v2 9n+2; default 110), ``num_filters`` the
    base width (default 16). AmoebaNet-D: ``num_layers`` normal cells (multiple of 3; default 18),
    ``num_filters`` (default 416). U-Net: ``num_layers`` levels (default 4), ``num_filters`` channels
    at the first level (default 16), ``norm`` 'batch'/'group', ``upsampling`` 'bilinear'/'transposed'
    (``models/unet.py``). ``unet3d``: the 3-D U-Net on volumes (N, C, D, H, W) (``models/unet3d.py``; default 2
    levels of 8 filters, ``upsampling`` 'trilinear'/'transposed'). ``resnet3d``: the 3-D ResNet trunk on volumes
    (``models/resnet3d.py``; ``num_layers`` 10, 18 (default) or 34, 8 filters, average pool only). ``swinunetr3d``:
    the Swin-UNETR-style network on volumes (``models/swinunetr3d.py``; ``num_layers`` Swin stages, default 2,
    ``num_filters`` the feature size, default 12, a multiple of 3; its windows checked against ``image_size``).
    ``image_size`` (optional: a side, or a volume's (D, H, W)) is checked against the downsampling, every side.
    ``pool``: the classifier head's global pool (``with_pool``); ``slide_encoder``: transformer layers over the
    trunk's cells before it (resnet and amoebanet only).
    """
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    if slide_encoder is not None and name not in ENCODED_MODELS:
        raise ValueError(f"--slide-encoder: {name} has no classifier head over a 2-D feature grid; the slide encoder "
                         f"is for {' and '.join(ENCODED_MODELS)}")
    layers_arg = DEFAULT_NUM_LAYERS[name] if num_layers is None else num_layers
    filters = DEFAULT_NUM_FILTERS[name] if num_filters is None else num_filters
    if image_size is not None:
        check_sides(name, image_size, image_multiple(name, layers_arg))
    if name == "resnet":
        return with_pool(resnet(layers_arg, num_classes, version=version, width=filters,
                                in_channels=in_channels), pool, in_channels, image_multiple(name), slide_encoder)
    if name == "resnet3d":
        if PoolKind(pool) is not PoolKind.AVG:
            raise ValueError(f"--pool {pool}: resnet3d pools its volume by average only; use --pool avg")
        return resnet3d(layers_arg, num_classes, width=filters, in_channels=in_channels)
    if name in (*DENSE_MODELS, "swinunetr3d"):
        if PoolKind(pool) is not PoolKind.AVG:
            raise ValueError(f"--pool {pool}: a U-Net outputs a class per pixel and pools nothing; --pool is for "
                             f"classifiers (resnet, amoebanet)")
        if name == "swinunetr3d":
            if image_size is not None:
                check_windows((image_size,) * 3 if isinstance(image_size, int) else tuple(image_size), layers_arg)
            return swinunetr3d(layers_arg, filters, num_classes, in_channels=in_channels)
        if name == "unet3d":
            return unet3d(layers_arg, filters, num_classes, in_channels=in_channels, norm=norm or "batch",
                          upsampling=upsampling or "trilinear")
        return unet(layers_arg, filters, num_classes, in_channels=in_channels, norm=norm or "batch",
                    upsampling=upsampling or "bilinear")
    return with_pool(amoebanet(layers_arg, filters, num_classes, in_channels=in_channels), pool, in_channels,
                     image_multiple(name), slide_encoder)


def check_sides(name: str, image_size: int | tuple[int, ...], multiple: int) -> None:
    """ValueError unless every side of ``image_size`` is a multiple of ``multiple`` (a volume of a 3-D model:
    three sides, or one for a cube; an image: one)."""
    sides = (image_size,) if isinstance(image_size, int) else tuple(image_size)
    volumes = name in VOLUME_MODELS
    if len(sides) != 1 and (len(sides) != 3 or not volumes):
        raise ValueError(f"image_size={image_size}: {name} takes " + (
            "volumes: give depth, height and width" if volumes else "images: give one side"))
    for side in sides:
        if side < multiple or side % multiple:
            fit = max(multiple, multiple * round(side / multiple))
            raise ValueError(f"image_size={image_size}: {name} downsamples by {multiple}, so "
                             f"every side must be a multiple of {multiple}; use e.g. {fit} for {side}")


def with_pool(layers: list[nn.Module], pool: PoolKind, in_channels: int, multiple: int,
              slide_encoder: SlideEncoderSpec | None = None) -> list[nn.Module]:
    """``layers`` (a trunk and its ClassifierHead) with the head pooling as ``pool`` (after ``slide_encoder``, if
    any): average without an encoder keeps them as they are; tissue-mean also wraps every trunk layer so the tissue
    mask (an input channel after the image's ``in_channels``) travels to the head (``models/tissue.py``)."""
    kind = PoolKind(pool)
    if kind is PoolKind.AVG and slide_encoder is None:
        return layers
    *trunk, head = layers
    assert isinstance(head, ClassifierHead), "resnet and amoebanet end in a ClassifierHead"
    new_head = ClassifierHead(head.fc.in_features, head.fc.out_features, norm=isinstance(head.norm, nn.BatchNorm2d),
                              relu=isinstance(head.relu, nn.ReLU), pool=kind,
                              encoder=slide_encoder).to(head.fc.weight.dtype)
    if kind.tissue:
        trunk = carry_tissue(trunk, in_channels, 2 * multiple)
    return [*trunk, new_head]
