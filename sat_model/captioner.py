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

import base64
import binascii
import functools
import io
import os
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from sat_model.data.vocab import Vocab
from sat_model.features.encoders import Encoder, EncoderError
from sat_model.features.images import (
    ImageError,
    encoder_view,
    load_image,
    normalize_pixels,
    resize_crop,
)
from sat_model.features.spec import EncoderSpec
from sat_model.model.checkpoint import (
    load_checkpoint,
    model_from_checkpoint,
    recorded_data_source,
)
from sat_model.model.decoder import ShowAttendTell
from sat_model.model.decoding import beam_search, decode_mode, length_penalty_for

__all__ = [
    "IMAGE_EXTENSIONS",
    "Captioner",
    "FileCaption",
    "ImageCaption",
    "decode_image_input",
    "find_image_files",
]


@dataclass(frozen=True)
class ImageCaption:
    """One captioned image: the words, α per word (len, L), and the crop α refers to."""

    words: tuple[str, ...]
    alphas: np.ndarray
    score: float
    image: Image.Image = field(repr=False)  # as captioned, before the encoder's cut
    view: tuple[int, int, bool]  # that cut: resize, crop, keep_aspect (``encoder_view``)
    grid_h: int
    grid_w: int

    @property
    def text(self) -> str:
        return " ".join(self.words)

    @functools.cached_property
    def crop(self) -> Image.Image:
        """The picture the encoder saw, that α is drawn over: cut when first asked, since
        only attention figures need it (captioning a folder would pay a resize per image)."""
        return encoder_view(self.image.convert("RGB"), *self.view)


@dataclass(frozen=True)
class FileCaption:
    """One image file's outcome: its caption, or ``error`` saying why it has none."""

    path: str
    caption: ImageCaption | None = None
    error: str | None = None


# what a folder given to ``sat caption`` is searched for (case-insensitive); a file named
# explicitly is read whatever its name
IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}
)


def find_image_files(inputs: Iterable[str | Path]) -> list[Path]:
    """Each input file as given, and every image file under each input folder (recursive,
    sorted, symlinked files included, symlinked folders not followed)."""
    out: list[Path] = []
    for item in map(Path, inputs):
        if not item.is_dir():
            out.append(item)  # a missing or unreadable file gets its error when read
            continue
        for root, dirs, files in os.walk(item):
            dirs.sort()
            out += [
                Path(root) / f
                for f in sorted(files)
                if Path(f).suffix.lower() in IMAGE_EXTENSIONS and not _special(Path(root) / f)
            ]
    return out


def _special(path: Path) -> bool:
    """A FIFO, socket or device: not a photo, and opening a FIFO waits for a writer forever.
    A dangling link is no special file: it is listed and its error said when it is read."""
    try:
        return not stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def decode_image_input(value: str | bytes | Path, max_pixels: int = 50_000_000) -> Image.Image:
    """An image given as a file path, raw bytes, or base64 text (as JSON requests carry it).

    Raises :class:`ImageError` naming the input when it is not a decodable image.
    """
    if isinstance(value, bytes | bytearray):
        return load_image(io.BytesIO(bytes(value)), max_pixels=max_pixels)
    if isinstance(value, Path) or Path(str(value)).is_file():
        return load_image(value, max_pixels=max_pixels)
    text = str(value).strip()
    if text.startswith("data:") and "," in text:  # a data URL: data:image/png;base64,....
        text = text.split(",", 1)[1]
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        label = text if len(text) <= 80 else text[:77] + "..."
        raise ImageError(label, "neither an existing file nor base64 image data") from None
    try:
        return load_image(io.BytesIO(data), max_pixels=max_pixels)
    except ImageError as e:
        raise ImageError("<base64 image>", e.reason) from None


