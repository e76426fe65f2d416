"""The cohort manifest (``--cohort FILE.csv``): slides with their labels, patients, folds and sides, checked
before any work with every problem listed by its line.

Columns (header names, any order, case-insensitive): ``slide`` (a path, relative to the manifest's folder or
absolute; a name without the file's extension is found by it, as CLAM and slideflow name slides), ``label`` (a
class name), optional ``patient`` (default: a TCGA barcode's patient, ``data/barcodes.py``, else the slide's own
name, so each slide is its own patient), optional ``fold`` (a whole number >= 0), optional ``split`` (``train``,
``val`` or ``test``); every other column is kept as metadata. CLAM's column names read as ours (``case_id`` as
``patient``, ``slide_id`` as ``slide``; slideflow's ``patient,slide`` are ours). Commas, semicolons or tabs separate
the fields (the header decides; data/csv_table.py reads every manifest); blank lines and lines starting with ``#``
are skipped.

Problems found and reported together, each with its line: a missing or unreadable slide, a label not among the
classes, a slide listed twice, a fold or split value that is not one, and a patient whose slides carry
different (or partly missing) fold or split values -- slides of one patient must stay on one side.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from ..errors import ConfigError
from .barcodes import ORIGIN, tcga_patient
from .csv_table import read_table
from .files import SLIDE_ONLY_EXTENSIONS

KNOB = "--cohort"
REQUIRED = ("slide", "label")
OPTIONAL = ("patient", "fold", "split")
ALIASES = {"case_id": "patient", "slide_id": "slide"}      # other tools' column names (CLAM's) read as ours
HEADER_HINT = "columns: slide, label and optionally patient, fold, split (others are kept as metadata)"
MAX_SHOWN = 20   # problems listed in one message; the rest counted

SlideProbe = Callable[[Path], "str | None"]   # why a slide file cannot be read (None: it can)


class Side(str, Enum):
    """Which side of a held-out split a slide (and its patient) belongs to."""

    TRAIN = "train"
    VAL = "val"
    TEST = "test"

    @classmethod
    def parse(cls, text: str) -> Side:
        """A ``split`` value (case and surrounding blanks ignored); ValueError naming the accepted ones."""
        value = text.strip().lower()
        for side in cls:
            if side.value == value:
                return side
        raise ValueError(f"split {text!r} is not one of {', '.join(s.value for s in cls)}")


@dataclass(frozen=True)
class CohortSlide:
    """One row of the manifest: a slide file, its class, its patient and where the manifest places it."""

    line: int                                    # line number in the file (the header is line 1)
    path: Path                                   # absolute
    label: str
    patient: str
    fold: int | None = None
    split: Side | None = None
    metadata: tuple[tuple[str, str], ...] = ()   # the other columns, in file order
    barcode_patient: bool = False                # the patient read from the slide's TCGA barcode (no patient given)

    @property
    def name(self) -> str:
        """The slide's name in tables and outputs: its file name without the suffix."""
        return self.path.stem

    def meta(self) -> dict[str, str]:
        """The extra columns as a dict."""
        return dict(self.metadata)


