"""The bundled real pathology sample: scikit-image's IHC-stained tissue image (512x512 RGB), cut into tiles, and its
DAB-positive stand-in mask for segmentation."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .dataset import Box, check_box, to_tensor
from .stain_reads import StainedReads

SAMPLE_SIDE = 512
TRANSFORMS = 8  # the dihedral group: 4 rotations x optional flip
DAB_SMOOTHING = 2.0   # Gaussian sigma (pixels) of the DAB density before thresholding: regions, not speckle
DAB_CLASSES = ("background", "DAB")   # the classes of the stand-in mask, in label order


def ihc_image() -> np.ndarray:
    """skimage.data.immunohistochemistry(): 512x512x3 uint8, human colon tissue, DAB + haematoxylin."""
    from skimage import data

    return data.immunohistochemistry()


def dab_density(rgb: np.ndarray) -> float:
    """Mean DAB (brown stain) optical density of an RGB tile (colour deconvolution)."""
    from skimage.color import rgb2hed

    return float(rgb2hed(rgb)[:, :, 2].mean())


def dab_mask(rgb: np.ndarray, threshold: float | None = None, sigma: float = DAB_SMOOTHING) -> np.ndarray:
    """A stand-in per-pixel label of an RGB image: 1 where colour deconvolution finds DAB (brown) stain, else 0.

    The DAB optical density (``skimage.color.rgb2hed``), smoothed by a Gaussian of ``sigma`` pixels, above
    ``threshold`` (default: Otsu's threshold of the smoothed density). uint8 ``(H, W)``. It marks where the
    stain is, which is not a pathologist's annotation: use it to try segmentation, not to judge a model.
    """
    from skimage.color import rgb2hed
    from skimage.filters import gaussian, threshold_otsu

    density = rgb2hed(rgb)[:, :, 2]
    if sigma > 0:
        density = gaussian(density, sigma=sigma)
    cut = threshold_otsu(density) if threshold is None else threshold
    return (density > cut).astype(np.uint8)


def dihedral(x: torch.Tensor, k: int) -> torch.Tensor:
    """Transform ``k`` (0..7) of a (C,) H, W tensor: ``k % 4`` quarter turns, flipped when ``k >= 4``."""
    if k >= 4:
        x = x.flip(-1)
    return torch.rot90(x, k % 4, dims=(-2, -1))


class IHCSampleDataset(StainedReads):
    """Tiles of the IHC sample labelled by how much DAB stain they hold (quantile classes).

    ``image_size <= 512``: crops on a grid of ``stride`` (default half a tile); larger sizes use
    the whole image upscaled (bilinear). Each crop appears in its 8 rotations/flips. Label
    ``c`` means the crop's DAB density lies in quantile bin ``c`` of ``num_classes`` bins.
    """

    def __init__(self, image_size: int = 256, *, num_classes: int = 2, stride: int | None = None) -> None:
        if image_size < 1 or num_classes < 1:
            raise ValueError(f"image_size and num_classes must be >= 1, got {image_size}, {num_classes}")
        self.image_size = image_size
        self.channels = 3
        self.num_classes = num_classes
        source = ihc_image()
        if image_size <= SAMPLE_SIDE:
            step = stride or max(1, image_size // 2)
            starts = list(range(0, SAMPLE_SIDE - image_size + 1, step))
            self.corners = [(y, x) for y in starts for x in starts]
            self.pixels = source
        else:
            self.corners = [(0, 0)]
            big = F.interpolate(to_tensor(source)[None], size=(image_size, image_size),
                                mode="bilinear", align_corners=False)[0]
            self.pixels = (big.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
        size = image_size
        density = np.array([dab_density(self.pixels[y:y + size, x:x + size])
                            for y, x in self.corners])
        edges = np.quantile(density, np.linspace(0, 1, num_classes + 1)[1:-1]) if num_classes > 1 else []
        self.crop_labels = [int(np.searchsorted(edges, d, side="right")) for d in density]

    def __len__(self) -> int:
        return len(self.corners) * TRANSFORMS

    def label(self, index: int) -> int:
        return self.crop_labels[index // TRANSFORMS]

    def items(self, crops: Sequence[int]) -> list[int]:
        """The indices of every rotation/flip of ``crops`` (positions in ``corners``), ascending: hold out whole
        crops, so that no held-out crop is seen turned in training."""
        return sorted(crop * TRANSFORMS + k for crop in crops for k in range(TRANSFORMS))

    def read_pixels(self, index: int, box: Box | None = None) -> torch.Tensor:
        r0, r1, c0, c1 = check_box(box, self.image_size)
        y, x = self.corners[index // TRANSFORMS]
        crop = to_tensor(self.pixels[y:y + self.image_size, x:x + self.image_size])
        return dihedral(crop, index % TRANSFORMS)[:, r0:r1, c0:c1].contiguous()


class IHCMaskDataset(IHCSampleDataset):
    """The IHC sample's tiles (as :class:`IHCSampleDataset`) with the stand-in mask of :func:`dab_mask`:
    class 1 DAB-positive, 0 not (``DAB_CLASSES``). The mask is made once for the whole image and cropped
    and turned with it."""

    def __init__(self, image_size: int = 256, *, stride: int | None = None, threshold: float | None = None) -> None:
        super().__init__(image_size, num_classes=1, stride=stride)
        self.num_classes = 2
        self.mask = dab_mask(self.pixels, threshold)

    def read_mask(self, index: int, box: Box | None = None) -> torch.Tensor:
        """The mask of tile ``index`` (int64 ``(h, w)``), only ``box`` of it."""
        r0, r1, c0, c1 = check_box(box, self.image_size)
        y, x = self.corners[index // TRANSFORMS]
        crop = torch.from_numpy(self.mask[y:y + self.image_size, x:x + self.image_size].astype(np.int64))
        return dihedral(crop, index % TRANSFORMS)[r0:r1, c0:c1].contiguous()
