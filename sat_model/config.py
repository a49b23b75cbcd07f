"""Typed, frozen parameters: one model per ``params.yaml`` section.

Every section rejects unknown keys and wrong types; errors name the dotted key
(``train.soft.lr: Input should be a valid number``). Overrides use the dotted syntax of
``dvc exp run -S`` (``train.soft.lr=2e-4``), parsed as YAML scalars.

Only factories read these models; leaf modules take explicit arguments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from ruamel.yaml import YAMLError

from sat_model.features.formats import REQUEST_FORMATS

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
    "PromotionConfig",
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


# a bool as YAML and people write it (true/yes/on, false/no/off, any case); strict still refuses
# 1, "y" or "maybe". Only bool fields read words: a validator on every field would have JSON
# input (Ray workers' params) validated as Python, where strict refuses a list for a tuple
Bool = Annotated[bool, BeforeValidator(_boolean_word)]


class _Section(BaseModel):
    # strict: "3" is not an int, 1 is not a bool; frozen: params never change after loading.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


# ----------------------------------------------------------------------------- data
class SyntheticConfig(_Section):
    """The generated scenes: captioned pictures of coloured shapes, with every object's box."""

    seed: int = Field(0, description="seed of the generator: the same seed, the same scenes")
    train_images: int = Field(5000, ge=1, description="scenes in the train split")
    val_images: int = Field(
        250, ge=1, description="scenes in the val split (what `train.val_images` scores)"
    )
    test_images: int = Field(500, ge=1, description="scenes in the test split")
    image_size: int = Field(224, ge=64, description="side of each square picture, in pixels")
    captions_per_image: int = Field(5, ge=1, description="reference captions per scene")
    min_objects: int = Field(1, ge=1, description="fewest shapes in a scene")
    max_objects: int = Field(4, ge=1, le=4, description="most shapes in a scene")

    @model_validator(mode="after")
    def _objects_range(self) -> SyntheticConfig:
        if self.min_objects > self.max_objects:
            raise ValueError("min_objects must not exceed max_objects")
        return self


class Flickr8kConfig(_Section):
    """Flickr8k as distributed; paths relative to `data.root`."""

    images_dir: str = Field("Flickr8k_Dataset", description="folder of the photos")
    token_file: str = Field(
        "Flickr8k_text/Flickr8k.token.txt", description="captions, `<file>#<n>\\t<caption>`"
    )
    train_list: str = Field(
        "Flickr8k_text/Flickr_8k.trainImages.txt", description="file names of the train split"
    )
    val_list: str = Field(
        "Flickr8k_text/Flickr_8k.devImages.txt", description="file names of the val (dev) split"
    )
    test_list: str = Field(
        "Flickr8k_text/Flickr_8k.testImages.txt", description="file names of the test split"
    )


class KarpathyConfig(_Section):
    """Karpathy's split files (`dataset_flickr8k.json`, `_flickr30k`, `_coco`)."""

    json_file: str = Field("dataset_flickr8k.json", description="the split file, under data.root")
    images_dir: str = Field("Flickr8k_Dataset", description="folder of the photos, under data.root")
    restval_to_train: Bool = Field(
        True,
        description="train on the 'restval' images (COCO), as usual; false drops them with "
        "a reason",
    )


class CocoConfig(_Section):
    """MS COCO 2014 captions; val and test are drawn from the files after the first."""

    annotation_files: tuple[str, ...] = Field(
        (
            "annotations/captions_train2014.json",
            "annotations/captions_val2014.json",
        ),
        description="caption files under data.root; the first one trains",
    )
    images_dirs: tuple[str, ...] = Field(
        ("train2014", "val2014"), description="one photo folder per annotation file, same order"
    )
    val_images: int = Field(
        5000, ge=0, description="val images drawn from the held-out files (paper: 5000)"
    )
    test_images: int = Field(
        5000, ge=0, description="test images drawn from the held-out files (paper: 5000)"
    )
    seed: int = Field(0, description="seed of the val/test draw")
    max_captions_per_image: int = Field(
        5, ge=1, description="references kept per image (the paper truncates COCO to 5)"
    )
    restval_to_train: Bool = Field(
        True,
        description="held-out images beyond val/test train (as Karpathy's restval); "
        "false leaves them out",
    )


