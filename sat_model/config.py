"""Typed, frozen parameters: one model per ``params.yaml`` section.

Every section rejects unknown keys and wrong types; errors name the dotted key
(``train.soft.lr: Input should be a valid number``). Overrides use the dotted syntax of
``dvc exp run -S`` (``train.soft.lr=2e-4``), parsed as YAML scalars.

Only factories read these models; leaf modules take explicit arguments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from ruamel.yaml import YAMLError

__all__ = [
    "ATTENTION_KINDS",
    "BOOLEAN_WORDS",
    "AttentionKind",
    "CocoConfig",
    "DataConfig",
    "EncoderConfig",
    "EvalConfig",
    "Flickr8kConfig",
    "FolderConfig",
    "HardTrainConfig",
    "KarpathyConfig",
    "LengthPenaltyConfig",
    "MlflowConfig",
    "ModelParams",
    "Params",
    "ParamsError",
    "RayConfig",
    "ServeConfig",
    "SoftTrainConfig",
    "SyntheticConfig",
    "TrainConfig",
    "TuneConfig",
    "VocabConfig",
    "apply_overrides",
    "load_params",
    "read_yaml",
]

# the two models of the paper (Sec. 4.1 hard, 4.2 soft): the one place the names are spelled
AttentionKind = Literal["soft", "hard"]
ATTENTION_KINDS: tuple[str, ...] = get_args(AttentionKind)

Split = Literal["train", "val", "test"]


class ParamsError(ValueError):
    """Raised when params.yaml (or an override) is invalid; the message names every bad key."""


# Booleans as people write them, in any case: YAML 1.2 (what DVC parses, read_yaml) reads only
# true/false as booleans, so `yes`, `On` or `FALSE` in params.yaml or `-S` arrive as words.
BOOLEAN_WORDS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}


def _boolean_word(value: Any) -> Any:
    """``value`` as a bool when it is one of :data:`BOOLEAN_WORDS` (any case), else as given."""
    if isinstance(value, str):
        return BOOLEAN_WORDS.get(value.strip().lower(), value)
    return value


class _Section(BaseModel):
    # strict: "3" is not an int, 1 is not a bool; frozen: params never change after loading.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _booleans_as_written(cls, value: Any, info: ValidationInfo) -> Any:
        # strict still refuses 1, "y" or "maybe" for a bool; only the words above are read
        field = cls.model_fields.get(info.field_name or "")
        return _boolean_word(value) if field is not None and field.annotation is bool else value


# ----------------------------------------------------------------------------- data
class SyntheticConfig(_Section):
    seed: int = 0
    train_images: int = Field(5000, ge=1)
    val_images: int = Field(250, ge=1)  # what train.val_images scores each epoch
    test_images: int = Field(500, ge=1)
    image_size: int = Field(224, ge=64)
    captions_per_image: int = Field(5, ge=1)
    min_objects: int = Field(1, ge=1)
    max_objects: int = Field(4, ge=1, le=4)

    @model_validator(mode="after")
    def _objects_range(self) -> SyntheticConfig:
        if self.min_objects > self.max_objects:
            raise ValueError("min_objects must not exceed max_objects")
        return self


class Flickr8kConfig(_Section):
    # paths relative to data.root, as in the original distribution
    images_dir: str = "Flickr8k_Dataset"
    token_file: str = "Flickr8k_text/Flickr8k.token.txt"
    train_list: str = "Flickr8k_text/Flickr_8k.trainImages.txt"
    val_list: str = "Flickr8k_text/Flickr_8k.devImages.txt"
    test_list: str = "Flickr8k_text/Flickr_8k.testImages.txt"


class KarpathyConfig(_Section):
    json_file: str = "dataset_flickr8k.json"
    images_dir: str = "Flickr8k_Dataset"
    # Karpathy's "restval" images (COCO) are usually trained on; False drops them with a reason.
    restval_to_train: bool = True


class CocoConfig(_Section):
    annotation_files: tuple[str, ...] = (
        "annotations/captions_train2014.json",
        "annotations/captions_val2014.json",
    )
    # one folder per annotation file, same order
    images_dirs: tuple[str, ...] = ("train2014", "val2014")
    # split policy: the first file trains; val/test are drawn from the others (paper: 5000/5000)
    val_images: int = Field(5000, ge=0)
    test_images: int = Field(5000, ge=0)
    seed: int = 0
    max_captions_per_image: int = Field(5, ge=1)  # paper truncates COCO to 5 references
    # held-out images beyond val/test train (as Karpathy's restval); False leaves them out
    restval_to_train: bool = True


class FolderConfig(_Section):
    # your own photos: a folder of images and a captions file (CSV or JSON lines) with the
    # columns file, caption and an optional split; paths relative to data.root
    images_dir: str = "."
    captions_file: str = "captions.csv"
    # csv | jsonl, or auto: by the file's extension (.jsonl and .json are JSON lines)
    format: Literal["auto", "csv", "jsonl"] = "auto"
    # without a split column: a seeded draw of this many images for val and for test; the
    # rest trains
    val_images: int = Field(50, ge=0)
    test_images: int = Field(50, ge=0)
    seed: int = 0


class VocabConfig(_Section):
    min_count: int = Field(5, ge=1)
    max_size: int = Field(10_000, ge=5)  # paper: 10,000 words
    max_caption_length: int = Field(20, ge=1)  # tokens, without <start>/<end>; longer are skipped


class DataConfig(_Section):
    # a registered data source (sat_model.data.sources.list_sources); its settings, if it has
    # any, are its section below
    source: str = "synthetic"
    # dataset folder for real sources; relative paths resolve against the project root
    root: str | None = None
    prepared_dir: str = "data/prepared"
    # splits that must hold at least one valid image (the Flickr8k sample has no test split)
    required_splits: tuple[Split, ...] = ("train", "val", "test")
    # fail when more than this share of images or captions had to be skipped
    max_bad_fraction: float = Field(0.05, ge=0.0, le=1.0)
    # decode every image while preparing (catches truncated files before extract does)
    verify_images: bool = True
    # decompression-bomb guard while checking images: larger ones are skipped with a reason
    max_image_pixels: int = Field(50_000_000, ge=1)
    synthetic: SyntheticConfig = SyntheticConfig()
    flickr8k: Flickr8kConfig = Flickr8kConfig()
    karpathy: KarpathyConfig = KarpathyConfig()
    coco: CocoConfig = CocoConfig()
    folder: FolderConfig = FolderConfig()
    vocab: VocabConfig = VocabConfig()

    @field_validator("source")
    @classmethod
    def _registered_source(cls, name: str) -> str:
        from sat_model.data.sources import list_sources

        if name not in list_sources():
            raise ValueError(f"unknown data source {name!r}; registered: {list_sources()}")
        return name

    @model_validator(mode="after")
    def _root_for_real_sources(self) -> DataConfig:
        from sat_model.data.sources import source_needs_root

        if source_needs_root(self.source) and not self.root:
            raise ValueError(f"data.root is required for source {self.source!r}")
        return self


# -------------------------------------------------------------------------- encoder
class EncoderConfig(_Section):
    # a registered encoder (sat_model.features.encoders.list_encoders)
    name: str = "efficientnet_lite0"
    # feature layer: encoder-specific name (see sat_model.features.encoders); None picks the encoder
    # default
    layer: str | None = None
    # weights file for torchvision encoders; None looks in the torch hub cache (never downloads)
    weights: str | None = None
    resize: int = Field(256, ge=32, le=4096)  # shorter side, paper: 256
    crop: int = Field(224, ge=32)  # centre crop, paper: 224
    # false: both sides to `resize` (aspect not kept), as the photos of a squeezed dataset were
    keep_aspect: bool = True
    batch_size: int = Field(32, ge=1)
    num_workers: int = Field(2, ge=0)  # DataLoader decoding workers
    engine: Literal["local", "ray"] = "local"
    features_dir: str = "data/features"
    max_image_pixels: int = Field(50_000_000, ge=1)  # decompression-bomb guard
    # threads of the encoder forward in both engines: CPU float results depend on the thread count,
    # so the local and Ray engines write byte-identical stores only with the same value
    torch_threads: int = Field(1, ge=1)
    # beyond the paper: also extract the train photos mirrored left to right, into
    # <features_dir>/train_mirrored.arrow, the features train.mirror draws from
    mirror_train: bool = False

    @field_validator("name")
    @classmethod
    def _registered_encoder(cls, name: str) -> str:
        from sat_model.features.encoders import list_encoders  # torch: only when params load

        if name not in list_encoders():
            raise ValueError(f"unknown encoder {name!r}; registered: {list_encoders()}")
        return name


# ---------------------------------------------------------------------------- model
class ModelParams(_Section):
    # sized for the 10-minute default pipeline on 2 CPU cores; use the paper's for real datasets
    embed_dim: int = Field(96, ge=1)  # m (paper: 512)
    hidden_dim: int = Field(192, ge=1)  # n (paper: 1800)
    attention_dim: int = Field(32, ge=1)  # hidden size of f_att (Eq. 4)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)  # before L_o (authors' code); the paper's 0.5
    # beyond the paper: dropout on the word embedding where it enters the LSTM (Eq. 1), in
    # training; the deep output (Eq. 7) sees it whole. Off here; docs/REALDATA.md for photos
    input_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # gating scalar β_t = σ(f_β(h_{t-1})), Sec. 4.2.1
    gate: bool = True
    # beyond the paper: each annotation vector gets its cell's (x, y), so attention knows where it
    # looks (captions that order objects left to right or relate them need it; see model.py)
    coordinates: bool = True
    # standardise each annotation channel with the training features' statistics (model.py)
    normalize_features: bool = True
    # how the model is computed, not what: "fast" (fused and compiled kernels where they apply,
    # sat_model/model/kernels) or "readable" (autograd through decoder.py's equations only);
    # unset, the environment variable SAT_MODEL_BACKEND decides, else "fast"
    backend: Literal["fast", "readable"] | None = None


# ---------------------------------------------------------------------------- train
class _OptimFields(_Section):
    optimizer: Literal["adam", "rmsprop"] = "adam"
    lr: float = Field(6e-3, gt=0)  # cosine from here, for both variants at the default sizes
    weight_decay: float = Field(0.0, ge=0)
    lr_schedule: Literal["constant", "cosine", "step"] = "cosine"
    lr_decay: float = Field(0.8, gt=0, le=1)  # factor per epoch for "step"
    max_epochs: int = Field(10, ge=1)
    batch_size: int = Field(64, ge=1)
    grad_clip: float = Field(5.0, gt=0)
    # epochs without a better val BLEU-4 before stopping. The best weights are kept either way;
    # with the cosine schedule they come from the last, low-lr epochs, and the high-lr epochs
    # swing val BLEU-4 for several epochs in a row, so the default lets all 10 run (README)
    patience: int = Field(10, ge=1)
    # beyond the paper: validate, keep and ship an exponential moving average of the weights,
    # updated every optimiser step (0 = off, the weights as trained). On the scenes 0.99 smooths
    # the validation curve (one-length batches swing the raw weights) but leaves test BLEU-4 where
    # it was (docs/EXPERIMENTS.md, "How the defaults were chosen")
    ema_decay: float = Field(0.0, ge=0, lt=1)
    # beyond the paper: self-critical epochs after max_epochs of likelihood (0 = off): REINFORCE
    # on the CIDEr-D of captions the model draws, from the best likelihood epoch's weights
    # (sat_model/train/self_critical.py, docs/REALDATA.md)
    scst_epochs: int = Field(0, ge=0)
    scst_lr: float = Field(5e-4, gt=0)  # a new optimiser's rate for those epochs, on lr_schedule
    scst_samples: int = Field(5, ge=2)  # captions drawn per image, each against the others' mean
    scst_batch_size: int = Field(32, ge=1)  # images a self-critical step
    # the reward is CIDEr-D plus this times the caption's own BLEU-4 (pycocoevalcap's per-caption
    # BLEU against its image's references; 0 = CIDEr-D alone, as Rennie et al.)
    scst_bleu_weight: float = Field(0.0, ge=0)
    # plus this times its BLEU-1 (clipped unigram precision times the brevity penalty): a word
    # that no reference of the photo holds costs reward, however common (docs/REALDATA.md)
    scst_bleu1_weight: float = Field(0.0, ge=0)


class SoftTrainConfig(_OptimFields):
    # λ, Eq. 14 (paper: 1). 0 on the generated scenes, where it spreads α over all L locations
    doubly_stochastic: float = Field(0.0, ge=0)


class HardTrainConfig(_OptimFields):
    lambda_r: float = Field(0.1, ge=0)  # REINFORCE weight (authors' code)
    lambda_e: float = Field(0.002, ge=0)  # entropy weight (authors' code)
    baseline_decay: float = Field(0.9, ge=0, lt=1)  # b_k = 0.9 b_{k-1} + 0.1 r, Sec. 4.1
    semi_sampling_p: float = Field(0.5, ge=0, le=1)  # chance of using α instead of s̃
    semi_sampling_per: Literal["image", "batch"] = "image"  # paper text: image; code: batch


class TrainConfig(_Section):
    seed: int = 0
    # validation BLEU-4 from free-running greedy decoding on this many val images (0 = all)
    val_images: int = Field(250, ge=0)
    val_max_length: int = Field(20, ge=1)
    # the validation score that picks the shipped epoch and drives early stopping. CIDEr weighs
    # each n-gram by how rare it is across the references and is steadier than BLEU-4 between
    # epochs on real photographs (docs/REALDATA.md); the scenes' captions are too regular for it
    monitor: Literal["bleu_4", "cider"] = "bleu_4"
    models_dir: str = "models"
    # bf16: the training forward pass and loss under torch.autocast (GPUs with bfloat16: A100,
    # H100); weights, optimiser and validation stay float32. Changes results, so a stage param
    mixed_precision: Literal["none", "bf16"] = "none"
    # beyond the paper: the chance that a training caption is paired, each epoch, with its photo
    # mirrored left to right ("left" and "right" swapped in the caption); needs
    # encoder.mirror_train. 0 = off
    mirror: float = Field(0.0, ge=0, le=1)
    soft: SoftTrainConfig = SoftTrainConfig()
    hard: HardTrainConfig = HardTrainConfig()


# ----------------------------------------------------------------------------- eval
class LengthPenaltyConfig(_Section):
    """Finished beams rank by summed log-probability / length^α, one α per attention variant."""

    # finished beams rank by summed log-probability / length^α: 0 ranks by the sum, which
    # favours the shortest caption (README, Results); 1 by log-probability per token; above 1
    # favours longer captions
    soft: float = Field(1.0, ge=0)
    # the same for hard attention (the Flickr8k profile: 2, docs/REALDATA.md)
    hard: float = Field(1.0, ge=0)


class EvalConfig(_Section):
    split: Split = "test"
    beam_size: int = Field(3, ge=1)
    max_length: int = Field(20, ge=1)
    length_penalty: LengthPenaltyConfig = LengthPenaltyConfig()
    # hard attention at test time: expected α (authors' default), a sample, or the argmax
    hard_decode: Literal["expected", "sample", "argmax"] = "expected"
    batch_size: int = Field(64, ge=1)
    meteor_timeout_s: float = Field(600.0, gt=0)
    gallery_images: int = Field(8, ge=0)
    reports_dir: str = "reports"


# ----------------------------------------------------------------------------- tune
class TuneConfig(_Section):
    attention: AttentionKind = "soft"
    num_samples: int = Field(8, ge=1)
    max_concurrent: int = Field(2, ge=1)
    # optuna: Optuna's TPE (model-based) through Ray Tune; random: Tune's random search
    search_alg: Literal["optuna", "random"] = "optuna"
    seed: int = 0  # the searcher's seed (TPE sampler or random search)
    max_epochs: int = Field(4, ge=1)
    grace_period: int = Field(1, ge=1)  # ASHA
    lr: tuple[float, float] = (1e-4, 1e-2)  # log-uniform bounds; contain the default 6e-3
    doubly_stochastic: tuple[float, float] = (0.0, 2.0)
    lambda_r: tuple[float, float] = (0.01, 1.0)
    lambda_e: tuple[float, float] = (0.0, 0.01)
    semi_sampling_p: tuple[float, float] = (0.0, 1.0)
    output_dir: str = "reports/tune"

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
class MlflowConfig(_Section):
    # None: MLFLOW_TRACKING_URI, else sqlite:///<absolute project root>/mlflow.db
    tracking_uri: str | None = None
    artifact_root: str = "mlartifacts"
    experiment: str = "sat"
    model_name: str = "sat-captioner"
    champion_metric: str = "bleu_4"
    # auto: the register stage moves champion when better, except in a `dvc exp run`;
    # always: in experiments too; never: only `sat promote` moves it
    promote: Literal["auto", "always", "never"] = "auto"
    retries: int = Field(3, ge=0)


# ---------------------------------------------------------------------------- serve
class RayServeConfig(_Section):
    """``sat serve --engine ray``: the model's Ray Serve deployment."""

    # replicas of the model, scaled between these on the requests each has in flight
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(4.0, gt=0)
    num_cpus: float = Field(2.0, gt=0)  # per replica (its torch threads)
    # concurrent requests captioned together in one batched beam search (@serve.batch): at
    # most this many requests, collected for at most this long
    max_batch_size: int = Field(8, ge=1)
    batch_wait_timeout_s: float = Field(0.05, ge=0)
    # seconds between looks at the champion alias; a version moved there by `sat promote` is
    # checked and loaded by the running replicas (0: never look)
    reload_interval_s: float = Field(30.0, ge=0)


