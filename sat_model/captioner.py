"""Caption arbitrary images end to end: image → encoder → annotations → beam search → words + α.

Dimensions: ``B`` images per batch, ``S`` crop size, ``L = grid_h × grid_w`` locations, ``D``
annotation size.

Used by ``sat caption`` and by the MLflow pyfunc model. A model folder (``models/soft``) holds
everything needed: ``model.safetensors``, ``vocab.json`` and ``config.json``, whose ``encoder``
section records the frozen encoder the features came from and the photos' preprocessing
(:meth:`sat_model.features.spec.EncoderSpec.from_config`). The encoder is rebuilt from that spec
(its weights come from installed packages, never from the model folder), and its weights
checksum must match the one recorded: the decoder never reads features of another network.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from sat_model.data.vocab import Vocab
from sat_model.features.drift import DriftScore, DriftStatistics
from sat_model.features.encoders import Encoder, EncoderError, rebuild_encoder
from sat_model.features.images import ImageError, Preprocessing, to_picture
from sat_model.features.spec import EncoderSpec
from sat_model.model.checkpoint import (
    CheckpointError,
    load_checkpoint,
    model_from_checkpoint,
    recorded_data_source,
)
from sat_model.model.decoder import ShowAttendTell
from sat_model.model.decoding import Decoding, beam_search, decode_mode, length_penalty_for

__all__ = [
    "Captioner",
    "FileCaption",
    "ImageCaption",
]


@dataclass(frozen=True)
class ImageCaption:
    """One captioned image: the words, α per word (len, L), and the pixels α refers to."""

    words: tuple[str, ...]
    alphas: np.ndarray
    score: float
    pixels: torch.Tensor = field(repr=False)  # (3, S, S) uint8: what the encoder saw
    grid_h: int
    grid_w: int
    locations: np.ndarray | None = None  # (len,) the cells hard attention read, when it read one
    # how far the photo's features are from the training photos'; None: the model has no record
    drift: DriftScore | None = None

    @property
    def text(self) -> str:
        return " ".join(self.words)

    @functools.cached_property
    def crop(self) -> Image.Image:
        """The picture the encoder saw, that α is drawn over."""
        return to_picture(self.pixels)


@dataclass(frozen=True)
class FileCaption:
    """One image file's outcome: its caption, or ``error`` saying why it has none."""

    path: str
    caption: ImageCaption | None = None
    error: str | None = None


