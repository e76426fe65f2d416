"""What the classes are: their names (class folders, ``--classes``, CIFAR-10's), ``--num-classes`` checked against
the data, the training images per class, and the weights of ``--class-weights`` (a list, or ``balanced``)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigError
from .apps import AppKind
from .cifar import CLASSES as CIFAR_CLASSES
from .dataset import RegionDataset
from .files import class_of
from .validate import find_sources

DEFAULT_NUM_CLASSES = 10    # MPI4DL's, for data whose labels do not come from folders
BALANCED = "balanced"


def numbered(count: int) -> tuple[str, ...]:
    """Names of classes the data does not name: ``0``, ``1``, ..."""
    return tuple(str(c) for c in range(count))


def parse_names(text: str | None) -> tuple[str, ...] | None:
    """``--classes benign,tumour``: the class names in label order (None when not given)."""
    if text is None:
        return None
    names = tuple(part.strip() for part in str(text).split(","))
    if not all(names):
        raise ConfigError("--classes", f"{text!r}: give the class names separated by commas, e.g. benign,tumour")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError("--classes", f"{', '.join(repeated)} named twice; give each class once")
    return names


def folder_classes(app: AppKind | str, datapath: str | Path | None) -> tuple[str, ...] | None:
    """The classes the data's files name: class folders below ``datapath`` (``""``: files directly in it), in
    sorted order, or CIFAR-10's; None for data without named classes (generated data, the IHC sample)."""
    kind = AppKind.parse(app)
    if kind is AppKind.CIFAR:
        return CIFAR_CLASSES
    if kind is not AppKind.MEDICAL or datapath is None:
        return None
    try:
        sources = find_sources(kind, datapath)
    except FileNotFoundError as err:
        raise ConfigError("--datapath", str(err).removeprefix("--datapath ")) from None
    root = Path(datapath).expanduser()
    if root.is_file() or not sources.files:
        return ("",)
    try:
        return tuple(class_of(sources.files, root)[1])
    except ValueError as err:
        raise ConfigError("--datapath", str(err)) from None


def resolve_names(app: AppKind | str, found: tuple[str, ...] | None, given: tuple[str, ...] | None,
                  num_classes: int | None, where: str = "--datapath") -> tuple[str, ...]:
    """The run's class names in label order: the data's (``found``), ordered and checked by ``--classes`` when
    given; ConfigError when ``--num-classes`` or ``--classes`` disagrees with the data."""
    if found is not None and len(found) > 1:
        if given is not None and AppKind.parse(app) is AppKind.CIFAR and given != found:
            raise ConfigError("--classes", f"CIFAR-10's classes are {','.join(found)}, in that order; drop --classes")
        if given is not None:
            missing = [name for name in found if name not in given]
            if missing:
                raise ConfigError("--classes", f"{where} has class folder(s) {', '.join(missing)} that --classes "
                                               f"does not name; name every class: --classes {','.join(found)}")
            extra = [name for name in given if name not in found]
            if extra:
                raise ConfigError("--classes", f"{', '.join(extra)}: no such class folder in {where} (its "
                                               f"classes: {', '.join(found)})")
        names = given or found
        if num_classes is not None and num_classes != len(names):
            raise ConfigError("--num-classes", f"{where} has {len(names)} classes ({', '.join(names)}), not "
                                               f"{num_classes}; use --num-classes {len(names)} or leave it out")
        return names
    if given is not None:
        if num_classes is not None and num_classes != len(given):
            raise ConfigError("--classes", f"names {len(given)} classes but --num-classes is {num_classes}; "
                                           f"give as many names as classes")
        return given
    return numbered(num_classes if num_classes is not None else DEFAULT_NUM_CLASSES)


def label_order(found: tuple[str, ...] | None, names: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """The class names that order the labels of data with class folders (``found`` names some), else None:
    the labels of other data do not come from names."""
    return names if found is not None and any(found) else None


def class_counts(dataset: RegionDataset, num_classes: int) -> list[int]:
    """How many images of each class ``dataset`` holds (labels only; no image is read)."""
    counts = [0] * num_classes
    for index in range(len(dataset)):
        counts[dataset.label(index)] += 1
    return counts


def parse_class_weights(text: str | None) -> tuple[float, ...] | str | None:
    """``--class-weights 1,3`` (one weight per class) or ``balanced``; None when not given."""
    if text is None:
        return None
    if text.strip().lower() == BALANCED:
        return BALANCED
    try:
        weights = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ConfigError("--class-weights", f"{text!r}: give one number per class (e.g. 1,3) or "
                                             f"'{BALANCED}'") from None
    if any(not (w >= 0.0) or w == float("inf") for w in weights) or not any(weights):
        raise ConfigError("--class-weights", f"{text!r}: weights must be finite, >= 0, not all 0")
    return weights


def class_weights(given: tuple[float, ...] | str, counts: Sequence[int]) -> tuple[float, ...]:
    """The weight of each class: the list given (one per class), or ``balanced``: ``N / (K * n_c)`` for the
    ``n_c`` training images of class ``c`` among ``N`` (a class without images gets 0)."""
    if isinstance(given, str):
        total, present = sum(counts), sum(1 for n in counts if n)
        return tuple(total / (present * n) if n else 0.0 for n in counts)
    if len(given) != len(counts):
        raise ConfigError("--class-weights", f"gives {len(given)} weights for {len(counts)} classes; give one "
                                             f"per class, in class order")
    return tuple(given)
