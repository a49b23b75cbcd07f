"""The generated reference pages: params from the config types, `sat` from its parser."""

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field

from pipeline.docs.cli import cli_page
from pipeline.docs.params import MissingDescriptionError, params_page, params_rows
from pipeline.settings import Params
from sat_model.params import full_schema
from tests.factories import ROOT


def _leaf_keys(model: type, prefix: str = "") -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and hasattr(sub, "model_fields"):
            keys |= _leaf_keys(sub, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def test_params_page_has_a_row_with_a_meaning_for_every_leaf_key() -> None:
    rows = {key: meaning for _, _, section in params_rows() for key, *_, meaning in section}
    assert set(rows) == _leaf_keys(full_schema(Params))  # the sources' sections included
    assert "data.coco.val_images" in rows and "data.folder.captions_file" in rows
    assert all(meaning.strip() for meaning in rows.values())
    page = params_page()
    assert "| `train.soft.doubly_stochastic` | number ≥ 0 | `0.0` | λ of the doubly" in page
    assert '| `tune.attention` | `"soft"` \\| `"hard"` |' in page  # a Literal's choices
    assert "| `data.max_bad_fraction` | number ≥ 0.0, ≤ 1.0 |" in page


class _Leaf(BaseModel):
    """A section with one undocumented field."""

    model_config = ConfigDict(extra="forbid")
    documented: int = Field(1, description="says what it is")
    bare: int = 2


class _Root(BaseModel):
    """The top."""

    leaf: _Leaf = _Leaf()


def test_a_field_without_a_description_fails_the_build() -> None:
    with pytest.raises(MissingDescriptionError, match=r"leaf\.bare"):
        params_page(_Root)


def test_cli_page_has_every_subcommand_help_from_the_parser() -> None:
    page = cli_page()
    for command in ("caption", "serve", "train", "tune", "models", "promote", "evaluate"):
        assert f"## `sat {command}`" in page
    assert "## `sat profile new`" in page
    assert "--attention-out" in page


def test_results_tables_show_our_scores_in_percent_from_the_reports(tmp_path: Path) -> None:
    import json

    from pipeline.docs.results import build_sections, update_page

    (tmp_path / "reports" / "soft").mkdir(parents=True)
    scores = {"bleu_1": 0.5, "bleu_4": 0.25, "meteor": 0.125, "pointing_accuracy": 0.875}
    (tmp_path / "reports" / "soft" / "metrics.json").write_text(json.dumps(scores))
    sections = build_sections(tmp_path)
    # no benchmark, no profile: nothing else (the encoders come from the registry)
    assert set(sections) == {"scenes", "paper", "encoders"}
    row = "| **sat soft** | generated scenes, test | 50.0 | – | – | 25.0 | 12.5 | – | – | 87.5 |"
    assert row in sections["scenes"]
    header = sections["scenes"].splitlines()[0]
    assert header.endswith("| CIDEr | pointing |") and header.count("|") == row.count("|")
    assert "sat hard" not in sections["scenes"]  # no report, no row
    assert "`make run` · " in sections["scenes"]  # the command and the report's date
    assert "| Flickr8k | hard | 67 | 45.7 | 31.4 | 21.3 | 20.3 |" in sections["paper"]
    page = "\n".join(
        f"<!-- results:{name}:start -->\n{body}\n<!-- results:{name}:end -->"
        for name, body in (("scenes", "old"), ("serving", "kept"))
    )
    new = update_page(page, sections)
    assert row in new and "old" not in new and "kept" in new  # a table without files stays


def test_results_page_has_markers_for_every_table_the_generator_writes() -> None:
    from pipeline.docs.results import update_page

    page = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    names = ["scenes", "paper", "serving", "batch", "flickr8k"]
    marked = update_page(page, {n: f"@{n}@" for n in names})
    assert all(f"@{n}@" in marked for n in names)


def test_results_serving_tables_come_from_the_serving_benchmarks_json(tmp_path: Path) -> None:
    import json

    from pipeline.docs.results import build_sections

    engine = {"images_per_s": 20.0, "latency_p50_s": 0.5, "latency_p95_s": 0.75}
    batch = {
        "encoder_only_images_per_s": 100.0,
        "decoded_images_per_s": 90.0,
        "one_process_images_per_s": 80.0,
        "ray_data_images_per_s": 84.0,
    }
    result = {
        "machine": {"cpu": "x86_64", "cores": 2},
        "serving": {"mlflow": engine, "ray": {**engine, "images_per_s": 40.0}},
        "batch_captioning": batch,
    }
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "serving.json").write_text(json.dumps(result))
    sections = build_sections(tmp_path)
    assert "| MLflow's scoring server | 20.0 | 0.50 s | 0.75 s |" in sections["serving"]
    assert "| `sat serve --engine ray` | 40.0 |" in sections["serving"]
    assert "`sat serve` |" not in sections["serving"]  # the local engine was not measured
    assert "2 CPUs (x86_64)" in sections["serving"]
    assert "| `sat caption`, one process | 80.0 | 0.80 |" in sections["batch"]
    assert "| `sat caption --engine ray` (Ray Data, streaming) | 84.0 | 0.84 |" in sections["batch"]


def _encoder_block(page: str) -> str:
    start, end = "<!-- results:encoders:start -->\n", "\n<!-- results:encoders:end -->"
    return page.split(start, 1)[1].split(end, 1)[0]


def test_the_committed_encoder_table_is_the_registry() -> None:
    """docs/guide/datasets.md lists the encoders as `@register_encoder` holds them now:
    `python -m pipeline.docs.results --write` rewrites the table after a change."""
    from pipeline.docs.encoders import encoder_table
    from sat_model.features.encoders import encoder_layers, list_encoders

    page = (ROOT / "docs" / "guide" / "datasets.md").read_text(encoding="utf-8")
    assert _encoder_block(page) == encoder_table(), "stale: python -m pipeline.docs.results --write"
    for name in list_encoders():  # each name, with its default layer first on its row
        row = next(line for line in _encoder_block(page).splitlines() if f"`{name}`" in line)
        assert row.split(" | ")[1].startswith(f"`{encoder_layers(name)[0]}`"), row


def test_a_registered_encoder_reaches_the_docs_table(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from torch import nn

    from pipeline.docs.results import main
    from sat_model.features import encoders

    monkeypatch.setattr(encoders._ENCODERS, "_entries", dict(encoders._ENCODERS._entries))
    encoders.register_encoder("toy_pool", ("pool4", "pool2"), ("toy-weights",))(
        lambda layer, weights, seed: encoders.Trunk(nn.Identity(), "toy")
    )
    page = tmp_path / "datasets.md"
    page.write_text("x\n<!-- results:encoders:start -->\nold\n<!-- results:encoders:end -->\ny\n")
    assert main(["--write", "--root", str(tmp_path), "--page", str(page)]) == 0
    block = _encoder_block(page.read_text(encoding="utf-8"))
    assert "| `toy_pool` | `pool4`, `pool2` | `toy-weights` |" in block.splitlines()
    assert "old" not in block and "`vgg19`" in block