@dataclass(frozen=True)
class Cohort:
    """A checked manifest: its slides in file order and the class names (labels index into ``classes``)."""

    source: Path
    slides: tuple[CohortSlide, ...]
    classes: tuple[str, ...]
    columns: tuple[str, ...] = field(default=())  # the header as written
    renamed: tuple[tuple[str, str], ...] = ()     # columns read under our name: (as written, ours)

    def __len__(self) -> int:
        return len(self.slides)

    @property
    def grouping(self) -> str:
        """Where the patients come from when not plainly from a ``patient`` column, as a split's summary says it
        (``from TCGA barcodes; manifest columns: case_id -> patient, slide_id -> slide``; empty: plainly)."""
        notes = [ORIGIN] if any(s.barcode_patient for s in self.slides) else []
        if self.renamed:
            notes.append("manifest columns: " + ", ".join(f"{theirs} -> {ours}" for theirs, ours in self.renamed))
        return "; ".join(notes)

    def __iter__(self) -> Iterator[CohortSlide]:
        return iter(self.slides)

    def label_index(self, slide: CohortSlide) -> int:
        """The class number of ``slide`` (its position in ``classes``)."""
        return self.classes.index(slide.label)

    @property
    def labels(self) -> list[int]:
        """Every slide's class number, in file order."""
        return [self.label_index(s) for s in self.slides]

    @property
    def patients(self) -> dict[str, list[CohortSlide]]:
        """Each patient's slides, patients in order of first appearance."""
        grouped: dict[str, list[CohortSlide]] = {}
        for slide in self.slides:
            grouped.setdefault(slide.patient, []).append(slide)
        return grouped

    @property
    def has_folds(self) -> bool:
        return any(s.fold is not None for s in self.slides)

    @property
    def has_splits(self) -> bool:
        return any(s.split is not None for s in self.slides)

    def on_side(self, side: Side) -> list[CohortSlide]:
        """The slides the manifest's ``split`` column places on ``side``."""
        return [s for s in self.slides if s.split is side]

    def find(self, path: str | Path) -> CohortSlide | None:
        """The row of the slide file ``path`` (None: not in the manifest)."""
        wanted = Path(path).expanduser().resolve()
        return next((s for s in self.slides if s.path.resolve() == wanted), None)


def readable(path: Path) -> str | None:
    """The default slide probe: the file exists, is a file and its first bytes can be read."""
    if not path.exists():
        return "no such file"
    if not path.is_file():
        return "a folder, not a slide file"
    try:
        with path.open("rb") as handle:
            handle.read(16)
    except OSError as err:
        return f"unreadable: {err.strerror or err}"
    return None


def read_cohort(source: str | Path, classes: Sequence[str] | None = None, *,
                probe: SlideProbe | None = readable, every_class: bool = False) -> Cohort:
    """The manifest at ``source``, checked: ConfigError(``--cohort``) listing every problem with its line.

    ``classes`` (``--classes``, in order) are the only labels accepted; without them the classes are the
    manifest's labels sorted by name. ``every_class`` (training): each of ``classes`` must label a slide, as
    each class folder must exist (data/classes.py), else ConfigError(``--classes``). ``probe`` says why a slide
    file cannot be read (None: skip file checks).
    """
    path = Path(source).expanduser()
    if not path.is_file():
        raise ConfigError(KNOB, f"{str(source)!r}: no such file (a CSV with columns slide,label[,patient,fold,"
                                f"split])")
    table = read_table(path, KNOB, REQUIRED, HEADER_HINT, ALIASES)
    problems: list[str] = []
    slides = [_slide(path.parent, row.line, row.cells, problems) for row in table.rows]
    parsed = [s for s in slides if s is not None]
    if not parsed and not problems:
        raise ConfigError(KNOB, f"{path} lists no slides (one row per slide under the header {','.join(REQUIRED)})")
    names = tuple(classes) if classes else tuple(sorted({s.label for s in parsed}))
    problems += _file_problems(parsed, probe)
    problems += _label_problems(parsed, names, bool(classes))
    problems += _duplicate_problems(parsed)
    problems += _patient_problems(parsed)
    if problems:
        raise ConfigError(KNOB, manifest_problems(path, problems))
    if every_class:
        check_every_class(path, names, parsed)
    return Cohort(path.resolve(), tuple(parsed), names, table.columns, table.renamed)


def check_every_class(path: Path, classes: Sequence[str], slides: Sequence[CohortSlide]) -> None:
    """ConfigError(``--classes``) naming the classes no slide is labelled with: a class without slides would
    train an output nothing teaches (class folders are refused alike: data/classes.py)."""
    labels = {s.label for s in slides}
    empty = [name for name in classes if name not in labels]
    if empty:
        kept = [name for name in classes if name in labels]
        raise ConfigError("--classes", f"{', '.join(empty)}: no slide of {path} is labelled so (its labels: "
                                       f"{', '.join(kept)}); drop {'it' if len(empty) == 1 else 'them'} "
                                       f"(--classes {','.join(kept)}) or label slides {empty[0]} in the manifest")


