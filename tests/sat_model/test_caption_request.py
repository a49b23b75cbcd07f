"""A request's rows: checked, decoded, captioned; several requests share one beam search."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
from PIL import Image

from pipeline.settings import ServeConfig
from sat_model.caption_request import CaptionService, RequestError
from tests.factories import write_tiny_model

WORDS = ("a", "red", "circle", "blue", "square")


def _png(colour: tuple[int, int, int], size: tuple[int, int] = (80, 60)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> CaptionService:
    model = write_tiny_model(tmp_path_factory.mktemp("m") / "model", words=WORDS, resize=72)
    return CaptionService.from_dir(model, ServeConfig(batch_size=3), {"max_length": 6})


def test_requests_captioned_together_get_what_each_gets_alone(service: CaptionService) -> None:
    colours = [(220, 40, 40), (40, 40, 220), (40, 200, 40), (250, 250, 250), (10, 10, 10)]
    first = [_png(c) for c in colours[:3]] + ["not base64 !"]
    second = [_png(c, (50, 90)) for c in colours[2:]]
    alone = [service.caption_rows(first), service.caption_rows(second, beam_size=2)]
    together = service.caption_prepared(
        [service.prepare(first), service.prepare(second, beam_size=2), service.prepare(first)]
    )
    assert together == [alone[0], alone[1], alone[0]]
    assert alone[0][3] == {
        "caption": None,
        "error": "row 3: not an image: expected base64 or a data: URL",
        "drift": None,
        "drifted": None,
    }
    assert all(r["caption"] for r in alone[0][:3] + alone[1])


def test_a_request_of_bad_rows_fails_alone_among_good_ones(service: CaptionService) -> None:
    good, bad = service.prepare([_png((200, 10, 10))]), service.prepare(["", "/etc/passwd"])
    answers = service.caption_prepared([good, bad])
    assert isinstance(answers[0], list) and answers[0][0]["caption"]
    assert isinstance(answers[1], RequestError)
    assert str(answers[1]) == (
        "no usable image in the request: row 0: empty value; "
        "row 1: not an image: expected base64 or a data: URL"
    )


@pytest.mark.parametrize(
    "values, beam, message",
    [
        ([], None, "the request holds no rows"),
        (["x"] * 65, None, "too many rows: 65 images in one request, serve.max_rows is 64"),
        (["x"], 0, "beam_size must be an integer in 1..10, got 0"),
        (["x"], True, "beam_size must be an integer in 1..10, got True"),
    ],
)
def test_a_request_over_a_limit_is_refused_before_decoding(
    service: CaptionService, values: list, beam: object, message: str, tmp_path: Path
) -> None:
    with pytest.raises(RequestError, match=message.replace("(", r"\(").replace(".", r"\.")):
        service.prepare(values, beam)
