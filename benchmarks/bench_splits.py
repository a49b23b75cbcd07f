"""Reading a ``folder`` dataset whose captions file has no split column, where the images'
splits are drawn (``sat_model.data.sources.folder.read_folder``), measured side by side in one run.

Writes JSON to stdout and ``benchmarks/results/splits.json``:

- ``read_folder``: seconds to read a CSV of N rows (one caption per image) and draw its splits,
  for N up to 100,000;
- ``draw``: seconds of the draw alone, as it is and as it was (the sorted list rebuilt for
  every drawn file), at sizes where the old draw still ends in seconds.

The images are not opened (prepare checks them after the read): this measures the read and the
draw, which ``sat profile new`` and prepare both pay.

    .venv/bin/python benchmarks/bench_splits.py [--rows 100000]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

import sat_model.config  # noqa: F401  (before sources: config and sources import each other)
from sat_model.data.sources.folder import FolderConfig, _draw_splits, read_folder

__all__ = ["main"]

RESULTS = Path(__file__).resolve().parent / "results" / "splits.json"


def _quadratic_draw(files: list[str], val: int, test: int, seed: int) -> dict[str, str]:
    """The draw as it was before: ``sorted(files)`` inside the loop."""
    order = np.random.default_rng(seed).permutation(len(files))
    pool = [sorted(files)[i] for i in order]
    return {
        f: "val" if i < val else "test" if i < val + test else "train" for i, f in enumerate(pool)
    }


def _timed(run) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    run()
    return round(time.perf_counter() - start, 4)


def _read_folder_s(rows: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "photos").mkdir()
        lines = ["file,caption"] + [f"img_{i:06d}.jpg,a dog runs on the grass" for i in range(rows)]
        (root / "captions.csv").write_text("\n".join(lines) + "\n")
        return _timed(
            lambda: read_folder(
                root,
                FolderConfig(
                    images_dir="photos",
                    captions_file="captions.csv",
                    format="csv",
                    val_images=100,
                    test_images=100,
                    seed=0,
                ),
            )
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    args = parser.parse_args(argv)
    sizes = [n for n in (1_000, 10_000, args.rows) if n <= args.rows]
    files = {n: [f"img_{i:06d}.jpg" for i in range(n)][::-1] for n in (2_000, 5_000, 10_000)}
    same = all(
        _draw_splits(f, 100, 100, 0) == _quadratic_draw(f, 100, 100, 0) for f in files.values()
    )
    result = {
        "machine": platform.machine(),
        "python": platform.python_version(),
        "read_folder": [{"rows": n, "seconds": _read_folder_s(n)} for n in sizes],
        "draw": [
            {
                "files": n,
                "seconds_now": _timed(lambda f=f: _draw_splits(f, 100, 100, 0)),  # type: ignore[misc]
                "seconds_before": _timed(lambda f=f: _quadratic_draw(f, 100, 100, 0)),  # type: ignore[misc]
            }
            for n, f in files.items()
        ],
        "same_splits_as_before": same,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