class ServeConfig(_Section):
    """Limits of the served model (``sat serve``); a request beyond one is refused, not tried."""

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    # decompression-bomb guard: width x height from the header, checked before any pixel decodes
    max_image_pixels: int = Field(16_000_000, ge=1)
    # Pillow format names; an image in any other format is refused before it is decoded
    formats: tuple[str, ...] = ("JPEG", "PNG", "WEBP")
    max_rows: int = Field(64, ge=1)  # images per request
    # bytes of one request: its HTTP body, refused while it is read (before any parsing); the
    # image fields of a request handed to the model in-process are held to it too
    max_request_bytes: int = Field(32_000_000, ge=1)
    max_beam_size: int = Field(10, ge=1)  # beam_size must lie in 1..max_beam_size
    batch_size: int = Field(8, ge=1)  # rows decoded, encoded and captioned together
    # predictions running at once; later requests wait their turn, in order of arrival
    max_concurrent_requests: int = Field(4, ge=1)
    # requests admitted at once (being read, waiting or running); one more is answered 503
    # with Retry-After before its body is read, so memory is bounded by this x max_request_bytes
    max_queued_requests: int = Field(32, ge=1)
    # seconds an admitted request waits for its turn before a 503 with Retry-After
    queue_timeout_s: float = Field(60.0, gt=0)
    # seconds a connection may stay silent: before its request head is complete, between
    # reads of its body, and idle between requests; then it is closed
    read_timeout_s: float = Field(10.0, gt=0)
    ray: RayServeConfig = RayServeConfig()


