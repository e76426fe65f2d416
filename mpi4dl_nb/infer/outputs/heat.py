"""The class the ``.png`` and ``.tif:preview`` draw by default: a positive class, not the name sorting last (pure)."""

from __future__ import annotations

import re
from collections.abc import Sequence

NEGATIVE_WORDS = frozenset({"background", "bg", "glass", "normal", "negative", "neg", "benign", "healthy", "other",
                            "none", "empty", "unlabeled", "unlabelled", "unknown", "void", "blank"})
NEGATIVE_PREFIXES = ("no", "non", "not", "without")


def is_negative(name: str) -> bool:
    """Whether a class name says "nothing found": background, normal, benign, "no DAB", "non-tumour"..."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    return not words or words[0] in NEGATIVE_PREFIXES or any(w in NEGATIVE_WORDS for w in words)


def default_heat_class(classes: Sequence[str]) -> int:
    """The first class after the first that is not a negative one (label 0 is usually the negative), else the first
    positive class, else the last class."""
    positive = [i for i, name in enumerate(classes) if not is_negative(name)]
    later = [i for i in positive if i > 0]
    if later:
        return later[0]
    return positive[0] if positive else len(classes) - 1