class FolderConfig(_Section):
    """Your own photos: a folder of images and a captions file (CSV or JSON lines) with the
    columns `file`, `caption` and an optional `split`; paths relative to `data.root`."""

    images_dir: str = Field(".", description="folder of the photos, under data.root")
    captions_file: str = Field("captions.csv", description="the captions file, under data.root")
    format: Literal["auto", "csv", "jsonl"] = Field(
        "auto", description="auto: by the file's extension (.jsonl and .json are JSON lines)"
    )
    val_images: int = Field(
        50,
        ge=0,
        description="without a split column: a seeded draw of this many images for val; "
        "the rest trains",
    )
    test_images: int = Field(50, ge=0, description="without a split column: the same for test")
    seed: int = Field(0, description="seed of that draw")


class VocabConfig(_Section):
    """The vocabulary built from the train captions."""

    min_count: int = Field(5, ge=1, description="a word seen fewer times is `<unk>`")
    max_size: int = Field(
        10_000, ge=5, description="words kept, special tokens included (paper: 10,000)"
    )
    max_caption_length: int = Field(
        20, ge=1, description="tokens, without <start>/<end>; longer captions are skipped"
    )


class DataConfig(_Section):
    """Where the captions and images come from, and how bad input is handled (stage `prepare`)."""

    source: str = Field(
        "synthetic",
        description="a registered data source (`sat_model.data.sources.list_sources`); "
        "its settings, if any, are its section below",
    )
    root: str | None = Field(
        None,
        description="dataset folder for real sources; relative paths resolve against the "
        "project root",
    )
    prepared_dir: str = Field(
        "data/prepared", description="where prepare writes the captions, images and vocabulary"
    )
    required_splits: tuple[Split, ...] = Field(
        ("train", "val", "test"),
        description="splits that must hold at least one valid image",
    )
    max_bad_fraction: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="fail when more than this share of images or captions had to be skipped",
    )
    verify_images: Bool = Field(
        True,
        description="decode every image while preparing (catches truncated files before "
        "extract does)",
    )
    max_image_pixels: int = Field(
        50_000_000,
        ge=1,
        description="decompression-bomb guard while checking images: larger ones are skipped "
        "with a reason",
    )
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
    """The frozen ImageNet CNN whose feature map gives the annotation vectors (stage `extract`)."""

    name: str = Field(
        "efficientnet_lite0",
        description="a registered encoder (`sat_model.features.encoders.list_encoders`)",
    )
    layer: str | None = Field(
        None,
        description="feature layer, an encoder-specific name (`sat_model.features.encoders`); "
        "null picks the encoder's default",
    )
    weights: str | None = Field(
        None,
        description="weights file for torchvision encoders; null looks in the torch hub cache "
        "(never downloads)",
    )
    resize: int = Field(256, ge=32, le=4096, description="shorter side, in pixels (paper: 256)")
    crop: int = Field(224, ge=32, description="centre crop, in pixels (paper: 224)")
    keep_aspect: Bool = Field(
        True,
        description="false: both sides to `resize` (aspect not kept), as the photos of a "
        "squeezed dataset were",
    )
    batch_size: int = Field(32, ge=1, description="images per encoder forward pass")
    num_workers: int = Field(2, ge=0, description="DataLoader decoding workers")
    engine: Literal["local", "ray"] = Field(
        "local", description="a local DataLoader, or a Ray Data actor pool"
    )
    features_dir: str = Field(
        "data/features", description="where extract writes the feature stores"
    )
    max_image_pixels: int = Field(50_000_000, ge=1, description="decompression-bomb guard")
    torch_threads: int = Field(
        1,
        ge=1,
        description="threads of the encoder forward in both engines: CPU float results depend "
        "on the thread count, so the engines write identical stores only with the same value",
    )
    mirror_train: Bool = Field(
        False,
        description="beyond the paper: also extract the train photos mirrored left to right "
        "(`<features_dir>/train_mirrored.arrow`), which `train.mirror` draws from",
    )

    @field_validator("name")
    @classmethod
    def _registered_encoder(cls, name: str) -> str:
        from sat_model.features.encoders import list_encoders  # torch: only when params load

        if name not in list_encoders():
            raise ValueError(f"unknown encoder {name!r}; registered: {list_encoders()}")
        return name


