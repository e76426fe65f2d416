"""What ``infer --output`` names: the kind of each output (from its suffix, or ``PATH:KIND`` for a .tif), the
``{slide}`` template of a cohort, and the checks made before any work."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ...config import Choice, ConfigError

SLIDE_FIELD = "{slide}"


class OutputKind(Choice):
    """One output of a run."""

    NPY = "npy"                      # probabilities (classes, H', W'), the network's output cells
    PROBABILITIES = "probabilities"  # .tif: slide-aligned pyramid, one 8-bit sample per class (p x 255)
    LABELS = "labels"                # .tif: slide-aligned pyramid of class indices (255: no data)
    PREVIEW = "preview"              # .tif: slide-aligned colour-mapped pyramid of one class (RGB)
    OME = "ome"                      # .ome.tif: pyramidal OME-TIFF, one named float32 channel per class (NaN: no data)
    GEOJSON = "geojson"              # regions per class as polygons, level-0 pixels (QuPath imports it)
    CSV = "csv"                      # one row per cell: centre in level-0 pixels, class, probabilities
    PNG = "png"                      # the map over the slide's overview, with a legend

    @property
    def tiff(self) -> bool:
        return self in (OutputKind.PROBABILITIES, OutputKind.LABELS, OutputKind.PREVIEW)


BY_SUFFIX = {".npy": OutputKind.NPY, ".geojson": OutputKind.GEOJSON, ".json": OutputKind.GEOJSON,
             ".csv": OutputKind.CSV, ".png": OutputKind.PNG}
TIFF_SUFFIXES = (".tif", ".tiff")
OME_SUFFIXES = (".ome.tif", ".ome.tiff")
TIFF_KINDS = (OutputKind.PROBABILITIES, OutputKind.LABELS, OutputKind.PREVIEW)
HELP = ("KIND by suffix: .npy (probabilities per cell), .tif (slide-aligned pyramid: per-class probabilities for a "
        "classifier, the label map for a segmentation network; PATH.tif:probabilities|labels|preview to choose), "
        ".geojson (regions per class for QuPath), .csv (cell centres and probabilities), .png (overlay with legend)")


@dataclass(frozen=True)
class OutputSpec:
    """One ``--output``: where, and what (None: a .tif whose kind follows the network's task)."""

    path: Path
    kind: OutputKind | None

    @classmethod
    def parse(cls, text: str) -> OutputSpec:
        """``out.npy``, ``out.tif``, ``out.tif:labels``, ``out/{slide}.geojson``..."""
        path_text, _, tail = text.rpartition(":")
        if path_text and tail in OutputKind.values():
            path, kind = Path(path_text), OutputKind(tail)
            if path.suffix.lower() not in TIFF_SUFFIXES or not kind.tiff:
                raise ConfigError("--output", f"{text}: ':{tail}' chooses what a .tif holds "
                                              f"({', '.join(k.value for k in TIFF_KINDS)})")
            return cls(path, kind)
        path = Path(text)
        suffix = path.suffix.lower()
        if path.name.lower().endswith(OME_SUFFIXES):
            return cls(path, OutputKind.OME)
        if suffix in TIFF_SUFFIXES:
            return cls(path, None)
        if suffix not in BY_SUFFIX:
            raise ConfigError("--output", f"{text}: unknown kind {path.suffix!r}; {HELP}")
        return cls(path, BY_SUFFIX[suffix])

    def resolved(self, segmentation: bool) -> OutputSpec:
        """The kind a bare .tif takes: the label map of a segmentation network, a classifier's probabilities."""
        if self.kind is not None:
            return self
        return replace(self, kind=OutputKind.LABELS if segmentation else OutputKind.PROBABILITIES)

    def for_slide(self, stem: str) -> OutputSpec:
        """This output of one slide of a cohort (``{slide}`` replaced by the slide's file name without suffix)."""
        return replace(self, path=Path(str(self.path).replace(SLIDE_FIELD, stem)))

    @property
    def templated(self) -> bool:
        return SLIDE_FIELD in str(self.path)


def parse_outputs(texts: Sequence[str], cohort: bool) -> tuple[OutputSpec, ...]:
    """Every ``--output`` parsed; with ``--slides`` each must hold ``{slide}`` (one output set per slide)."""
    if not texts:
        raise ConfigError("--output", f"give at least one output; {HELP}")
    specs = tuple(OutputSpec.parse(t) for t in texts)
    for spec in specs:
        if cohort and not spec.templated:
            raise ConfigError("--output", f"{spec.path}: with --slides every output names one file per slide: put "
                                          f"{SLIDE_FIELD} in it, e.g. out/{SLIDE_FIELD}.tif")
        if not cohort and spec.templated:
            raise ConfigError("--output", f"{spec.path}: {SLIDE_FIELD} is for --slides (many slides); with --slide "
                                          f"name the file")
    return specs


def check_folder(path: Path, *, made: bool = False) -> None:
    """Refuse an output whose folder is missing (``made``: whose folder, made with its parents, cannot be), is a
    file, or cannot take a new file (one line naming it)."""
    folder = path.parent
    blocking = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ConfigError("--output", f"{path}: {blocking} is a file, not a folder; choose another folder")
    if not folder.is_dir() and not made:
        raise ConfigError("--output", f"{path}: folder {folder} does not exist; create it first")
    existing = next(p for p in (folder, *folder.parents) if p.is_dir())
    try:
        probe = tempfile.NamedTemporaryFile(dir=existing, prefix=".mpi4dl-probe-")
    except OSError as err:
        raise ConfigError("--output", f"{path}: cannot write in {existing} ({err.strerror or err}); choose a "
                                      f"writable folder") from None
    probe.close()


def check_folders(paths: Sequence[Path]) -> None:
    """``check_folder`` for each of ``paths`` (each folder probed once)."""
    for path in {p.parent: p for p in paths}.values():
        check_folder(path)


def check_outputs(specs: Sequence[OutputSpec], overwrite: bool) -> None:
    """Refuse duplicates, folders that cannot take the files and (without ``overwrite``) existing files."""
    paths = [s.path for s in specs]
    for path in paths:
        if path.exists() and not overwrite:
            raise ConfigError("--output", f"{path} exists; pass --overwrite to replace it, or another name")
        check_folder(path)
    if len({p.resolve() for p in paths}) != len(paths):
        raise ConfigError("--output", "the same file is named twice")


def summary_folder(spec: OutputSpec) -> Path:
    """Where a cohort's summary table goes by default: the output's folder above any ``{slide}`` part."""
    folder = spec.path.parent
    while SLIDE_FIELD in str(folder):
        folder = folder.parent
    return folder


def npy_base(specs: Sequence[OutputSpec]) -> Path:
    """The file the probabilities accumulate beside: the first .npy output, else the first output."""
    return next((s.path for s in specs if s.kind is OutputKind.NPY), specs[0].path)
