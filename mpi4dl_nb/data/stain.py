"""Stain normalisation (Macenko, Reinhard): a reference image's stain fitted once, and the per-pixel map that brings an
image's stain to it (the image's own stain estimated from the whole image, so any box of it maps alike)."""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Protocol

import numpy as np

from ..config import ConfigError

KNOB = "--stain-reference"
LEVELS = 256.0                 # pixel values 0..255 are read as (value + 1) / 256: never zero, so logs stay finite
MIN_OD = 0.15                  # Macenko's beta: a pixel whose optical density is below it in a channel is background
ANGLE_PERCENTILE = 1.0         # Macenko's alpha: the stain directions are the 1st and 99th percentile angles
MAX_PERCENTILE = 99.0          # a stain's robust maximum concentration
MIN_STAINED = 64               # fewer stained pixels than this: the image's stain is not estimated (left as it is)
# Reinhard et al. 2001: RGB -> LMS cone space, then (log10) -> l alpha beta, decorrelated axes
RGB_TO_LMS = np.array([[0.3811, 0.5783, 0.0402], [0.1967, 0.7244, 0.0782], [0.0241, 0.1288, 0.8444]])
LMS_TO_LAB = np.diag([1 / np.sqrt(3), 1 / np.sqrt(6), 1 / np.sqrt(2)]) @ np.array(
    [[1.0, 1.0, 1.0], [1.0, 1.0, -2.0], [1.0, -1.0, 0.0]])


class StainMethod(str, Enum):
    """How stains are normalised: ``macenko`` (stain vectors and concentrations) or ``reinhard`` (lαβ mean/std)."""

    MACENKO = "macenko"
    REINHARD = "reinhard"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: StainMethod | str) -> StainMethod:
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ConfigError("--stain-normalize", f"{value!r}: choose one of "
                                                   f"{', '.join(m.value for m in cls)}") from None


class PixelMap(Protocol):
    """A fixed per-pixel colour map: (..., 3) float64 pixel values 0..255 in, the same out."""

    def __call__(self, rgb: np.ndarray) -> np.ndarray: ...


def times(matrix: np.ndarray, pixels: np.ndarray) -> np.ndarray:
    """``matrix @ pixel`` for every pixel of (..., n), written out channel by channel (no BLAS: the same bits for a
    pixel whatever the box around it)."""
    channels = [pixels[..., k] for k in range(pixels.shape[-1])]
    rows = []
    for row in matrix:
        total = row[0] * channels[0]
        for weight, channel in zip(row[1:], channels[1:], strict=True):
            total = total + weight * channel
        rows.append(total)
    return np.stack(rows, axis=-1)


def optical_density(rgb: np.ndarray) -> np.ndarray:
    """Beer-Lambert optical density of pixel values 0..255 (light absorbed; white glass ~0)."""
    return -np.log((np.ascontiguousarray(rgb, dtype=np.float64) + 1.0) / LEVELS)


def from_density(od: np.ndarray) -> np.ndarray:
    """Pixel values 0..255 of optical densities (clipped)."""
    return np.clip(LEVELS * np.exp(-od) - 1.0, 0.0, 255.0)


def stained(rgb: np.ndarray) -> np.ndarray:
    """The pixels (n, 3) of an image that carry stain: optical density at least ``MIN_OD`` in every channel."""
    od = optical_density(rgb.reshape(-1, 3))
    return np.ascontiguousarray(rgb.reshape(-1, 3)[(od >= MIN_OD).all(axis=1)], dtype=np.float64)


def sum_of(values: np.ndarray) -> float:
    """A sum that does not depend on BLAS or threads (numpy's pairwise sum of a contiguous copy)."""
    return float(np.add.reduce(np.ascontiguousarray(values, dtype=np.float64)))


def covariance(columns: np.ndarray) -> np.ndarray:
    """The covariance matrix of the columns of ``columns`` (n, k), summed without BLAS."""
    centred = columns - np.array([sum_of(columns[:, k]) / len(columns) for k in range(columns.shape[1])])
    k = columns.shape[1]
    return np.array([[sum_of(centred[:, i] * centred[:, j]) / max(len(columns) - 1, 1) for j in range(k)]
                     for i in range(k)])


