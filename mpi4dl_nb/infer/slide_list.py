"""The slides of ``infer --slides`` or ``--cohort``: a folder, a list file, ``A,B`` or a cohort manifest (each slide's
label and patient joined), their names unique because outputs are named by them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError
from ..data.files import SLIDE_ONLY_EXTENSIONS
from ..data.manifest import Cohort, read_cohort
from .outputs.kinds import SLIDE_FIELD

SLIDE_SUFFIXES = (*SLIDE_ONLY_EXTENSIONS, ".tif", ".tiff", ".png", ".jpg", ".jpeg")


@dataclass(frozen=True)
class SlideSource:
    """One slide to run, with its manifest's label and patient (empty without a manifest)."""

    path: Path
    label: str = ""
    patient: str = ""

    def known(self) -> dict[str, object]:
        """The manifest's columns of the summary table (none without a manifest)."""
        return {"patient": self.patient, "label": self.label} if self.label else {}


def list_slides(source: str | Path) -> list[Path]:
    """``--slides``: a folder (its slide files, sorted; not its sub-folders), a text file with one path a line
    (relative to the file's folder; blank lines and ``#`` comments skipped), one slide file, or slide files
    separated by commas (``A.svs,B.svs``)."""
    path = Path(source).expanduser()
    if not path.exists() and "," in str(source):
        slides = [Path(part.strip()).expanduser() for part in str(source).split(",") if part.strip()]
        missing = [str(s) for s in slides if not s.is_file()]
        if missing:
            raise ConfigError("--slides", f"no such slide file: {', '.join(missing)}")
    elif path.is_file() and path.suffix.lower() in SLIDE_SUFFIXES:
        slides = [path]
    elif path.is_dir():
        slides = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in SLIDE_SUFFIXES)
        if not slides:
            raise ConfigError("--slides", f"{path} holds no slide files ({', '.join(SLIDE_SUFFIXES)})")
    elif path.is_file():
        lines = [line.strip() for line in path.read_text().splitlines()]
        slides = [(path.parent / line).expanduser() for line in lines if line and not line.startswith("#")]
        if not slides:
            raise ConfigError("--slides", f"{path} lists no slides (one path per line)")
    else:
        raise ConfigError("--slides", f"{str(source)!r}: no such folder or list file")
    check_unique_names(slides, "--slides")
    return slides


def check_unique_names(slides: Sequence[Path], knob: str) -> None:
    """Refuse slides sharing a file name without suffix: their outputs (named by ``{slide}``) would collide."""
    stems = [s.stem for s in slides]
    twice = sorted({s for s in stems if stems.count(s) > 1})
    if twice:
        raise ConfigError(knob, f"several slides are named {', '.join(twice)}: outputs are named by {SLIDE_FIELD} "
                                f"(the file name without suffix); rename them or run them apart")


def is_manifest(source: str | Path) -> bool:
    """Whether ``--slides`` names a cohort manifest (a .csv file) rather than a folder or a list of paths."""
    return Path(source).suffix.lower() == ".csv"


def read_manifest(source: str | Path, classes: Sequence[str] | None) -> Cohort:
    """A cohort manifest given to ``infer`` (data/manifest.py; labels among ``classes`` when given); its slide
    names must differ, as outputs are named by them."""
    cohort = read_cohort(source, classes)
    check_unique_names([entry.path for entry in cohort], "--cohort")
    return cohort


def slide_sources(source: str | Path, classes: Sequence[str] | None) -> list[SlideSource]:
    """The slides of ``--slides``/``--cohort`` (a manifest's labels among ``classes`` when given)."""
    if is_manifest(source):
        return [SlideSource(e.path, e.label, e.patient) for e in read_manifest(source, classes)]
    return [SlideSource(path) for path in list_slides(source)]