# ------------------------------------------------------------------------------ ray
class RayConfig(_Section):
    # None: RAY_ADDRESS, else a local ray.init with num_cpus
    address: str | None = None
    num_cpus: int = Field(2, ge=1)
    num_workers: int = Field(1, ge=1)
    cpus_per_worker: int = Field(2, ge=1)
    use_gpu: Literal["auto", "true", "false"] = "auto"
    max_failures: int = Field(2, ge=0)
    # a folder (relative to the project root) or an object-store URI every node reaches
    # (s3://bucket/prefix; credentials and endpoint from the AWS_* environment variables)
    storage_path: str = "ray_results"
    # how workers get data/prepared and data/features: "shared" opens the driver's paths (one
    # machine, or the same mount on every node); "upload" copies them through storage_path;
    # "auto": shared when storage_path is a folder, upload when it is a URI
    worker_inputs: Literal["auto", "shared", "upload"] = "auto"
    # where Ray puts the workers: PACK fills a node first, STRICT_SPREAD one worker per node
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"

    @field_validator("use_gpu", mode="before")
    @classmethod
    def _use_gpu_as_written(cls, value: Any) -> Any:
        # `-S ray.use_gpu=true` parses as YAML's true; `yes`, `Off`, `AUTO` arrive as words
        value = _boolean_word(value)
        if isinstance(value, bool):
            return "true" if value else "false"
        return value.lower() if isinstance(value, str) and value.lower() == "auto" else value


