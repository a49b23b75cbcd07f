"""The pipeline's settings: its sections of ``params.yaml`` (Tune, MLflow, serving, Ray) beside
the library's (:class:`sat_model.config.LibraryParams`), and :func:`load_params`, which loads
them all and checks them against the registries (:mod:`sat_model.params`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from sat_model.config import AttentionKind, LibraryParams, Section, boolean_word
from sat_model.features.formats import REQUEST_FORMATS
from sat_model.params import load_params as load_library_params
from sat_model.params import validate_params as validate_library_params

__all__ = [
    "MlflowConfig",
    "Params",
    "PromotionConfig",
    "RayConfig",
    "RayServeConfig",
    "ServeConfig",
    "TuneConfig",
    "load_params",
    "validate_params",
]


# ----------------------------------------------------------------------------- tune
class TuneConfig(Section):
    """The Ray Tune sweep (`sat tune`, `sweeps/dvc.yaml`); each bound pair contains the default."""

    attention: AttentionKind = Field("soft", description="the variant swept")
    num_samples: int = Field(8, ge=1, description="trials")
    max_concurrent: int = Field(2, ge=1, description="trials at once")
    search_alg: Literal["optuna", "random"] = Field(
        "optuna",
        description="optuna: Optuna's TPE (model-based) through Ray Tune; random: Tune's "
        "random search",
    )
    seed: int = Field(0, description="the searcher's seed (TPE sampler or random search)")
    max_epochs: int = Field(4, ge=1, description="epochs of a trial that is not stopped")
    grace_period: int = Field(1, ge=1, description="epochs before ASHA may stop a trial")
    lr: tuple[float, float] = Field((1e-4, 1e-2), description="log-uniform bounds of lr")
    doubly_stochastic: tuple[float, float] = Field((0.0, 2.0), description="bounds of λ (soft)")
    lambda_r: tuple[float, float] = Field(
        (0.01, 1.0), description="log-uniform bounds of λ_r (hard)"
    )
    lambda_e: tuple[float, float] = Field((0.0, 0.01), description="bounds of λ_e (hard)")
    semi_sampling_p: tuple[float, float] = Field(
        (0.0, 1.0), description="bounds of semi_sampling_p (hard)"
    )
    output_dir: str = Field("reports/tune", description="where best_params.yaml is written")

    @model_validator(mode="after")
    def _ordered_bounds(self) -> TuneConfig:
        for key in ("lr", "doubly_stochastic", "lambda_r", "lambda_e", "semi_sampling_p"):
            lo, hi = getattr(self, key)
            if lo > hi:
                raise ValueError(f"{key}: lower bound {lo} exceeds upper bound {hi}")
        if self.lr[0] <= 0 or self.lambda_r[0] <= 0:
            raise ValueError("lr and lambda_r are searched log-uniformly: bounds must be > 0")
        return self


# --------------------------------------------------------------------------- mlflow
class MlflowConfig(Section):
    """The tracking store and the model registry."""

    tracking_uri: str | None = Field(
        None,
        description="null: MLFLOW_TRACKING_URI, else sqlite:///<absolute project root>/mlflow.db",
    )
    artifact_root: str = Field(
        "mlartifacts",
        description="artifact folder of a local store (on a tracking server: only a URI counts)",
    )
    experiment: str = Field("sat", description="the MLflow experiment of the runs")
    model_name: str = Field("sat-captioner", description="the registered model's name")
    champion_metric: str = Field(
        "bleu_4", description="the test metric that decides which version is champion"
    )
    promote: Literal["auto", "always", "never"] = Field(
        "auto",
        description="auto: the register stage moves champion when better, except in a "
        "`dvc exp run`; always: in experiments too; never: only `sat promote` moves it",
    )
    retries: int = Field(
        3, ge=0, description="tries of a tracking-store call before the command fails"
    )


# ------------------------------------------------------------------------ promotion
class PromotionConfig(Section):
    """The promotion floor of the register stage and ``sat promote`` (docs/guide/governance.md)."""

    floor: dict[str, float] = Field(
        default_factory=lambda: {"bleu_4": 0.0, "cider": 0.0},
        description="minimum test score per metric (a key of metrics.json) for `champion`: a "
        "version below any of them is registered but not promoted (`sat promote "
        "--override-floor --reason` overrides, recorded on the version)",
    )


# ---------------------------------------------------------------------------- serve
class RayServeConfig(Section):
    """``sat serve --engine ray``: the model's Ray Serve deployment."""

    min_replicas: int = Field(
        1,
        ge=1,
        description="fewest replicas of the model (scaled on the requests each has in flight)",
    )
    max_replicas: int = Field(1, ge=1, description="most replicas of the model")
    target_ongoing_requests: float = Field(
        4.0, gt=0, description="requests in flight per replica that the autoscaler aims at"
    )
    num_cpus: float = Field(2.0, gt=0, description="CPUs per replica (its torch threads)")
    max_batch_size: int = Field(
        8,
        ge=1,
        description="concurrent requests captioned together in one batched beam search",
    )
    batch_wait_timeout_s: float = Field(0.05, ge=0, description="seconds a batch waits to fill")
    reload_interval_s: float = Field(
        30.0,
        ge=0,
        description="seconds between looks at the champion alias; a version that "
        "`sat promote` moved there is checked and loaded by the running replicas (0: never)",
    )


