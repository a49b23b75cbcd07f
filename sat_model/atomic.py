"""Atomic file writes: readers see the old file or the new one, never half of either.

The data goes to a temporary file in the destination's own folder (same filesystem, so the
rename is atomic), is flushed to disk, then ``os.replace`` puts it in place.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_bytes_atomic", "write_text_atomic"]


def write_bytes_atomic(path: str | Path, data: bytes, durable: bool = True) -> None:
    """Write ``data`` to ``path`` atomically, creating the parent folder if needed.

    ``durable=False`` skips the fsync: still all-or-nothing for readers, but a power cut may
    lose the file; fine for many small files that are cheap to regenerate.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; outputs are shared data, readable by all
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    write_bytes_atomic(path, text.encode("utf-8"))
