"""Reads with stain normalisation: a dataset's images normalised by a run's StainNormalizer, each image by its own
stain estimated from the whole image (a slide's tiles: from the slide's overview), never from the box a rank reads."""
from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from ..config import ConfigError
from .dataset import Box, RegionDataset
from .stain import PixelMap, StainNormalizer

OVERVIEW_SIDE = 1024     # an image's stain is estimated from at most this many pixels per side (a fixed overview)


def as_values(image: torch.Tensor) -> np.ndarray:
    """A (C, H, W) image in [0, 1] as (H, W, C) float64 values 0..255."""
    return np.ascontiguousarray(image.permute(1, 2, 0).to(torch.float64).numpy() * 255.0)


def stain_normalized(image: torch.Tensor, pixel_map: PixelMap) -> torch.Tensor:
    """A (C, H, W) image in [0, 1] mapped pixel by pixel, in its own dtype."""
    out = torch.from_numpy(np.ascontiguousarray(pixel_map(as_values(image)) / 255.0)).permute(2, 0, 1)
    return out.to(image.dtype).contiguous()


class StainedReads:
    """Mixin of the datasets that normalise stains: ``read`` is ``read_pixels``, normalised once ``use_stain`` gave
    a normaliser. ``stain_pixels`` are what an image's stain is estimated from (default: the whole image), shared by the
images of one ``stain_key``."""

    stain: StainNormalizer | None = None
    image_size: int

    def read_pixels(self, index: int, box: Box | None = None) -> torch.Tensor:
        """Image ``index`` (C, H, W) float in [0, 1] as stored, only ``box`` of it."""
        raise NotImplementedError

    def stain_key(self, index: int) -> Hashable:
        """The images whose stain is estimated once for all share a key (default: each image its own)."""
        return ("image", index)

    def stain_pixels(self, index: int) -> np.ndarray:
        """The pixels (H, W, 3), values 0..255, image ``index``'s stain is estimated from: the whole image, or every
        k-th pixel of every k-th row of an image larger than ``OVERVIEW_SIDE``."""
        step = -(-self.image_size // OVERVIEW_SIDE)
        return as_values(self.read_pixels(index)[:, ::step, ::step])

    def use_stain(self, normalizer: StainNormalizer | None) -> None:
        """Normalise every read with ``normalizer`` from now on (None: read as stored)."""
        self.stain = normalizer
        self.stain_maps: dict[Hashable, PixelMap] = {}

    def stain_map(self, index: int) -> PixelMap:
        """Image ``index``'s per-pixel map (estimated once per source, kept)."""
        assert self.stain is not None, "use_stain gave a normaliser"
        key = self.stain_key(index)
        if key not in self.stain_maps:
            self.stain_maps[key] = self.stain.map_for(self.stain_pixels(index))
        return self.stain_maps[key]

    def read(self, index: int, box: Box | None = None) -> torch.Tensor:
        """Image ``index`` (C, H, W) float in [0, 1], stain normalised when asked, only ``box`` of it."""
        image = self.read_pixels(index, box)
        return image if self.stain is None else stain_normalized(image, self.stain_map(index))


@runtime_checkable
class StainAware(Protocol):
    """A dataset that can normalise its images' stains (``stain``: the normaliser it reads through, None: none)."""

    @property
    def stain(self) -> StainNormalizer | None: ...

    def use_stain(self, normalizer: StainNormalizer | None) -> None: ...


def stain_of(dataset: RegionDataset) -> StainNormalizer | None:
    """The normaliser ``dataset`` reads its images through (None: none, or data without stains)."""
    return dataset.stain if isinstance(dataset, StainAware) else None


def with_stain(dataset: RegionDataset, normalizer: StainNormalizer | None) -> RegionDataset:
    """``dataset`` reading its images normalised by ``normalizer`` (None: unchanged); ConfigError for data without
    stains (generated images, CIFAR-10)."""
    if normalizer is None:
        return dataset
    if not isinstance(dataset, StainAware):
        raise ConfigError("--stain-normalize", f"{normalizer.method} normalises the stain of pathology images "
                                               f"(--app medical, --cohort); {type(dataset).__name__} has none: use "
                                               f"pathology data, or a run without --stain-normalize")
    dataset.use_stain(normalizer)
    return dataset