def manifest_problems(path: Path, problems: Sequence[str]) -> str:
    """Every problem on its own line (at most MAX_SHOWN, then how many more), after one line naming the file."""
    shown = [f"  {p}" for p in problems[:MAX_SHOWN]]
    if len(problems) > MAX_SHOWN:
        shown.append(f"  ... and {len(problems) - MAX_SHOWN} more")
    count = "1 problem" if len(problems) == 1 else f"{len(problems)} problems"
    return f"{path}: {count}; fix them and run again:\n" + "\n".join(shown)


def _slide(folder: Path, line: int, row: Mapping[str, str], problems: list[str]) -> CohortSlide | None:
    """The row as a CohortSlide, or None with its problems added."""
    before = len(problems)
    if not row.get("slide"):
        problems.append(f"line {line}: no slide path")
    if not row.get("label"):
        problems.append(f"line {line}: no label")
    fold = _fold(row.get("fold", ""), line, problems)
    split = None
    if row.get("split"):
        try:
            split = Side.parse(row["split"])
        except ValueError as err:
            problems.append(f"line {line}: {err}")
    slide_path = Path(os.path.expanduser(row.get("slide", "")))
    written = slide_path if slide_path.is_absolute() else folder / slide_path
    found = slide_files_named(written) if row.get("slide") else []
    if len(found) > 1:
        problems.append(f"line {line}: slide {written}: no such file, and {' and '.join(p.name for p in found)} "
                        f"both are; name the one it is, with its extension")
    if len(problems) > before:
        return None
    absolute = found[0] if found else written
    barcode = None if row.get("patient") else tcga_patient(absolute.name)
    patient = row.get("patient") or barcode or absolute.stem
    extra = tuple((k, v) for k, v in row.items() if k not in REQUIRED + OPTIONAL)
    return CohortSlide(line, absolute.absolute(), row["label"], patient, fold, split, extra, barcode is not None)


def slide_files_named(path: Path) -> list[Path]:
    """``path`` when it exists, else the slide files named so with a slide extension added (CLAM's ``slide_id`` and
    slideflow's ``slide`` leave it out): none, one, or (ambiguous) several."""
    if path.exists():
        return [path]
    named = [path.with_name(path.name + suffix) for suffix in (*SLIDE_ONLY_EXTENSIONS, ".tif", ".tiff")]
    return [candidate for candidate in named if candidate.is_file()]


def _fold(text: str, line: int, problems: list[str]) -> int | None:
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        problems.append(f"line {line}: fold {text!r} is not a whole number >= 0")
        return None
    return value


def _file_problems(slides: Sequence[CohortSlide], probe: SlideProbe | None) -> list[str]:
    if probe is None:
        return []
    found = []
    for slide in slides:
        why = probe(slide.path)
        if why is not None:
            found.append(f"line {slide.line}: slide {slide.path}: {why}")
    return found


def _label_problems(slides: Sequence[CohortSlide], classes: Sequence[str], given: bool) -> list[str]:
    where = "--classes" if given else "the classes"
    return [f"line {s.line}: label {s.label!r} is not among {where} ({', '.join(classes)})"
            for s in slides if s.label not in classes]


def _duplicate_problems(slides: Sequence[CohortSlide]) -> list[str]:
    first: dict[Path, int] = {}
    found = []
    for slide in slides:
        key = slide.path.resolve()
        if key in first:
            found.append(f"line {slide.line}: slide {slide.path} is listed already on line {first[key]}")
        else:
            first[key] = slide.line
    return found


def _patient_problems(slides: Sequence[CohortSlide]) -> list[str]:
    """A patient's slides must agree on fold and split (a blank beside a value counts as a disagreement: the
    blank slide could land on the other side)."""
    grouped: dict[str, list[CohortSlide]] = {}
    for slide in slides:
        grouped.setdefault(slide.patient, []).append(slide)
    found = []
    for patient, members in grouped.items():
        for column in ("fold", "split"):
            values = {_shown(getattr(s, column)) for s in members}
            if len(values) > 1:
                each = ", ".join(f"line {s.line}: {_shown(getattr(s, column))}" for s in members)
                found.append(f"line {members[0].line}: patient {patient!r} has slides with different {column} "
                             f"values ({each}); give all of a patient's slides the same {column}")
    return found


def _shown(value: int | Side | None) -> str:
    if value is None:
        return "(none)"
    return value.value if isinstance(value, Side) else str(value)
