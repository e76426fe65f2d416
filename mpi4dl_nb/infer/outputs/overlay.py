"""The ``.png`` output: the slide's overview with the map laid over it (a class's probability, or the labels in class
colours), and a legend below saying what the colours mean."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .colors import class_color, colorize, colormap_lut
from .pyramid import MapPyramid

if TYPE_CHECKING:
    from PIL import Image

LEGEND_HEIGHT = 28


def overview_level(pyramid: MapPyramid, slide_width: int, overview_width: int) -> int:
    """The coarsest pyramid level still at least as fine as the overview (bounded: about the overview's size)."""
    scale = overview_width / slide_width
    level = 0
    for index, (_, width) in enumerate(pyramid.levels):
        pixel = pyramid.placement.cell_size * pyramid.levels[0][1] / width   # level-0 pixels per pixel of this level
        if pixel * scale <= 1.0:
            level = index
    return level


def write_overlay(path: Path, thumbnail: np.ndarray, pyramid: MapPyramid, slide_size: tuple[int, int], *,
                  labels: bool, heat_class: int, class_names: Sequence[str], opacity: float = 0.5) -> None:
    """``thumbnail`` (RGB overview of a ``slide_size`` (height, width) level 0) with the map over it and a legend."""
    from PIL import Image

    base = Image.fromarray(np.ascontiguousarray(thumbnail[:, :, :3])).convert("RGBA")
    scale = base.size[0] / slide_size[1]
    level = overview_level(pyramid, slide_size[1], base.size[0])
    height, width = pyramid.levels[level]
    block = pyramid.block(level, 0, height, 0, width)
    known = np.isfinite(block).all(axis=0)
    if labels:
        palette = np.array([class_color(c) for c in range(pyramid.classes)], dtype=np.uint8)
        rgb = palette[np.argmax(np.nan_to_num(block, nan=-1.0), axis=0)]
    else:
        rgb = colorize(block[heat_class], colormap_lut())
    alpha = np.where(known, int(round(255 * opacity)), 0).astype(np.uint8)
    layer = Image.fromarray(np.dstack([rgb, alpha]), "RGBA")
    pixel = pyramid.placement.cell_size * pyramid.levels[0][1] / width
    size = (max(1, round(width * pixel * scale)), max(1, round(height * pixel * scale)))
    resample = Image.Resampling.NEAREST if labels or pixel * scale >= 2 else Image.Resampling.BILINEAR
    canvas = Image.new("RGBA", base.size, (0, 0, 0, 0))
    canvas.paste(layer.resize(size, resample), (0, 0))
    picture = Image.alpha_composite(base, canvas).convert("RGB")
    framed = Image.new("RGB", (picture.size[0], picture.size[1] + LEGEND_HEIGHT), (255, 255, 255))
    framed.paste(picture, (0, 0))
    draw_legend(framed, picture.size[1], labels, heat_class, class_names, pyramid.classes)
    framed.save(path)


def draw_legend(image: Image.Image, top: int, labels: bool, heat_class: int, class_names: Sequence[str],
                classes: int) -> None:
    """Below ``top``: class swatches with names (labels), or the colour bar of P(class) from 0 to 1."""
    from PIL import Image, ImageDraw

    draw = ImageDraw.Draw(image)
    y = top + 6
    x = 6
    if labels:
        for index in range(classes):
            name = class_names[index] if index < len(class_names) else str(index)
            draw.rectangle((x, y, x + 14, y + 14), fill=class_color(index), outline=(0, 0, 0))
            draw.text((x + 18, y + 2), name, fill=(0, 0, 0))
            x += 18 + int(draw.textlength(name)) + 14
        return
    name = class_names[heat_class] if heat_class < len(class_names) else str(heat_class)
    text = f"P({name})  0"
    draw.text((x, y + 2), text, fill=(0, 0, 0))
    x += int(draw.textlength(text)) + 6
    bar = max(32, min(256, image.size[0] - x - 40))
    ramp = colormap_lut()[np.linspace(0, 255, bar).astype(int)]
    image.paste(Image.fromarray(np.repeat(ramp[None], 14, axis=0).astype(np.uint8), "RGB"), (x, y))
    draw.rectangle((x, y, x + bar, y + 14), outline=(0, 0, 0))
    draw.text((x + bar + 6, y + 2), "1", fill=(0, 0, 0))
