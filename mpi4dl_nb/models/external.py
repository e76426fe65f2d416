"""Models named by where they come from: ``torchvision:NAME``, ``timm:NAME`` or ``package.module:callable``.

Each resolves to a freshly built model (random weights from torch's current seed, ``num_classes``
outputs); an unknown name is refused with the closest names there are, a missing library with the
extra that installs it, a module that does not import with the module and the reason.
"""
from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from types import ModuleType

import torch
from torch import nn

from ..errors import ConfigError
from ..spatial.families import family_of
from .chain import mode, side_text
from .cut import layer_list
from .cut_families import built_image_size
from .model_args import NO_ARGS, ModelArgs, refused_args, timm_resolver
from .normalize import IMAGENET, Normalization, normalized
from .vit import EMBEDDING_STEP, is_token_model, patch_multiple

EXTRA = "models"         # pip install 'mpi4dl-nb[models]' brings torchvision and timm
CLOSEST = 5              # names suggested for an unknown one
Built = nn.Module | list[nn.Module]


def closest(name: str, known: Iterable[str]) -> str:
    """``"; closest: resnet50, resnet101"`` (empty when nothing is close)."""
    near = difflib.get_close_matches(name, list(known), n=CLOSEST, cutoff=0.6)
    return f"; closest: {', '.join(near)}" if near else ""


