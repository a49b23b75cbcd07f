from pathlib import Path

from pipeline.docs.params import params_table, update_readme
from sat_model.config import Params

ROOT = Path(__file__).resolve().parents[2]


def _leaf_keys(model: type, prefix: str = "") -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and hasattr(sub, "model_fields"):
            keys |= _leaf_keys(sub, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def test_table_lists_every_leaf_key_of_the_params_models() -> None:
    table = params_table()
    rows = {line.split(" | ")[0].lstrip("| ") for line in table.splitlines()[2:]}
    assert rows == _leaf_keys(Params)
    assert "train.soft.doubly_stochastic" in rows


def test_readme_params_reference_is_up_to_date() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert update_readme(text) == text, "run `python -m pipeline.docs.params --write`"


def test_results_section_shows_our_scores_in_percent_beside_the_paper(tmp_path: Path) -> None:
    import json

    from pipeline.docs.results import results_section

    (tmp_path / "soft").mkdir()
    scores = {"bleu_1": 0.5, "bleu_4": 0.25, "meteor": 0.125, "pointing_accuracy": 0.875}
    (tmp_path / "soft" / "metrics.json").write_text(json.dumps(scores))
    section = results_section(tmp_path)
    assert "| generated scenes | soft | 50.0 | – | – | 25.0 | 12.5 | – | – | 87.5 |" in section
    assert "| Flickr8k (paper) | hard | 67 | 45.7 | 31.4 | 21.3 | 20.3 |" in section
    assert "generated scenes | hard" not in section  # no report, no row
