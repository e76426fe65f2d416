"""The data options several commands take (train, evaluate, infer, layout, tune), each declared once: a job's field is
``OPTION.field(default)``; the type of ``--image-size`` (an image side or a volume's D,H,W)."""
from __future__ import annotations

from ..schema import Bounds, number, option, whole_number
from .apps import AppKind
from .task import Task
from .tissue_mask import SATURATION_TISSUE, TissueMethod

VolumeSize = tuple[int, int, int]
ImageSize = int | VolumeSize


def parse_image_size(text: str) -> ImageSize:
    """``--image-size``: ``N`` (an image side) or ``D,H,W`` (a volume's patch); ValueError otherwise."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        sides = [int(p) for p in parts]
    except ValueError:
        raise ValueError("give an image side N or a volume's D,H,W (integers)") from None
    if len(sides) == 1:
        return sides[0]                   # checked with the other numbers (its bounds)
    if len(sides) != 3 or min(sides) < 1:
        raise ValueError("give an image side N or a volume's D,H,W (each >= 1)")
    return sides[0], sides[1], sides[2]


APP = option("--app", "data: medical (1), cifar (2) or synthetic (3)", parse=AppKind.parse, metavar="APP")
DATAPATH = option("--datapath", "dataset path: tile folder / slide file(s) for medical, CIFAR-10 binary batches for "
                                "cifar (medical default: bundled IHC sample)")
IMAGE_SIZE = option("--image-size", "image side in pixels (square images), or a volume patch's depth,height,width in "
                                    "voxels (--model unet3d; layout checks its tiles against a DxRxC --slice-method)",
                    parse=parse_image_size, metavar="N|D,H,W", bounds=Bounds(1))
NUM_SAMPLES = option("--num-samples", "images in the synthetic dataset", parse=whole_number, bounds=Bounds(1))
COHORT = option("--cohort", "slides from a manifest: columns slide (path, relative to the file), label, optional "
                            "patient, fold, split (train, evaluate: tiles labelled by their slide, split by patient; "
                            "infer: each slide's label and patient in the summary table)", metavar="FILE.csv")
SLIDE_LEVEL = option("--slide-level", "slides: the pyramid level the tiles are read from (evaluate, infer: read as "
                                      "it is, not with --mpp)", parse=whole_number, bounds=Bounds(0))
MIN_TISSUE = option("--min-tissue", "slides: the least tissue fraction of a tile kept (infer: with --tissue-only, "
                                    "windows whose tissue share is at most this are skipped)", parse=number,
                    bounds=Bounds(0, 1))
TISSUE = option("--tissue", "slides: what counts as tissue on a slide's low-resolution overview (for --min-tissue; "
                            "infer: with --tissue-only): saturation: HSV saturation above the fixed "
                            f"{SATURATION_TISSUE}; otsu: above Otsu's threshold of the slide's own saturation (as CLAM "
                            "and TIAToolbox); near-black pixels never", parse=TissueMethod.parse,
                choices=TissueMethod.values(), metavar="METHOD")
REPAIR_ANNOTATIONS = option("--repair-annotations", "annotated slides: repair invalid polygons (a ring crossing "
                                                    "itself, a hole crossing or outside its outer ring ...) with "
                                                    "shapely.make_valid, one line per changed feature (default: "
                                                    "refuse them, naming the feature)", switch=True)
TASK = option("--task", "classification (a class per image) or segmentation (a class per pixel: masks or QuPath "
                        "annotations, a dense model such as --model unet); evaluate, infer: refuse a checkpoint of "
                        "the other task", parse=Task.parse, choices=Task.values())
STAIN_NORMALIZE = option("--no-stain-normalize", "read the images as stored, not through the stain normaliser the "
                                                 "checkpoint records (by default they are read as the training run "
                                                 "read them)", switch=True)