class ServeConfig(Section):
    """Limits of the served model (``sat serve``); a request beyond one is refused, not tried."""

    host: str = Field("127.0.0.1", description="address the server listens on")
    port: int = Field(8080, ge=0, le=65535, description="port the server listens on")
    max_image_pixels: int = Field(
        16_000_000,
        ge=1,
        description="decompression-bomb guard: width x height from the header, checked before "
        "any pixel decodes",
    )
    formats: tuple[str, ...] = Field(
        REQUEST_FORMATS,
        description="Pillow format names; an image in any other format is refused before it "
        "is decoded",
    )
    max_rows: int = Field(64, ge=1, description="images per request")
    max_request_bytes: int = Field(
        32_000_000,
        ge=1,
        description="bytes of one request's HTTP body, refused while it is read (before any "
        "parsing); in-process requests' image fields are held to it too",
    )
    max_beam_size: int = Field(10, ge=1, description="beam_size must lie in 1..max_beam_size")
    batch_size: int = Field(8, ge=1, description="rows decoded, encoded and captioned together")
    max_concurrent_requests: int = Field(
        4,
        ge=1,
        description="predictions running at once; later requests wait their turn, in order",
    )
    max_queued_requests: int = Field(
        32,
        ge=1,
        description="requests admitted at once (read, waiting or running); one more is "
        "answered 503 with Retry-After before its body is read",
    )
    queue_timeout_s: float = Field(
        60.0,
        gt=0,
        description="seconds an admitted request waits for its turn before a 503 with Retry-After",
    )
    read_timeout_s: float = Field(
        10.0,
        gt=0,
        description="seconds a connection may stay silent (an incomplete head, a stalled body, "
        "idle between requests) before it is closed",
    )
    body_timeout_s: float = Field(
        60.0,
        gt=0,
        description="seconds a request body may take from its head to its last byte (408 after)",
    )
    min_body_rate: int = Field(
        32_768,
        ge=1,
        description="bytes per second a body must average after its first second (408 below): "
        "a slow client cannot hold an admission slot",
    )
    ray: RayServeConfig = RayServeConfig()


# ------------------------------------------------------------------------------ ray
class RayConfig(Section):
    """Where Ray runs the training, the sweeps and the Ray engines, and how workers get data."""

    address: str | None = Field(
        None, description="null: RAY_ADDRESS, else a local ray.init with num_cpus"
    )
    num_cpus: int = Field(2, ge=1, description="CPUs of a local Ray")
    num_workers: int = Field(1, ge=1, description="DDP workers of a training run")
    cpus_per_worker: int = Field(2, ge=1, description="CPUs per training worker")
    use_gpu: Literal["auto", "true", "false"] = Field(
        "auto", description="auto: one GPU per worker where the cluster has them"
    )
    max_failures: int = Field(
        2, ge=0, description="worker failures a training run survives (restarts from a checkpoint)"
    )
    storage_path: str = Field(
        "ray_results",
        description="a folder (relative to the project root) or an object-store URI every "
        "node reaches (s3://bucket/prefix; credentials from the AWS_* environment variables)",
    )
    worker_inputs: Literal["auto", "shared", "upload"] = Field(
        "auto",
        description="how workers get the prepared data and features: shared opens the "
        "driver's paths; upload copies them through storage_path; auto: shared for a folder, "
        "upload for a URI",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="where Ray puts the workers: PACK fills a node first, STRICT_SPREAD one "
        "worker per node",
    )

    @field_validator("use_gpu", mode="before")
    @classmethod
    def _use_gpu_as_written(cls, value: Any) -> Any:
        # `-S ray.use_gpu=true` parses as YAML's true; `yes`, `Off`, `AUTO` arrive as words
        value = boolean_word(value)
        if isinstance(value, bool):
            return "true" if value else "false"
        return value.lower() if isinstance(value, str) and value.lower() == "auto" else value


class Params(LibraryParams):
    """All of ``params.yaml``: the library's sections and the pipeline's."""

    tune: TuneConfig = TuneConfig()
    mlflow: MlflowConfig = MlflowConfig()
    promotion: PromotionConfig = PromotionConfig()
    ray: RayConfig = RayConfig()
    serve: ServeConfig = ServeConfig()


def load_params(path: str | Path = "params.yaml", overrides: list[str] | None = None) -> Params:
    """Load and validate ``params.yaml``; raise ``ParamsError`` naming every bad key."""
    return load_library_params(path, overrides, Params)


def validate_params(raw: Mapping[str, Any]) -> Params:
    """A params mapping (a dumped :class:`Params`, say) validated and checked again."""
    return validate_library_params(raw, Params)
