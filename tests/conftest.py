"""Fixtures for the whole suite, and its fast tier.

``pytest --fast`` (``make test-fast``) is the inner loop: it deselects every test marked as a
real-path integration (``INTEGRATION``) and fails any test whose set-up or call costs more than
``FAST_LIMIT_S`` CPU-seconds (its own and its finished subprocesses'), or waits more than
``FAST_WAIT_S`` seconds, so an unmarked slow test cannot creep into the tier. CPU time, not wall
time, so that a loaded machine does not fail a test that is fast on an idle one.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Generator, Iterator

import pytest

# two pytest workers share two cores, and most processes they start run PyTorch: with as many
# threads as cores each, OpenMP's spinning threads fight over them. One thread each, unless a
# test or a stage sets its own (Ray Train's workers, extract's torch_threads)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# markers of real-path integrations (clusters, servers, pipelines, Java's METEOR and PTB):
# the whole suite runs them, the fast tier does not
INTEGRATION = ("slow", "ray", "mlflow", "cluster", "java")
FAST_LIMIT_S = 5.0
FAST_WAIT_S = 30.0
_CPU_S = pytest.StashKey[float]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast",
        action="store_true",
        help=f"the fast tier: skip tests marked {', '.join(INTEGRATION)}; fail any other "
        f"test whose set-up or call costs more than {FAST_LIMIT_S:.0f} CPU-seconds",
    )


@pytest.fixture(autouse=True)
def _isolated_mlflow_tracking_uri() -> Iterator[None]:
    """Each test starts and ends with the tracking URI it found.

    ``mlflow.set_tracking_uri`` (tests call it to load a registered model) also exports
    ``MLFLOW_TRACKING_URI``, which ``pipeline.tracking.runs`` honours first: without this, one
    test's server would become every later test's store.
    """
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if "mlflow" in sys.modules:
        from mlflow.tracking._tracking_service import utils

        utils._tracking_uri = None
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--fast`` deselects the integration tests; tests marked ``gpu`` skip, with the reason,
    where PyTorch sees no CUDA device."""
    if config.getoption("--fast"):
        slow = {i for i in items if any(i.get_closest_marker(m) for m in INTEGRATION)}
        config.hook.pytest_deselected(items=list(slow))
        items[:] = [i for i in items if i not in slow]
    _heaviest_modules_first(items)
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to PyTorch here")
    for item in gpu:
        item.add_marker(skip)


# the longest modules of a whole run (`--durations`), longest first: started before all others,
# so that none of them is the last one left running on one worker
LONGEST = (
    "tests/pipeline/tracking/test_team_mlflow.py",
    "tests/pipeline/test_dvc_pipeline.py",
    "tests/pipeline/ray/test_ray_multinode.py",
    "tests/pipeline/ray/test_ray_train.py",
    "tests/pipeline/stages/test_own_data.py",
    "tests/pipeline/test_one_caption_everywhere.py",
    "tests/pipeline/test_drift_everywhere.py",
)
# then a module's weight: its heaviest marker (clusters, then other integrations, then the
# rest), then the share of its tests that are integrations (a module that is one pipeline run,
# say), then how many tests it has
WEIGHTS = {"cluster": 0, "slow": 1, "ray": 1, "mlflow": 1, "java": 2}


def _heaviest_modules_first(items: list[pytest.Item]) -> None:
    """Order whole modules by weight, keeping each module's tests in their order: xdist's
    ``--dist loadfile --no-loadscope-reorder`` hands modules out in this order (without the
    flag it sorts them by their number of tests), so the long ones start first and the short
    ones fill the gaps at the end instead of leaving one worker waiting on a cluster."""
    heaviest: dict[str, int] = {}
    tests: dict[str, list[bool]] = {}
    for item in items:
        marks = [WEIGHTS[m.name] for m in item.iter_markers() if m.name in WEIGHTS]
        module = item.nodeid.partition("::")[0]
        heaviest[module] = min(heaviest.get(module, 3), *marks, 3)
        tests.setdefault(module, []).append(min(marks, default=3) < 2)

    def weight(item: pytest.Item) -> tuple[int, int, float, int]:
        module = item.nodeid.partition("::")[0]
        integrations = tests[module]
        longest = LONGEST.index(module) if module in LONGEST else len(LONGEST)
        return longest, heaviest[module], -sum(integrations) / len(integrations), -len(integrations)

    items.sort(key=weight)


def _cpu_seconds() -> float:
    """CPU time of this process's threads and of the subprocesses it has waited for."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _cpu_timed(item: pytest.Item) -> Generator[None, None, None]:
    """Records the CPU-seconds of the phase it wraps (set-up or call) for its report."""
    start = _cpu_seconds()
    try:
        return (yield)
    finally:
        item.stash[_CPU_S] = _cpu_seconds() - start


pytest_runtest_setup = pytest.hookimpl(wrapper=True)(_cpu_timed)
pytest_runtest_call = pytest.hookimpl(wrapper=True)(_cpu_timed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Under ``--fast``, a set-up or call over the tier's limits fails with what to do."""
    report: pytest.TestReport = yield
    if not (item.config.getoption("--fast") and report.when in ("setup", "call") and report.passed):
        return report
    cpu = item.stash.get(_CPU_S, 0.0)
    if cpu > FAST_LIMIT_S or report.duration > FAST_WAIT_S:
        report.outcome = "failed"
        report.longrepr = (
            f"its {report.when} cost {cpu:.1f} CPU-s in {report.duration:.1f} s, over the fast "
            f"tier's {FAST_LIMIT_S:.0f} CPU-s or {FAST_WAIT_S:.0f} s: make it faster, or mark it "
            "slow (pytest.mark.slow)"
        )
    return report
