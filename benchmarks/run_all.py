"""Run every benchmark in turn (`make bench`); each writes its JSON to benchmarks/results/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = (
    "bench_extract.py",
    "bench_model.py",
    "bench_epoch.py",
    "bench_ray_train.py",
    "bench_eval.py",
    "bench_caption.py",
    "bench_pipeline.py",
)


def main() -> int:
    failed = []
    for name in SCRIPTS:
        print(f"== {name}", file=sys.stderr)
        if subprocess.run([sys.executable, str(HERE / name)]).returncode != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
