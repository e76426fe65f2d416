"""A conversion family's record (what it matches, converts to, is checked by, costs, patches), timm classes by path."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Container
from dataclasses import dataclass
from functools import cache
from typing import NoReturn

from torch import nn

from ..errors import ConfigError
from .cost import FamilyCost
from .layer import Convert, SpatialRuntime

PATCH_EMBED = ("timm.layers.PatchEmbed",)   # the patch embedding the ViT and Swin families take

# (module, its full name, the model's runtime, the converter for its children) -> the module on tiles (None: ask on)
FamilyConvert = Callable[[nn.Module, str, SpatialRuntime, Convert], nn.Module | None]


@cache
def timm_classes(paths: tuple[str, ...]) -> tuple[type[nn.Module], ...]:
    """The module classes at the dotted ``paths`` (``"timm.layers.attention.Attention"``), resolved once; those the
    installed timm lacks (or every one, without timm) left out."""
    found = []
    for module_name, _, name in (path.rpartition(".") for path in paths):
        try:
            cls = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            continue
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            found.append(cls)
    return tuple(found)


def from_timm(module: nn.Module) -> bool:
    """Whether ``module``'s class is timm's (timm stays unimported for other models)."""
    return type(module).__module__.startswith("timm.")


@dataclass(frozen=True)
class TimmMatch:
    """Matches timm modules of the classes at the dotted ``paths`` (subclasses too unless ``exact``: one may have its
    own forward); timm stays unimported for other models, and a class the installed timm lacks matches nothing."""

    paths: tuple[str, ...]
    exact: bool = False

    def __call__(self, module: nn.Module) -> bool:
        classes = timm_classes(self.paths)
        return from_timm(module) and (type(module) in classes if self.exact else isinstance(module, classes))


@dataclass(frozen=True)
class Family:
    """One family of modules ``spatialize`` converts, declared by the module that converts it: ``name``;
    ``matches``: whether a module is of the family (``TimmMatch``: timm's classes, ``names_family``: a class of
    models/ naming the record as its ``tile_family``); ``convert``: what it becomes on tiles (a ConfigError naming it
    where it cannot be exact); ``exactness``: the program (a repository path) that checks it equal to one process in
    float64; ``cost``: its cost model for the planner (None: not modelled); ``float64_patch``: what it changes in a
    freshly built model's module so one process computes a float64 run in float64 as the tiles do (None: nothing)."""

    name: str
    matches: Callable[[nn.Module], bool]
    convert: FamilyConvert
    exactness: str
    cost: FamilyCost | None = None
    float64_patch: Callable[[nn.Module], None] | None = None

    @property
    def timm(self) -> tuple[str, ...]:
        """The dotted paths of the timm classes the family matches (none for another family)."""
        return self.matches.paths if isinstance(self.matches, TimmMatch) else ()


def of_types(kinds: Container[type]) -> Callable[[nn.Module], bool]:
    """Matches modules whose class is one of ``kinds`` exactly (a subclass may have its own forward)."""
    return lambda module: type(module) in kinds


def names_family(module: nn.Module, family: Family) -> bool:
    """Whether ``module``'s class itself names ``family`` as its ``tile_family``: how a class of models/ (a cut piece,
    a 3-D Swin layer) says which record converts it, with no base class from here (a subclass has its own forward)."""
    return vars(type(module)).get("tile_family") is family


def refused(reason: str) -> FamilyConvert:
    """The conversion of a family that has no tile version: a ConfigError naming the module and ``reason``."""
    def refuse(module: nn.Module, name: str, runtime: SpatialRuntime, convert: Convert) -> NoReturn:
        raise ConfigError("model", f"layer {name or '<root>'!r} ({type(module).__name__}): {reason}")
    return refuse