class Captioner:
    """A trained decoder with its encoder: ``caption(images) -> list[ImageCaption]``."""

    def __init__(
        self,
        model: ShowAttendTell,
        vocab: Vocab,
        encoder: Encoder,
        *,
        preprocessing: Preprocessing,  # the crop must be the encoder's input size
        decoding: Decoding | None = None,  # None: Decoding()'s defaults
        device: str | torch.device = "cpu",
        data_source: str | None = None,
        drift: DriftStatistics | None = None,
    ) -> None:
        self.model = model.to(device).eval()
        self.vocab = vocab
        self.encoder = encoder.to(device).eval()
        # the one path from a photo to the encoder's pixels, as the extract stage cut the
        # photos this model was trained on
        if preprocessing.crop != encoder.spec.input_size:
            raise EncoderError(
                f"crop {preprocessing.crop} != encoder input size {encoder.spec.input_size}"
            )
        self.preprocessing = preprocessing
        decoding = decoding or Decoding()
        self.beam_size = decoding.beam_size
        self.max_length = decoding.max_length
        self.length_penalty = decoding.length_penalty
        # a soft model: always expected
        self.mode = decode_mode(decoding.mode, model.config.attention)
        self.batch_size = decoding.batch_size
        self.device = torch.device(device)
        # what the model was trained on (data.source), as its checkpoint records; None: unknown
        self.data_source = data_source
        # the training features' statistics (sat_model.features.drift); None: drift is absent
        self.drift = drift

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        *,
        encoder_weights: str | Path | None = None,
        device: str | torch.device = "cpu",
        length_penalty: float | Mapping[str, float] = 1.0,
        **options: Any,
    ) -> Captioner:
        """Load ``model_dir`` and rebuild its encoder; ``length_penalty`` may be given per
        attention variant (``{"soft": 1.0, "hard": 2.0}``); ``options`` are the other fields of
        :class:`~sat_model.model.decoding.Decoding` (``beam_size``, ``max_length``, ``mode``,
        ``batch_size``)."""
        checkpoint = load_checkpoint(model_dir)
        try:
            drift = DriftStatistics.from_config(checkpoint.config)
        except ValueError as e:
            raise CheckpointError(f"{model_dir}: {e}") from None
        spec = EncoderSpec.from_config(checkpoint.config, model_dir)
        assert spec.resize is not None  # from_config records the paper's when absent
        model, vocab, _ = model_from_checkpoint(checkpoint, device, source=model_dir)
        encoder = rebuild_encoder(spec, encoder_weights)
        if encoder.spec.num_locations != model.config.num_locations:
            raise EncoderError(
                f"{model_dir}: encoder gives L={encoder.spec.num_locations} locations, "
                f"the model expects {model.config.num_locations}"
            )
        return cls(
            model,
            vocab,
            encoder,
            preprocessing=Preprocessing(
                spec.resize, encoder.spec.input_size, keep_aspect=spec.keep_aspect
            ),
            device=device,
            decoding=Decoding(
                length_penalty=length_penalty_for(length_penalty, model.config.attention),
                **options,
            ),
            data_source=recorded_data_source(checkpoint.config),
            drift=drift,
        )

    @property
    def crop_size(self) -> int:
        return self.encoder.spec.input_size

    def caption(
        self, images: Sequence[Image.Image], beam_size: int | None = None
    ) -> list[ImageCaption]:
        """Caption RGB images already in memory (any size), cut as files are."""
        if not images:
            return []
        pixels = torch.stack([self.preprocessing.cut(im) for im in images])  # (B, 3, S, S)
        return self.caption_pixels(pixels, beam_size)

    def caption_pixels(
        self, pixels: torch.Tensor, beam_size: int | None = None
    ) -> list[ImageCaption]:
        """Caption uint8 pixels (B, 3, S, S) from :meth:`Preprocessing.pixels`; batches of
        ``batch_size`` share one beam search."""
        out: list[ImageCaption] = []
        for start in range(0, len(pixels), self.batch_size):
            out += self._caption_batch(pixels[start : start + self.batch_size], beam_size)
        return out

    def caption_files(
        self,
        paths: Sequence[str | Path],
        *,
        beam_size: int | None = None,
        max_pixels: int = 50_000_000,
        workers: int = 2,
    ) -> Iterator[FileCaption]:
        """Caption image files in order, ``batch_size`` per beam search; a file that cannot be
        read gets its ``error`` and the others go on.

        ``workers`` threads decode and cut the next batch while this one is captioned (Pillow
        and torch release the GIL), so at most two batches of pixels are in memory.
        """
        prep = replace(self.preprocessing, max_pixels=max_pixels)
        batches = [paths[i : i + self.batch_size] for i in range(0, len(paths), self.batch_size)]
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:

            def submit(k: int) -> list[Future[torch.Tensor | ImageError]]:
                if k >= len(batches):
                    return []
                return [pool.submit(_read, prep, p) for p in batches[k]]

            pending = submit(0)
            for k, batch in enumerate(batches):
                decoded = [f.result() for f in pending]
                pending = submit(k + 1)
                yield from self._caption_decoded(batch, decoded, beam_size)

    def _caption_decoded(
        self,
        paths: Sequence[str | Path],
        decoded: Sequence[torch.Tensor | ImageError],
        beam_size: int | None,
    ) -> list[FileCaption]:
        good = [d for d in decoded if not isinstance(d, ImageError)]
        captions = iter(self.caption_pixels(torch.stack(good), beam_size) if good else [])
        return [
            FileCaption(str(p), error=d.reason)
            if isinstance(d, ImageError)
            else FileCaption(str(p), caption=next(captions))
            for p, d in zip(paths, decoded, strict=True)
        ]

    def _caption_batch(self, pixels: torch.Tensor, beam_size: int | None) -> list[ImageCaption]:
        d = self.encoder.spec
        annotations = self.encoder.annotate(pixels.to(self.device)).float()  # (B, L, D)
        captions = beam_search(
            self.model,
            annotations,
            beam_size=beam_size or self.beam_size,
            max_length=self.max_length,
            length_penalty=self.length_penalty,
            mode=self.mode,
        )
        drifts = self.drift.score(annotations) if self.drift else [None] * len(pixels)
        out = []
        for image, caption, drift in zip(pixels, captions, drifts, strict=True):
            words, alphas = caption.words(self.vocab)
            cells = caption.word_locations(self.vocab)
            score = float(caption.score)
            out.append(ImageCaption(words, alphas, score, image, d.grid_h, d.grid_w, cells, drift))
        return out


def _read(prep: Preprocessing, path: str | Path) -> torch.Tensor | ImageError:
    """A file's pixels (3, S, S) uint8, or why it has none."""
    try:
        return prep.pixels(path)
    except ImageError as e:
        return e
