"""The model flags of every command: ``--model`` (this project's families or a named model), ``--weights`` and
``--normalize`` (train); the ModelSpec they name."""
from __future__ import annotations

import argparse

from ..config import ConfigError, ParallelConfig
from ..models.external import pretrained_normalization
from ..models.normalize import Normalization
from ..models.pools import PoolKind
from ..models.resnet import version_for_depth
from ..models.spec import ModelSpec, parse_model_name, split_model
from .image_size import image_size_arg

VERSION_HELP = ("ResNet v1 (basic blocks, depth 6n+2) or v2 (bottlenecks, 9n+2); default v2, or v1 for a depth "
                "only v1 has (8, 14, 26, ...)")
MODEL_HELP = ("network: resnet (MPI4DL's CIFAR-style ResNet: 3 stages, stride 4, for small images; for an "
              "ImageNet-style ResNet use torchvision:resnet50), amoebanet (AmoebaNet-D), unet, unet3d (volumes: "
              "--image-size D,H,W), torchvision:NAME, "
              "timm:NAME (pip install 'mpi4dl-nb[models]'), or package.module:callable (called with num_classes, "
              "returns an nn.Module or a layer list)")
AUTO = "auto"
# flags that size this project's own families; a named model has its own sizes
SIZE_FLAGS = (("--num-layers", "num_layers"), ("--num-filters", "num_filters"))


def model_arg(text: str) -> str:
    """``--model``'s type: a family or a named model (``torchvision:resnet50`` ...), refused early with the forms."""
    try:
        return parse_model_name(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_model_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: str | None,
                   help_text: str = MODEL_HELP) -> None:
    """``--model`` (``default`` None: taken from a checkpoint)."""
    parser.add_argument("--model", type=model_arg, default=default, metavar="MODEL", help=help_text)


def add_pretrained_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--weights`` and ``--normalize`` (train)."""
    parser.add_argument("--weights", default=None, metavar="PATH",
                        help="start from this state dict of the original model (torch.save(model.state_dict())); "
                             "a classifier for another number of classes is replaced by a new one for --num-classes")
    parser.add_argument("--normalize", default=AUTO, metavar="imagenet|none|M,S|M1,..,S1,..",
                        help="normalise the images as the weights expect, (x - mean) / std per channel, as the "
                             "model's first step (recorded; evaluate and infer apply it too); auto: with "
                             "--weights, ImageNet's for torchvision models, the model's own for timm models, "
                             "else none")


def normalization(args: argparse.Namespace) -> Normalization | None:
    """The normalisation ``--normalize`` names (``auto`` resolved against ``--model`` and ``--weights``)."""
    family, source = split_model(args.model)
    if args.normalize == AUTO:
        if args.weights is None or not family.named:
            return None
        return pretrained_normalization(str(family), source or "")
    return Normalization.parse(args.normalize)


def check_model_flags(args: argparse.Namespace) -> None:
    """ConfigError for model flags that do not fit together (a size flag or --normalize with the wrong family)."""
    family, _ = split_model(args.model)
    if family.named:
        for flag, value in ((flag, vars(args)[name]) for flag, name in SIZE_FLAGS):
            if value is not None:
                raise ConfigError(flag, f"sizes this project's resnet/amoebanet/unet; {args.model} has its own "
                                        f"(drop {flag})")
    elif args.normalize not in (AUTO, "none"):
        raise ConfigError("--normalize", f"applies to named models (torchvision:, timm:, package.module:callable); "
                                         f"--model {args.model} takes pixels in [0, 1]: drop --normalize")
    normalization(args)


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """The network the model flags name (family defaults for depth and width not given)."""
    return ModelSpec.of(args.model, num_layers=args.num_layers, num_filters=args.num_filters,
                        num_classes=args.num_classes,
                        resnet_version=version_for_depth(args.num_layers, args.resnet_version),
                        in_channels=vars(args).get("in_channels") or 3,
                        norm=args.norm, upsampling=args.upsampling, normalize=normalization(args),
                        weights=args.weights, pool=vars(args).get("pool", PoolKind.AVG))


def add_model_cut_args(parser: argparse.ArgumentParser) -> None:
    """``layout``'s model flags: with ``--model`` it also prints the model's stage cut."""
    g = parser.add_argument_group("model (with --model: the stage cut of the model)")
    add_model_flag(g, None, MODEL_HELP + "; prints the stage cut of its layer list for this configuration")
    g.add_argument("--num-layers", dest="num_layers", type=int, default=None, help="resnet/amoebanet/unet depth")
    g.add_argument("--num-filters", dest="num_filters", type=int, default=None, help="resnet/amoebanet/unet width")
    g.add_argument("--resnet-version", dest="resnet_version", type=int, choices=(1, 2), default=None,
                   help=VERSION_HELP)
    g.add_argument("--num-classes", dest="num_classes", type=int, default=10, help="number of classes")
    g.add_argument("--image-size", dest="image_size", type=image_size_arg, default=32, metavar="N|D,H,W",
                   help="image side in pixels, or a volume's patch D,H,W in voxels (its tiles are checked against "
                        "a DxRxC --slice-method)")
    parser.set_defaults(normalize="none", weights=None, norm=None, upsampling=None)   # train's, for model_spec


def model_cut(args: argparse.Namespace, cfg: ParallelConfig) -> str:
    """The stage table of the model the flags name, for ``cfg`` at ``--image-size`` (ConfigError for a model that
    does not resolve or a cut that does not fit)."""
    import torch

    from .stage_table import stage_table

    check_model_flags(args)
    cfg.validate(image_size=args.image_size)
    try:
        torch.manual_seed(0)
        layers = model_spec(args).build(args.image_size)
    except ValueError as err:
        raise ConfigError("--model", str(err)) from None
    return stage_table(layers, cfg, args.image_size)