def library(name: str, source: str) -> ModuleType:
    """``torchvision`` or ``timm``, or one line saying which extra installs it."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ConfigError("--model", f"{source} needs {name}, which does not import here ({err}); install "
                          f"the '{EXTRA}' extra: pip install 'mpi4dl-nb[{EXTRA}]'") from None


def constructed(make: Callable[..., object], label: str, args: ModelArgs, keywords: dict[str, object],
                **given: object) -> object:
    """``make(**given, **keywords)``; a TypeError (an argument ``make`` does not take), or an AssertionError or
    ValueError (values it does not accept: timm asserts them), as one line naming the ``--model-args`` given."""
    try:
        return make(**given, **keywords)
    except (TypeError, AssertionError, ValueError) as err:
        if not args:
            raise
        raise refused_args(args, label, err) from None


def torchvision_model(name: str, num_classes: int, in_channels: int = 3, args: ModelArgs = NO_ARGS) -> nn.Module:
    """``torchvision.models.get_model(name, num_classes=..., **args)`` without weights."""
    models = library("torchvision.models", f"torchvision:{name}")
    known = models.list_models()
    if name not in known:
        raise ConfigError("--model", f"torchvision has no model {name!r}{closest(name, known)} "
                                     f"(torchvision.models.list_models() lists them)")
    if in_channels != 3:
        raise ConfigError("--model", f"torchvision:{name} takes 3-channel images, not {in_channels}; use a timm "
                                     f"model (in_chans) or your own callable")
    model = constructed(models.get_model, f"torchvision:{name}", args, args.keywords(), name=name, weights=None,
                        num_classes=num_classes)
    assert isinstance(model, nn.Module)
    return model


def timm_named(name: str) -> ModuleType:
    """timm, once it knows the model ``name`` (ConfigError naming the closest names, or the extra to install)."""
    timm = library("timm", f"timm:{name}")
    if not timm.is_model(name):
        raise ConfigError("--model", f"timm has no model {name!r}{closest(name, timm.list_models())} "
                                     f"(timm.list_models('*pattern*') lists them)")
    return timm


def timm_model(name: str, num_classes: int, in_channels: int = 3, image_size: int | None = None,
               args: ModelArgs = NO_ARGS) -> nn.Module:
    """``timm.create_model(name, num_classes=..., in_chans=..., **args)`` without downloading weights (``args``'
    layer names resolved to timm's classes); a ViT at ``image_size`` (``img_size=``: its position embeddings'
    grid), refused when its patches do not tile it; a model built for one image size (timm's Swin, MaxViT) built
    for ``image_size`` too (ConfigError naming ``--image-size`` when it cannot be)."""
    timm = timm_named(name)
    keywords = args.keywords(timm_resolver(timm))
    sizing: dict[str, object] = {}
    if image_size is not None or args:
        probe = timm_probe(name, in_channels, args)
        own = built_image_size(probe)
        if image_size is not None and is_token_model(probe):
            check_patches(f"timm:{name}", image_size, patch_multiple(probe))
            sizing["img_size"] = image_size
        elif image_size is not None and own is not None and own != (image_size, image_size):
            check_other_size(name, in_channels, args, image_size, own, probe)
            sizing["img_size"] = image_size    # built for one size (Swin's windows, MaxViT's partitions): the images'
    model = timm.create_model(name, pretrained=False, num_classes=num_classes, in_chans=in_channels, **sizing,
                              **keywords)
    assert isinstance(model, nn.Module)
    return model


def check_other_size(name: str, in_channels: int, args: ModelArgs, image_size: int, own: tuple[int, int],
                     probe: nn.Module) -> None:
    """ConfigError(``--image-size``) unless ``timm:name``, built for the one image size ``own`` (``probe``: so built,
    on ``meta``), can be built for ``image_size`` and takes such images: its patches tile them, and a forward on the
    ``meta`` device (nothing computed) passes timm's own size checks (MaxViT's partitions, a Swin's windows and
    merges)."""
    label = f"timm:{name}"
    if isinstance(getattr(probe, EMBEDDING_STEP, None), nn.Module):
        check_patches(label, image_size, patch_multiple(probe))
    try:
        sized = timm_probe(name, in_channels, args, img_size=image_size)
        with torch.no_grad():
            sized.eval()(torch.empty(1, in_channels, image_size, image_size, device="meta"))
    except (TypeError, AssertionError, ValueError, RuntimeError, ConfigError) as err:
        raise ConfigError("--image-size", f"{image_size}: {label} cannot take {image_size}x{image_size} images "
                                          f"({err}); it was made for {side_text(own)} ones") from None


def timm_probe(name: str, in_channels: int = 3, args: ModelArgs = NO_ARGS, **sizing: object) -> nn.Module:
    """``timm:name`` with ``args`` (and ``sizing``: ``img_size=``) built on the meta device: what it is, drawing
    nothing and holding no weights (ConfigError as ``timm_model`` words it for an unknown name or arguments it does
    not take)."""
    timm = timm_named(name)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        probe = constructed(timm.create_model, f"timm:{name}", args, args.keywords(timm_resolver(timm)),
                            model_name=name, pretrained=False, in_chans=in_channels, **sizing)
    assert isinstance(probe, nn.Module)
    return probe


def check_patches(label: str, image_size: int, patch: int) -> None:
    """ConfigError naming sizes that work when ``patch``-pixel patches do not tile an ``image_size`` image."""
    if image_size % patch == 0:
        return
    below = image_size // patch * patch
    sizes = " or ".join(str(s) for s in (below, below + patch) if s > 0)
    raise ConfigError("--image-size", f"{image_size}: {label} cuts images into {patch}x{patch}-pixel patches, so the "
                                      f"side must be a multiple of {patch}: use {sizes}")


def split_target(target: str) -> tuple[str, str]:
    """``"package.module:callable"`` -> (``package.module``, ``callable``); ConfigError for another form."""
    module, sep, attribute = target.partition(":")
    if not sep or not module or not attribute or ":" in attribute:
        raise ConfigError("--model", f"{target!r}: name a callable as package.module:callable "
                                     f"(or torchvision:NAME, timm:NAME, resnet, amoebanet)")
    return module, attribute


def resolve_callable(target: str) -> Callable[..., object]:
    """The callable ``package.module:callable`` names (imported); ConfigError naming the module or the name."""
    module_name, attribute = split_target(target)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:     # an import runs the module's code: any error is the module's
        raise ConfigError("--model", f"{target}: cannot import module {module_name!r} "
                                     f"({type(err).__name__}: {err})") from None
    found: object = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            names = [n for n in dir(found) if not n.startswith("_")]
            raise ConfigError("--model", f"{target}: {module_name} has no {attribute!r}{closest(part, names)}")
        found = getattr(found, part)
    if not callable(found):
        raise ConfigError("--model", f"{target}: {attribute} is a {type(found).__name__}, not a callable")
    return found


def module_model(target: str, num_classes: int, args: ModelArgs = NO_ARGS) -> Built:
    """``callable(num_classes=..., **args)``: an ``nn.Module`` or a list of modules; ConfigError for anything else."""
    make = resolve_callable(target)
    if args:
        built = constructed(make, target, args, args.keywords(), num_classes=num_classes)
        return checked_build(target, num_classes, built)
    try:
        built = make(num_classes=num_classes)
    except TypeError as err:
        raise ConfigError("--model", f"{target}(num_classes={num_classes}) failed ({err}); the callable takes "
                                     f"num_classes and returns an nn.Module or a list of modules") from None
    return checked_build(target, num_classes, built)


def checked_build(target: str, num_classes: int, built: object) -> Built:
    """What a callable returned, if it is an ``nn.Module`` or a list of modules; ConfigError otherwise."""
    if isinstance(built, nn.Module):
        return built
    if isinstance(built, (list, tuple)) and built and all(isinstance(m, nn.Module) for m in built):
        return list(built)
    raise ConfigError("--model", f"{target}(num_classes={num_classes}) returned a {type(built).__name__}; it must "
                                 f"return an nn.Module or a list of modules")


def built_model(family: str, source: str, num_classes: int, in_channels: int = 3,
                image_size: int | None = None, args: ModelArgs = NO_ARGS) -> Built:
    """The model ``family`` (``torchvision``, ``timm``, ``module``) and ``source`` name, freshly built with the
    constructor's ``args`` (a timm ViT for ``image_size``)."""
    if family == "torchvision":
        return torchvision_model(source, num_classes, in_channels, args)
    if family == "timm":
        return timm_model(source, num_classes, in_channels, image_size, args)
    if family == "module":
        return module_model(source, num_classes, args)
    raise ValueError(f"a {family} model ({source}) was built in Python and cannot be rebuilt from its name: pass "
                     f"the model object (model=...) together with the checkpoint")