class Params(_Section):
    data: DataConfig = DataConfig()
    encoder: EncoderConfig = EncoderConfig()
    model: ModelParams = ModelParams()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    tune: TuneConfig = TuneConfig()
    mlflow: MlflowConfig = MlflowConfig()
    ray: RayConfig = RayConfig()
    serve: ServeConfig = ServeConfig()

    @model_validator(mode="after")
    def _mirrored_features_exist(self) -> Params:
        if self.train.mirror > 0 and not self.encoder.mirror_train:
            raise ValueError(
                f"train.mirror is {self.train.mirror} but encoder.mirror_train is false: the "
                "extract stage writes the mirrored train features only with mirror_train: true"
            )
        return self


def read_yaml(text: str) -> Any:
    """Parse YAML 1.2 as DVC does (ruamel.yaml's safe loader: ``2e-4`` is a number, ``yes`` a
    word, a repeated key an error; no object is ever constructed)."""
    from ruamel.yaml import YAML

    return YAML(typ="safe", pure=True).load(text)


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        # a validator's own message names its keys; pydantic's "Value error, " adds nothing
        msg = e["msg"].removeprefix("Value error, ")
        key = ".".join(str(p) for p in e["loc"])
        lines.append(f"{key}: {msg}" if key else msg)
    return "invalid params:\n  " + "\n  ".join(lines)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with ``a.b.c=value`` overrides applied (values parsed as YAML)."""
    out = read_yaml(yaml.safe_dump(raw)) or {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ParamsError(f"override {item!r} is not of the form key.path=value")
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ParamsError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[leaf] = read_yaml(value)
    return out


def _tuples_from_lists(value: Any) -> Any:
    # YAML has no tuples; strict pydantic wants them for the frozen tuple fields.
    if isinstance(value, dict):
        return {k: _tuples_from_lists(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_tuples_from_lists(v) for v in value)
    return value


def load_params(path: str | Path = "params.yaml", overrides: list[str] | None = None) -> Params:
    """Load and validate ``params.yaml``; raise :class:`ParamsError` naming every bad key."""
    path = Path(path)
    try:
        raw = read_yaml(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError as e:
        raise ParamsError(f"params file not found: {path}") from e
    except YAMLError as e:
        raise ParamsError(f"params file {path} is not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ParamsError(f"params file {path} must hold a mapping of sections")
    raw = apply_overrides(raw, overrides or [])
    try:
        return Params.model_validate(_tuples_from_lists(raw))
    except ValidationError as e:
        raise ParamsError(_format_error(e)) from None
