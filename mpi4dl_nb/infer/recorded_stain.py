"""The stain normaliser a checkpoint records, as ``evaluate`` and ``dl.evaluate`` read images through it: the
checkpoint's by default, off on request, said once; a record whose normaliser cannot be rebuilt refused."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ..checkpoint import files
from ..checkpoint.record import RECORD_KEY
from ..config import ConfigError
from ..data.stain import StainNormalizer

T = TypeVar("T")


@dataclass(frozen=True)
class StainKnobs:
    """How a caller names the checkpoint and the switch that turns normalisation off (flags, or arguments)."""

    checkpoint: str
    off: str


COMMAND_KNOBS = StainKnobs("--checkpoint", "--no-stain-normalize")
PYTHON_KNOBS = StainKnobs("checkpoint", "stain_normalize=False")


def fitted_on(normalizer: StainNormalizer) -> str:
    """``macenko fitted on ref.png [<fingerprint>]``."""
    return f"{normalizer.method} fitted on {normalizer.reference or 'an unnamed reference'} [{normalizer.fingerprint}]"


@dataclass(frozen=True)
class StainChoice:
    """The normaliser a checkpoint records (None: it trained on images as stored) and whether to read through it."""

    recorded: StainNormalizer | None
    wanted: bool = True

    @property
    def applied(self) -> StainNormalizer | None:
        """The normaliser images are read through (None: as stored)."""
        return self.recorded if self.wanted else None

    def header(self, knobs: StainKnobs) -> str | None:
        """The line saying which stain the images are read in (None: nothing to say, as before normalisation)."""
        if self.wanted:
            return None if self.recorded is None else f"stain normalisation: {fitted_on(self.recorded)} (from the " \
                                                      f"checkpoint)"
        trained = "the checkpoint records none" if self.recorded is None else \
            f"the run trained on images normalised by {fitted_on(self.recorded)}"
        return f"stain normalisation: off ({knobs.off}; {trained})"

    def describe(self) -> str:
        """What the figures were measured on, for a result's ``stain`` field."""
        applied = self.applied
        if applied is not None:
            return applied.describe()
        return "none" if self.recorded is None else "off"

    def refuse_unstained(self, what: str, knobs: StainKnobs) -> ConfigError:
        """The refusal for data without stains (``what``) under a checkpoint trained on normalised images."""
        assert self.recorded is not None, "only a normaliser can meet data without stains"
        return ConfigError(knobs.off, f"the checkpoint's run read its images through {fitted_on(self.recorded)}, "
                                      f"which normalises pathology stains, and {what} has none: evaluate pathology "
                                      f"images, or pass {knobs.off} to evaluate these as they are stored")


def stain_field_problem(path: Path) -> str | None:
    """Why the stain normaliser recorded in the checkpoint file ``path`` cannot be rebuilt (None: it can, the
    checkpoint records none, or the file cannot be read at all)."""
    try:
        data = files.load_checkpoint(path, lazy=True, check=False)
    except ValueError:
        return None
    record = data.get(RECORD_KEY)
    stain = record.get("stain") if isinstance(record, Mapping) else None
    if stain is None:
        return None
    if not isinstance(stain, Mapping):
        return f"expected a mapping, got {type(stain).__name__}"
    try:
        StainNormalizer.from_dict({str(key): value for key, value in stain.items()})
    except ValueError as err:
        return str(err)
    return None


def refusing_broken_stain(path: str | Path, load: Callable[[], T], knobs: StainKnobs) -> T:
    """``load()`` (which reads the checkpoint at ``path``); a failure caused by the checkpoint's stain field
    becomes a ConfigError naming the checkpoint and the flag the run was trained with."""
    from .model import find_checkpoint

    try:
        return load()
    except ConfigError:
        raise
    except ValueError as err:
        try:
            file = find_checkpoint(path)
        except (ValueError, OSError):
            raise err from None
        problem = stain_field_problem(file)
        if problem is None:
            raise
        raise ConfigError(knobs.checkpoint, f"{file} records a stain normaliser that cannot be rebuilt "
                                            f"({problem}); the run read its images through it, so no figures "
                                            f"measured here would be the run's: evaluate another checkpoint of "
                                            f"the run, or train again with --stain-normalize METHOD "
                                            f"--stain-reference IMAGE") from err
