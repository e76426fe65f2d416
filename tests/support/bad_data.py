"""Test data with faults: tile folders of real tissue, and PNG/TIFF files damaged in known ways."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np


def write_tiles(folder: Path, per_class: int = 4, classes: tuple[str, ...] = ("a", "b"),
                size: int = 40) -> list[Path]:
    """PNG tiles cut from the bundled IHC image, ``per_class`` in each ``folder/<class>/`` (flat if no classes)."""
    from PIL import Image

    from mpi4dl_nb.data import ihc_image

    source = ihc_image()
    paths = []
    for c, name in enumerate(classes or ("",)):
        sub = folder / name if name else folder
        sub.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            y, x = 37 * i % (512 - size), 53 * (i + 3 * c) % (512 - size)
            path = sub / f"tile{i}.png"
            Image.fromarray(np.ascontiguousarray(source[y:y + size, x:x + size])).save(path)
            paths.append(path)
    return paths


def truncate(path: Path, fraction: float = 0.5) -> Path:
    """Cut ``path`` to ``fraction`` of its bytes (an interrupted copy)."""
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * fraction)])
    return path


def flip_bytes(path: Path, at: float = 0.6, count: int = 8) -> Path:
    """Invert ``count`` bytes at ``at`` of the file (bit rot: a PNG's chunk CRC no longer matches)."""
    data = bytearray(path.read_bytes())
    start = int(len(data) * at)
    for i in range(start, min(len(data), start + count)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def png_with_bad_pixel_data(path: Path) -> Path:
    """Replace a PNG's compressed pixels by garbage with a correct CRC: the headers and chunk
    checksums pass, decoding fails (what only a full read finds)."""
    data = path.read_bytes()
    out, pos = [data[:8]], 8
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IDAT":
            body = bytes((b * 7 + 13) % 256 for b in body)
        out.append(struct.pack(">I4s", len(body), kind) + body
                   + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))
        pos += 12 + length
    path.write_bytes(b"".join(out))
    return path
