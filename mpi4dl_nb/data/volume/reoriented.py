"""What reading a set of volumes in RAS axes did to it, in one message for the run to say once: the volumes whose
stored axes were swapped or reversed, the oblique ones kept on their voxel grid, the label volumes placed against
their image's axes."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .files import VolumeInfo
from .orientation import Orientation

SHOWN = 4                                   # files named per kind of change
READ_AXES = ("inferior-superior", "posterior-anterior", "left-right")   # the world axis each of D, H, W runs along


def _name(path: Path) -> str:
    """``masks/b.nii.gz``: a file with its folder."""
    return f"{path.parent.name}/{path.name}"


def _listed(items: Sequence[str]) -> str:
    shown = ", ".join(items[:SHOWN])
    return shown + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


def _against(image: Orientation, labels: Orientation) -> str:
    """How a label volume's axes differ from its image's: ``mirrored left-right``, ``axes in another order``."""
    if image.grid_axes != labels.grid_axes:
        return "stored with its axes in another order"
    flipped = [axis for axis, a, b in zip(READ_AXES, image.reversed, labels.reversed, strict=True) if a != b]
    return "mirrored " + " and ".join(flipped)


def reoriented_note(images: Sequence[VolumeInfo], labels: Sequence[VolumeInfo] = ()) -> str | None:
    """The message on ``images`` (with their label volumes ``labels``, in order, when any) read in RAS axes; None
    when reading changed nothing (every volume stored RAS, or stating no axes)."""
    turned = [f"{_name(info.path)} ({info.orientation.codes})" for info in images
              if info.orientation.reorients and not info.orientation.oblique]
    oblique = [f"{_name(info.path)} ({info.orientation.describe()})" for info in images if info.orientation.oblique]
    placed = []
    for image, label in zip(images, labels):
        mine, theirs = image.orientation, label.orientation
        if mine.stated and theirs.stated and (mine.grid_axes, mine.reversed) != (theirs.grid_axes, theirs.reversed):
            placed.append(f"{_name(label.path)} ({theirs.codes}) {_against(mine, theirs)} against its image "
                          f"{_name(image.path)} ({mine.codes})")
        elif not mine.stated and theirs.stated and theirs.reorients:
            placed.append(f"{_name(label.path)} states {theirs.codes} axes, its image {_name(image.path)} none: "
                          f"paired voxel for voxel as stored")
    parts = []
    if turned:
        parts.append(f"{len(turned)} reoriented: {_listed(turned)}")
    if oblique:
        parts.append(f"{len(oblique)} oblique, read in their closest RAS axes and trained on their voxel grid as "
                     f"stored (not rotated): {_listed(oblique)}")
    if placed:
        parts.append(f"{len(placed)} label volume(s) placed by their own affine, exactly: {_listed(placed)} (if a "
                     f"label volume's header is wrong, give it its image's affine)")
    if not parts:
        return None
    return ("volumes read in RAS axes (D, H, W = inferior-superior, posterior-anterior, left-right; axes swapped and "
            "reversed exactly, no resampling): " + "; ".join(parts))
