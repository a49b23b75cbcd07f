"""Wall-clock time of each DVC stage of the default pipeline, as `make run` runs it.

Runs the stages one by one (`dvc repro --single-item --force <stage>`) in a git clone of this
repository's HEAD (or in ``--project``), so nothing is cached, and writes the seconds of each
stage and their total to stdout and ``benchmarks/results/pipeline.json``.

    .venv/bin/python benchmarks/bench_pipeline.py [--project DIR] [-S key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sat_model.config import ATTENTION_KINDS

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "pipeline.json"
STAGES = (
    "prepare",
    "extract",
    "train@soft",
    "train@hard",
    "evaluate@soft",
    "evaluate@hard",
    "register",
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


def time_stages(project: Path) -> dict[str, float]:
    dvc = str(Path(sys.executable).parent / "dvc")
    seconds = {}
    for stage in STAGES:
        start = time.perf_counter()
        subprocess.run(
            [dvc, "repro", "--single-item", "--force", stage], cwd=project, env=_env(), check=True
        )
        seconds[stage] = round(time.perf_counter() - start, 1)
        print(f"{stage}: {seconds[stage]} s", file=sys.stderr)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", type=Path, help="existing project dir (default: a clone)")
    parser.add_argument("-S", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        project = args.project
        if project is None:
            project = Path(tmp) / "sat"
            subprocess.run(["git", "clone", "-q", str(ROOT), str(project)], check=True)
        if args.overrides:
            # the same dotted syntax as `dvc exp run -S`, written into the clone's params.yaml
            import yaml

            from sat_model.params import apply_overrides, read_yaml

            raw = read_yaml((project / "params.yaml").read_text())
            (project / "params.yaml").write_text(
                yaml.safe_dump(apply_overrides(raw, args.overrides))
            )
        seconds = time_stages(project)
        report = {
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "overrides": args.overrides,
            "stage_seconds": seconds,
            "total_seconds": round(sum(seconds.values()), 1),
            "reports": {
                a: json.loads((project / f"reports/{a}/metrics.json").read_text())
                for a in ATTENTION_KINDS
                if (project / f"reports/{a}/metrics.json").exists()
            },
        }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