# ---------------------------------------------------------------------------- model
class ModelParams(_Section):
    """The decoder's sizes and switches; the defaults are sized for the generated scenes on a CPU,
    use the paper's for real datasets."""

    embed_dim: int = Field(96, ge=1, description="m, the word embedding size (paper: 512)")
    hidden_dim: int = Field(192, ge=1, description="n, the LSTM size (paper: 1800)")
    attention_dim: int = Field(32, ge=1, description="hidden size of f_att (Eq. 4)")
    dropout: float = Field(
        0.1, ge=0.0, lt=1.0, description="before L_o (authors' code; the paper: 0.5)"
    )
    input_dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="beyond the paper: dropout on the word embedding where it enters the LSTM "
        "(Eq. 1), in training; the deep output (Eq. 7) sees it whole",
    )
    gate: Bool = Field(True, description="gating scalar β_t = σ(f_β(h_{t-1})), Sec. 4.2.1")
    coordinates: Bool = Field(
        True,
        description="beyond the paper: each annotation vector gets its cell's (x, y), so "
        "attention knows where it looks (captions that order objects left to right need it)",
    )
    normalize_features: Bool = Field(
        True,
        description="standardise each annotation channel with the training features' statistics",
    )
    backend: Literal["native", "readable"] = Field(
        "native",
        description='how the model is computed (docs/METHOD.md, "The backend"): native '
        "(compiled kernels on float32 CPU tensors, the readable code elsewhere) or readable "
        "(autograd through the decoder's equations only); the two draw and round differently, "
        "so it is part of a run's params and identity",
    )


# ---------------------------------------------------------------------------- train
class _OptimFields(_Section):
    """The optimiser, schedule and stopping of one attention variant."""

    optimizer: Literal["adam", "rmsprop"] = Field("adam", description="the optimiser")
    lr: float = Field(6e-3, gt=0, description="learning rate at the schedule's start")
    weight_decay: float = Field(0.0, ge=0, description="L2 weight decay of the optimiser")
    lr_schedule: Literal["constant", "cosine", "step"] = Field(
        "cosine", description="the learning rate over the epochs"
    )
    lr_decay: float = Field(0.8, gt=0, le=1, description='factor per epoch for "step"')
    max_epochs: int = Field(10, ge=1, description="epochs of maximum likelihood")
    batch_size: int = Field(64, ge=1, description="captions per optimiser step")
    grad_clip: float = Field(5.0, gt=0, description="gradient norm clipping")
    patience: int = Field(
        10,
        ge=1,
        description="epochs without a better validation score before stopping; the best "
        "weights are kept either way",
    )
    ema_decay: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="beyond the paper: validate, keep and ship an exponential moving average "
        "of the weights, updated every optimiser step (0 = off, the weights as trained)",
    )
    scst_epochs: int = Field(
        0,
        ge=0,
        description="beyond the paper: self-critical epochs after max_epochs of likelihood "
        "(0 = off): REINFORCE on the reward of captions the model draws, from the best "
        "likelihood epoch's weights",
    )
    scst_lr: float = Field(
        5e-4, gt=0, description="a new optimiser's rate for those epochs, on lr_schedule"
    )
    scst_samples: int = Field(
        5, ge=2, description="captions drawn per image, each against the others' mean"
    )
    scst_batch_size: int = Field(32, ge=1, description="images per self-critical step")
    scst_bleu_weight: float = Field(
        0.0,
        ge=0,
        description="the reward is CIDEr-D plus this times the caption's own BLEU-4 "
        "(0 = CIDEr-D alone, as Rennie et al.)",
    )
    scst_bleu1_weight: float = Field(
        0.0,
        ge=0,
        description="plus this times its BLEU-1: a word that no reference of the photo holds "
        "costs reward, however common",
    )


class SoftTrainConfig(_OptimFields):
    """Training of deterministic soft attention (Sec. 4.2)."""

    doubly_stochastic: float = Field(
        0.0,
        ge=0,
        description="λ of the doubly stochastic penalty, Eq. 14 (paper: 1); on the generated "
        "scenes it spreads α over all L locations, hence 0",
    )


