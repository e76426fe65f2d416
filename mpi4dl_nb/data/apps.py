"""AppKind: the datasets ``--app`` names (MPI4DL's numbers 1/2/3 accepted too), and which of them read files."""
from __future__ import annotations

from ..config import Choice


class AppKind(Choice):
    """What to train on: ``medical`` (tiles/slides, or the bundled sample), ``cifar`` (CIFAR-10), ``synthetic``."""

    MEDICAL = "medical"
    CIFAR = "cifar"
    SYNTHETIC = "synthetic"

    @classmethod
    def parse(cls, text: str | int) -> AppKind:
        """``--app``: a name (any case) or MPI4DL's number (1 medical, 2 cifar, 3 synthetic); ValueError otherwise."""
        key = str(text).strip().lower()
        numbered = {str(number): kind for number, kind in enumerate(cls, start=1)}
        if key in numbered:
            return numbered[key]
        try:
            return cls(key)
        except ValueError:
            raise ValueError(f"--app {text!r}: choose medical, cifar or synthetic (or 1, 2, 3)") from None

    @property
    def reads_datapath(self) -> bool:
        """Whether the app reads ``--datapath`` (synthetic images are generated)."""
        return self is not AppKind.SYNTHETIC