# ----------------------------------------------------------------- Macenko 2009
def stain_vectors(od: np.ndarray) -> np.ndarray:
    """Macenko's two stain vectors (3, 2) of stained optical densities ``od`` (n, 3): the plane of the two largest
    principal directions, the 1st and 99th percentile angles in it; haematoxylin (more red absorbed) first."""
    _, vectors = np.linalg.eigh(covariance(od))
    plane = vectors[:, [2, 1]]                       # eigh sorts ascending
    plane = plane * np.where(plane.sum(axis=0) < 0, -1.0, 1.0)    # pointing into positive density
    projected = times(plane.T, od)
    angles = np.arctan2(projected[:, 1], projected[:, 0])
    low, high = np.percentile(angles, [ANGLE_PERCENTILE, 100.0 - ANGLE_PERCENTILE])
    found = np.stack([plane @ np.array([np.cos(a), np.sin(a)]) for a in (low, high)], axis=1)
    found = found / np.linalg.norm(found, axis=0)
    return found if found[0, 0] >= found[0, 1] else found[:, ::-1]


def concentrations(vectors: np.ndarray, od: np.ndarray) -> np.ndarray:
    """Each pixel's amount (n, 2) of the two stains ``vectors`` (least squares)."""
    return times(np.linalg.pinv(vectors), od)