class HardTrainConfig(_OptimFields):
    """Training of stochastic hard attention (Sec. 4.1)."""

    lambda_r: float = Field(0.1, ge=0, description="REINFORCE weight λ_r (authors' code)")
    lambda_e: float = Field(0.002, ge=0, description="entropy weight λ_e (authors' code)")
    baseline_decay: float = Field(
        0.9, ge=0, lt=1, description="b_k = 0.9 b_{k-1} + 0.1 r, Sec. 4.1"
    )
    semi_sampling_p: float = Field(
        0.5, ge=0, le=1, description="chance of using the expected context α instead of s̃"
    )
    semi_sampling_per: Literal["image", "batch"] = Field(
        "image", description="that draw per image (the paper's text) or per batch (its code)"
    )


class TrainConfig(_Section):
    """Training, shared by both variants, and one section per variant."""

    seed: int = Field(0, description="seed of initialisation, batching and sampling")
    val_images: int = Field(
        250,
        ge=0,
        description="val images scored each epoch by greedy decoding (0 = all)",
    )
    val_max_length: int = Field(20, ge=1, description="longest caption decoded in validation")
    monitor: Literal["bleu_4", "cider"] = Field(
        "bleu_4",
        description="the validation score that picks the shipped epoch and drives early "
        "stopping; CIDEr is steadier between epochs on real photographs",
    )
    models_dir: str = Field("models", description="where the trained models are written")
    mixed_precision: Literal["none", "bf16"] = Field(
        "none",
        description="bf16: the training forward pass and loss under torch.autocast (GPUs with "
        "bfloat16); weights, optimiser and validation stay float32",
    )
    mirror: float = Field(
        0.0,
        ge=0,
        le=1,
        description="beyond the paper: the chance that a training caption is paired, each "
        'epoch, with its photo mirrored ("left" and "right" swapped in the caption); needs '
        "encoder.mirror_train (0 = off)",
    )
    soft: SoftTrainConfig = SoftTrainConfig()
    hard: HardTrainConfig = HardTrainConfig()


# ----------------------------------------------------------------------------- eval
class LengthPenaltyConfig(_Section):
    """Finished beams rank by summed log-probability / length^α, one α per attention variant."""

    soft: float = Field(
        1.0,
        ge=0,
        description="α for soft attention: 0 ranks by the sum, which favours the shortest "
        "caption; 1 by log-probability per token; above 1 favours longer captions",
    )
    hard: float = Field(1.0, ge=0, description="α for hard attention")


class EvalConfig(_Section):
    """Beam search and scoring (stage `evaluate`, `sat evaluate`)."""

    split: Split = Field("test", description="the split scored")
    beam_size: int = Field(3, ge=1, description="beams of the beam search")
    max_length: int = Field(20, ge=1, description="longest caption decoded")
    length_penalty: LengthPenaltyConfig = LengthPenaltyConfig()
    hard_decode: Literal["expected", "sample", "argmax"] = Field(
        "expected",
        description="hard attention at test time: the expected α (the authors' default), a "
        "sample, or the argmax",
    )
    batch_size: int = Field(64, ge=1, description="images decoded together")
    meteor_timeout_s: float = Field(
        600.0, gt=0, description="seconds before METEOR's Java process is killed"
    )
    gallery_images: int = Field(
        8, ge=0, description="images in the attention gallery, one overlay per word"
    )
    reports_dir: str = Field("reports", description="where the reports are written")


# ----------------------------------------------------------------------------- tune
class TuneConfig(_Section):
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
class MlflowConfig(_Section):
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
class PromotionConfig(_Section):
    """The promotion floor of the register stage and ``sat promote`` (docs/guide/governance.md)."""

    floor: dict[str, float] = Field(
        default_factory=lambda: {"bleu_4": 0.0, "cider": 0.0},
        description="minimum test score per metric (a key of metrics.json) for `champion`: a "
        "version below any of them is registered but not promoted (`sat promote "
        "--override-floor --reason` overrides, recorded on the version)",
    )


# ---------------------------------------------------------------------------- serve
class RayServeConfig(_Section):
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


class ServeConfig(_Section):
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
class RayConfig(_Section):
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
        value = _boolean_word(value)
        if isinstance(value, bool):
            return "true" if value else "false"
        return value.lower() if isinstance(value, str) and value.lower() == "auto" else value


class Params(_Section):
    """All of ``params.yaml``: one section per concern."""

    data: DataConfig = DataConfig()
    encoder: EncoderConfig = EncoderConfig()
    model: ModelParams = ModelParams()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    tune: TuneConfig = TuneConfig()
    mlflow: MlflowConfig = MlflowConfig()
    promotion: PromotionConfig = PromotionConfig()
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