def float64_kept(built: Built) -> Built:
    """``built`` with each module's family's ``float64_patch`` applied (EfficientViT's LiteMLA: its attention in
    float64 in a float64 run): one process then computes as the tiles do."""
    for root in built if isinstance(built, list) else [built]:
        for module in root.modules():
            family = family_of(module)
            if family is not None and family.float64_patch is not None:
                family.float64_patch(module)
    return built


def pretrained_normalization(family: str, source: str) -> Normalization | None:
    """The normalisation a family's pretrained weights expect: ImageNet's for torchvision, a timm model's
    ``pretrained_cfg`` mean and std; None for a callable's model."""
    if family == "torchvision":
        return IMAGENET
    if family != "timm":
        return None
    config = library("timm.models", f"timm:{source}").get_pretrained_cfg(source)
    mean, std = getattr(config, "mean", None), getattr(config, "std", None)
    if not mean or not std:
        return None
    found = Normalization(tuple(float(v) for v in mean), tuple(float(v) for v in std))
    return IMAGENET if (found.mean, found.std) == (IMAGENET.mean, IMAGENET.std) else found


def external_layers(family: str, source: str, num_classes: int, in_channels: int = 3,
                    normalization: Normalization | None = None, image_size: int | None = None,
                    args: ModelArgs = NO_ARGS) -> list[nn.Module]:
    """The named model as a layer list (cut by ``layer_list`` unless it is one), starting with ``normalization``;
    ConfigError when ``image_size`` is too small for it (naming the smallest side that works)."""
    layers = normalized(layer_list(float64_kept(built_model(family, source, num_classes, in_channels, image_size,
                                                            args))),
                        normalization)
    if image_size is not None:
        check_image_size(layers, image_size, source if family == "module" else f"{family}:{source}", in_channels)
    return layers


def layer_shapes(layers: Sequence[nn.Module], side: int, channels: int = 3) -> list[torch.Size]:
    """The output shape of every layer on one ``side`` x ``side`` image, found on the ``meta`` device (no copy
    of the weights, nothing computed); RuntimeError when a layer cannot take its input."""
    net = nn.Sequential(*layers)
    tensors = {name: torch.empty_like(t, device="meta") for name, t in chain(net.named_parameters(),
                                                                               net.named_buffers())}
    dtype = next((t.dtype for t in net.parameters()), torch.float32)
    x = torch.empty(1, channels, side, side, device="meta", dtype=dtype)
    shapes = []
    with mode(net, False), torch.no_grad():
        for index, layer in enumerate(layers):
            own = {name.partition(".")[2]: t for name, t in tensors.items() if name.partition(".")[0] == str(index)}
            x = torch.func.functional_call(layer, own, (x,))
            shapes.append(x.shape)
    return shapes


def meta_error(layers: Sequence[nn.Module], side: int, channels: int) -> str | None:
    """Why ``layers`` fail on a ``side`` x ``side`` image (None: they take it), found on the ``meta`` device."""
    try:
        layer_shapes(layers, side, channels)
    except RuntimeError as err:
        return str(err).splitlines()[0]
    return None


LARGEST_PROBE = 8192


def check_image_size(layers: Sequence[nn.Module], image_size: int, label: str, channels: int = 3) -> None:
    """ConfigError naming the smallest image side ``layers`` take when ``image_size`` is too small for them."""
    reason = meta_error(layers, image_size, channels)
    if reason is None:
        return
    low, high = image_size, image_size
    while high < LARGEST_PROBE and meta_error(layers, high, channels) is not None:
        low, high = high, high * 2
    if meta_error(layers, high, channels) is not None:
        raise ConfigError("--image-size", f"{label} fails on {image_size}x{image_size} images ({reason})")
    while high - low > 1:       # low fails, high works
        middle = (low + high) // 2
        low, high = (low, middle) if meta_error(layers, middle, channels) is None else (middle, high)
    raise ConfigError("--image-size", f"{image_size}: too small for {label} ({reason}); the smallest image side "
                                      f"it takes is {high}")
