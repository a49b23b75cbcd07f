"""Which exceptions report a user's input rather than a bug, and how they are printed: one line,
status 1, for ``sat`` (``pipeline.cli.main``) and the stages that a user runs by hand
(``python -m pipeline.stages.evaluate --model ...``). Imports nothing heavy."""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["USER_ERRORS", "is_user_error", "one_line", "user_errors_in_one_line"]

# Exceptions that report what the user asked for or gave (params, files, models, stores), as
# opposed to bugs. Named by module so that `sat --help` imports none of them.
USER_ERRORS = {
    "sat_model.config": ("ParamsError",),
    "sat_model.paths": ("PathError",),
    "sat_model.data.vocab": ("VocabError",),
    "sat_model.features.images": ("ImageError",),
    "sat_model.data.sources": ("SourceError",),
    "sat_model.data.prepare": ("PrepareError",),
    "sat_model.features.extract": ("ExtractError",),
    "sat_model.features.store": ("FeatureStoreError",),
    "sat_model.features.encoders": ("EncoderError",),
    "sat_model.model.checkpoint": ("CheckpointError",),
    "sat_model.train.batching": ("BatchingError",),
    "sat_model.train.trainer": ("NonFiniteLossError",),
    "sat_model.evaluation.metrics": ("MetricError",),
    "sat_model.evaluation.evaluate": ("EvaluationError",),
    "pipeline.tracking.registry": ("RegistryError",),
    "pipeline.tracking.model_uri": ("ModelCheckError",),
    "pipeline.ray.jobs": ("JobFailedError",),
    "mlflow.exceptions": ("MlflowException",),
}


def is_user_error(err: BaseException) -> bool:
    """Whether ``err`` reports the user's input (one line, status 1) rather than a bug."""
    if isinstance(err, OSError):  # a missing file, a refused connection
        return True
    # a module never imported raised nothing
    types = tuple(
        getattr(sys.modules[module], name)
        for module, names in USER_ERRORS.items()
        if module in sys.modules
        for name in names
    )
    return isinstance(err, types)


def one_line(err: BaseException) -> str:
    """``err``'s message on one line, tracking URIs' tokens redacted."""
    if "mlflow.exceptions" in sys.modules:
        from mlflow.exceptions import MlflowException

        if isinstance(err, MlflowException):
            err = MlflowException(err.message)  # without MLflow's error-code prefix
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    text = text or type(err).__name__
    # tracking URIs (which may hold a token) reach messages only through pipeline.tracking.store
    store = sys.modules.get("pipeline.tracking.store")
    return store.redact(text) if store else text


def user_errors_in_one_line(stage: str, run: Callable[[], int]) -> int:
    """``run()``'s status; a user error it raises is one line on stderr (``<stage>: error:
    ...``) and status 1, and anything else (a bug) goes up with its traceback."""
    try:
        return run()
    except Exception as e:
        if not is_user_error(e):
            raise
        print(f"{stage}: error: {one_line(e)}", file=sys.stderr)
        return 1