def macenko_fit(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(stain vectors (3, 2), robust maximum concentrations (2,)) of an image, or None with too few stained pixels."""
    pixels = stained(rgb)
    if len(pixels) < MIN_STAINED:
        return None
    od = optical_density(pixels)
    vectors = stain_vectors(od)
    amounts = concentrations(vectors, od)
    return vectors, np.percentile(amounts, MAX_PERCENTILE, axis=0)


@dataclass(frozen=True)
class DensityMap:
    """Macenko's normalisation of one image as a fixed 3x3 map of optical densities."""

    matrix: np.ndarray

    def __call__(self, rgb: np.ndarray) -> np.ndarray:
        return from_density(times(self.matrix, optical_density(rgb)))


# ----------------------------------------------------------------- Reinhard 2001
def to_lab(rgb: np.ndarray) -> np.ndarray:
    """Reinhard's lαβ of pixel values 0..255."""
    return times(LMS_TO_LAB, np.log10(times(RGB_TO_LMS, (np.asarray(rgb, dtype=np.float64) + 1.0) / LEVELS)))


def from_lab(lab: np.ndarray) -> np.ndarray:
    """Pixel values 0..255 (clipped) of lαβ colours."""
    lms = np.power(10.0, times(np.linalg.inv(LMS_TO_LAB), lab))
    return np.clip(LEVELS * times(np.linalg.inv(RGB_TO_LMS), lms) - 1.0, 0.0, 255.0)


def reinhard_fit(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(mean (3,), standard deviation (3,)) of an image's stained pixels in lαβ, or None with too few of them."""
    pixels = stained(rgb)
    if len(pixels) < MIN_STAINED:
        return None
    lab = to_lab(pixels)
    mean = np.array([sum_of(lab[:, k]) / len(lab) for k in range(3)])
    std = np.sqrt(np.array([sum_of((lab[:, k] - mean[k]) ** 2) / len(lab) for k in range(3)]))
    return mean, std


@dataclass(frozen=True)
class LabMap:
    """Reinhard's normalisation of one image: each lαβ channel shifted and scaled."""

    scale: np.ndarray
    shift: np.ndarray

    def __call__(self, rgb: np.ndarray) -> np.ndarray:
        lab = to_lab(rgb)
        return from_lab(np.stack([lab[..., k] * self.scale[k] + self.shift[k] for k in range(3)], axis=-1))


def identity(rgb: np.ndarray) -> np.ndarray:
    """An image whose stain cannot be estimated (blank glass) is left as it is."""
    return np.asarray(rgb, dtype=np.float64)


# ----------------------------------------------------------------- the normaliser a run records
@dataclass(frozen=True)
class StainNormalizer:
    """A method and its reference's stain: Macenko's stain vectors (haematoxylin, eosin; 3 values each) and maximum
    concentrations, or Reinhard's lαβ mean and standard deviation; the reference's name and fingerprint."""

    method: StainMethod
    first: tuple[float, ...]       # Macenko: stain vectors (6 values, column by column); Reinhard: mean (3)
    second: tuple[float, ...]      # Macenko: maximum concentrations (2); Reinhard: standard deviation (3)
    reference: str = ""
    fingerprint: str = ""

    def map_for(self, rgb: np.ndarray) -> PixelMap:
        """The per-pixel map normalising an image whose whole (or fixed overview) is ``rgb`` (H, W, 3) 0..255."""
        if self.method is StainMethod.MACENKO:
            fitted = macenko_fit(rgb)
            if fitted is None:
                return identity
            vectors, maxima = fitted
            target = np.array(self.first).reshape(2, 3).T
            ratio = np.diag(np.array(self.second) / np.maximum(maxima, 1e-12))
            return DensityMap(target @ ratio @ np.linalg.pinv(vectors))
        found = reinhard_fit(rgb)
        if found is None:
            return identity
        mean, std = found
        scale = np.where(std > 0, np.array(self.second) / np.where(std > 0, std, 1.0), 1.0)
        return LabMap(scale, np.array(self.first) - mean * scale)

    def describe(self) -> str:
        """One line: the method and its reference."""
        return f"{self.method} to {self.reference} [{self.fingerprint}]"

    def to_dict(self) -> dict[str, object]:
        return {"method": self.method.value, "first": list(self.first), "second": list(self.second),
                "reference": self.reference, "fingerprint": self.fingerprint}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> StainNormalizer:
        """The normaliser ``to_dict`` stored; ValueError naming a bad field."""
        method = data.get("method")
        if method not in tuple(m.value for m in StainMethod):
            raise ValueError(f"field 'method': expected one of macenko, reinhard, got {method!r}")
        numbers = {key: numbers_of(data, key) for key in ("first", "second")}
        sizes = (6, 2) if method == StainMethod.MACENKO.value else (3, 3)
        if (len(numbers["first"]), len(numbers["second"])) != sizes:
            raise ValueError(f"fields 'first', 'second': {method} keeps {sizes[0]} and {sizes[1]} numbers")
        return cls(StainMethod(method), numbers["first"], numbers["second"], str(data.get("reference", "")),
                   str(data.get("fingerprint", "")))


def numbers_of(data: Mapping[str, object], key: str) -> tuple[float, ...]:
    """``data[key]`` as a tuple of numbers; ValueError otherwise."""
    value = data.get(key)
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise ValueError(f"field {key!r}: expected a list of numbers, got {value!r}")
    return tuple(float(v) for v in value)


def file_fingerprint(path: Path) -> str:
    """The first 16 hex digits of a file's SHA-256."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def read_reference(path: str | Path) -> np.ndarray:
    """The reference image's RGB pixels (H, W, 3) uint8; ConfigError naming ``--stain-reference``."""
    from PIL import Image, UnidentifiedImageError

    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(KNOB, f"{str(path)!r} is not a file; give an image (PNG, JPEG, TIFF) stained as the "
                                f"images should look")
    try:
        with Image.open(file) as image:
            return np.asarray(image.convert("RGB"))
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as err:
        raise ConfigError(KNOB, f"cannot read {file} as an image ({err}); give a PNG, JPEG or TIFF tile") from err


def fit_reference(method: StainMethod | str, path: str | Path) -> StainNormalizer:
    """The normaliser bringing images to the stain of the image at ``path`` (ConfigError: no tissue in it)."""
    chosen = StainMethod.parse(method)
    rgb = read_reference(path)
    fitted = macenko_fit(rgb) if chosen is StainMethod.MACENKO else reinhard_fit(rgb)
    if fitted is None:
        raise ConfigError(KNOB, f"{path} has fewer than {MIN_STAINED} stained pixels (optical density >= {MIN_OD} "
                                f"in every channel); give a tile with tissue")
    first, second = fitted
    values = first.T.reshape(-1) if chosen is StainMethod.MACENKO else first
    file = Path(path).expanduser()
    return StainNormalizer(chosen, tuple(float(v) for v in values), tuple(float(v) for v in second), file.name,
                           file_fingerprint(file))


@dataclass(frozen=True)
class StainRequest:
    """``--stain-normalize METHOD --stain-reference IMAGE``: what a run is asked to normalise to (fitted once)."""

    method: StainMethod
    reference: str

    def fit(self) -> StainNormalizer:
        return fit_reference(self.method, self.reference)
