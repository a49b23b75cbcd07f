"""The library's schema: typed, frozen parameters, one model per ``params.yaml`` section.

Every section rejects unknown keys and wrong types; errors name the dotted key
(``train.soft.lr: Input should be a valid number``). This module imports nothing of
``sat_model``: the names a registry holds (sources, encoders, metrics) and the sources' own
sections are checked where params load, :mod:`sat_model.params`; the pipeline's sections (Ray,
MLflow, serving, Tune) are ``pipeline.settings``.

Only factories read these models; leaf modules take explicit arguments.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_validator,
)

__all__ = [
    "ATTENTION_KINDS",
    "BOOLEAN_WORDS",
    "AttentionKind",
    "Bool",
    "DataConfig",
    "EncoderConfig",
    "EvalConfig",
    "HardTrainConfig",
    "LengthPenaltyConfig",
    "LibraryParams",
    "ModelParams",
    "ParamsError",
    "Section",
    "SoftTrainConfig",
    "Split",
    "TrainConfig",
    "VocabConfig",
    "boolean_word",
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


def boolean_word(value: Any) -> Any:
    """``value`` as a bool when it is one of :data:`BOOLEAN_WORDS` (any case), else as given."""
    if isinstance(value, str):
        return BOOLEAN_WORDS.get(value.strip().lower(), value)
    return value


# a bool as YAML and people write it (true/yes/on, false/no/off, any case); strict still refuses
# 1, "y" or "maybe". Only bool fields read words: a validator on every field would have JSON
# input (Ray workers' params) validated as Python, where strict refuses a list for a tuple
Bool = Annotated[bool, BeforeValidator(boolean_word)]


class Section(BaseModel):
    # strict: "3" is not an int, 1 is not a bool; frozen: params never change after loading.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class VocabConfig(Section):
    """The vocabulary built from the train captions."""

    min_count: int = Field(5, ge=1, description="a word seen fewer times is `<unk>`")
    max_size: int = Field(
        10_000, ge=5, description="words kept, special tokens included (paper: 10,000)"
    )
    max_caption_length: int = Field(
        20, ge=1, description="tokens, without <start>/<end>; longer captions are skipped"
    )


class DataConfig(Section):
    """Where the captions and images come from, and how bad input is handled (stage `prepare`).

    Each registered source with settings has its section here, ``data.<source>``, validated by
    the model its registry entry carries (:func:`sat_model.params.load_params`)."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True)

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
    vocab: VocabConfig = VocabConfig()


# -------------------------------------------------------------------------- encoder
class EncoderConfig(Section):
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


# ---------------------------------------------------------------------------- model
class ModelParams(Section):
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
class _OptimFields(Section):
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


class TrainConfig(Section):
    """Training, shared by both variants, and one section per variant."""

    seed: int = Field(0, description="seed of initialisation, batching and sampling")
    val_images: int = Field(
        250,
        ge=0,
        description="val images scored each epoch by greedy decoding (0 = all)",
    )
    val_max_length: int = Field(20, ge=1, description="longest caption decoded in validation")
    monitor: str = Field(
        "bleu_4",
        description="the validation score that picks the shipped epoch and drives early "
        "stopping: a key of a registered metric (`sat_model.evaluation.metrics`); CIDEr is "
        "steadier between epochs on real photographs",
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
class LengthPenaltyConfig(Section):
    """Finished beams rank by summed log-probability / length^α, one α per attention variant."""

    soft: float = Field(
        1.0,
        ge=0,
        description="α for soft attention: 0 ranks by the sum, which favours the shortest "
        "caption; 1 by log-probability per token; above 1 favours longer captions",
    )
    hard: float = Field(1.0, ge=0, description="α for hard attention")


class EvalConfig(Section):
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


class LibraryParams(Section):
    """The library's sections of ``params.yaml``, one per concern (the pipeline adds its own in
    ``pipeline.settings.Params``; :mod:`sat_model.params` loads and checks them)."""

    data: DataConfig = DataConfig()
    encoder: EncoderConfig = EncoderConfig()
    model: ModelParams = ModelParams()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()

    @model_validator(mode="after")
    def _mirrored_features_exist(self) -> LibraryParams:
        if self.train.mirror > 0 and not self.encoder.mirror_train:
            raise ValueError(
                f"train.mirror is {self.train.mirror} but encoder.mirror_train is false: the "
                "extract stage writes the mirrored train features only with mirror_train: true"
            )
        return self
