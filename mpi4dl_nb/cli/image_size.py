"""``--image-size``'s type: one image side ``N``, or a volume patch's ``D,H,W`` (no heavy imports: every parser)."""
from __future__ import annotations

import argparse

VolumeSize = tuple[int, int, int]
ImageSize = int | VolumeSize


def image_size_arg(text: str) -> ImageSize:
    """``--image-size``: ``N`` (an image side) or ``D,H,W`` (a volume's patch); ArgumentTypeError otherwise."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        sides = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give an image side N or a volume's D,H,W (integers)") from None
    if len(sides) == 1:
        return sides[0]                   # checked with the other numbers (check_numbers)
    if len(sides) != 3 or min(sides) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give an image side N or a volume's D,H,W (each >= 1)")
    return sides[0], sides[1], sides[2]
