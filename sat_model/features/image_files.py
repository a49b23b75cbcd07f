"""Which files of the folders given to ``sat caption`` are images.

Plain paths, no PyTorch: a command finds (or misses) its inputs before it loads a model.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

__all__ = ["IMAGE_EXTENSIONS", "find_image_files"]

# what a folder given to ``sat caption`` is searched for (case-insensitive); a file named
# explicitly is read whatever its name
IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}
)


def find_image_files(inputs: Iterable[str | Path]) -> list[Path]:
    """Each input file as given, and every image file under each input folder (recursive,
    sorted, symlinked files included, symlinked folders not followed)."""
    out: list[Path] = []
    for item in map(Path, inputs):
        if not item.is_dir():
            out.append(item)  # a missing or unreadable file gets its error when read
            continue
        for root, dirs, files in os.walk(item):
            dirs.sort()
            out += [
                Path(root) / f
                for f in sorted(files)
                if Path(f).suffix.lower() in IMAGE_EXTENSIONS and not _special(Path(root) / f)
            ]
    return out


def _special(path: Path) -> bool:
    """A FIFO, socket or device: not a photo, and opening a FIFO waits for a writer forever.
    A dangling link is no special file: it is listed and its error said when it is read."""
    try:
        return not stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False