class Captioner:
    """A trained decoder with its encoder: ``caption(images) -> list[ImageCaption]``."""

    def __init__(
        self,
        model: ShowAttendTell,
        vocab: Vocab,
        encoder: Encoder,
        *,
        resize: int,
        keep_aspect: bool = True,
        beam_size: int = 3,
        max_length: int = 20,
        length_penalty: float = 1.0,
        mode: str = "expected",
        batch_size: int = 16,
        device: str | torch.device = "cpu",
        data_source: str | None = None,
    ) -> None:
        self.model = model.to(device).eval()
        self.vocab = vocab
        self.encoder = encoder.to(device).eval()
        self.resize = resize
        self.keep_aspect = keep_aspect
        self.beam_size = beam_size
        self.max_length = max_length
        self.length_penalty = length_penalty
        self.mode = decode_mode(mode, model.config.attention)  # a soft model: always expected
        self.batch_size = batch_size
        self.device = torch.device(device)
        # what the model was trained on (data.source), as its checkpoint records; None: unknown
        self.data_source = data_source

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
        attention variant (``{"soft": 1.0, "hard": 2.0}``); ``options`` as for the constructor."""
        checkpoint = load_checkpoint(model_dir)
        spec = EncoderSpec.from_config(checkpoint.config, model_dir)
        assert spec.resize is not None  # from_config records the paper's when absent
        model, vocab, _ = model_from_checkpoint(checkpoint, device, source=model_dir)
        encoder = spec.build(encoder_weights)
        if encoder.spec.num_locations != model.config.num_locations:
            raise EncoderError(
                f"{model_dir}: encoder gives L={encoder.spec.num_locations} locations, "
                f"the model expects {model.config.num_locations}"
            )
        return cls(
            model,
            vocab,
            encoder,
            resize=spec.resize,
            keep_aspect=spec.keep_aspect,
            device=device,
            length_penalty=length_penalty_for(length_penalty, model.config.attention),
            data_source=recorded_data_source(checkpoint.config),
            **options,
        )

    @property
    def crop_size(self) -> int:
        return self.encoder.spec.input_size

    def caption(
        self, images: Sequence[Image.Image], beam_size: int | None = None
    ) -> list[ImageCaption]:
        """Caption each RGB image (any size); batches of ``batch_size`` share one beam search."""
        out: list[ImageCaption] = []
        for start in range(0, len(images), self.batch_size):
            out += self._caption_batch(images[start : start + self.batch_size], beam_size)
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

        ``workers`` threads decode and preprocess the next batch while this one is captioned
        (Pillow and torch release the GIL), so at most two batches of images are in memory.
        """
        batches = [paths[i : i + self.batch_size] for i in range(0, len(paths), self.batch_size)]
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:

            def submit(k: int) -> list[Future[_Decoded | ImageError]]:
                if k >= len(batches):
                    return []
                return [pool.submit(self._read, p, max_pixels) for p in batches[k]]

            pending = submit(0)
            for k, batch in enumerate(batches):
                decoded = [f.result() for f in pending]
                pending = submit(k + 1)
                yield from self._caption_decoded(batch, decoded, beam_size)

    def _read(self, path: str | Path, max_pixels: int) -> _Decoded | ImageError:
        try:
            image = load_image(path, max_pixels=max_pixels, min_side=self.resize)
        except ImageError as e:
            return e
        return _Decoded(image, self._cut(image))

    def _caption_decoded(
        self,
        paths: Sequence[str | Path],
        decoded: Sequence[_Decoded | ImageError],
        beam_size: int | None,
    ) -> list[FileCaption]:
        good = [d for d in decoded if isinstance(d, _Decoded)]
        captions = iter(
            self._caption_batch(
                [d.image for d in good], beam_size, torch.stack([d.pixels for d in good])
            )
            if good
            else []
        )
        return [
            FileCaption(str(p), error=d.reason)
            if isinstance(d, ImageError)
            else FileCaption(str(p), caption=next(captions))
            for p, d in zip(paths, decoded, strict=True)
        ]

    def _cut(self, image: Image.Image) -> torch.Tensor:
        """The encoder's view of ``image`` as uint8 pixels (3, S, S), normalised a batch at a
        time (as the extract stage does it: the same floats)."""
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        return resize_crop(rgb, self.resize, self.encoder.spec.input_size, self.keep_aspect)

    def _caption_batch(
        self,
        images: Sequence[Image.Image],
        beam_size: int | None,
        pixels: torch.Tensor | None = None,
    ) -> list[ImageCaption]:
        d = self.encoder.spec
        if pixels is None:
            pixels = torch.stack([self._cut(im) for im in images])  # (B, 3, S, S) uint8
        with torch.inference_mode():
            annotations = self.encoder(normalize_pixels(pixels.to(self.device), *d.normalization()))
        captions = beam_search(
            self.model,
            annotations,
            beam_size=beam_size or self.beam_size,
            max_length=self.max_length,
            length_penalty=self.length_penalty,
            mode=self.mode,
        )
        view = (self.resize, d.input_size, self.keep_aspect)
        out = []
        for image, caption in zip(images, captions, strict=True):
            words, alphas = caption.words(self.vocab)
            score = float(caption.score)
            out.append(ImageCaption(words, alphas, score, image, view, d.grid_h, d.grid_w))
        return out


@dataclass(frozen=True)
class _Decoded:
    """A decoded image and the encoder's view of it (3, S, S) uint8."""

    image: Image.Image
    pixels: torch.Tensor
