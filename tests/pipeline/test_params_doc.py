from pathlib import Path

from pipeline.params_doc import params_table, update_readme
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
    assert update_readme(text) == text, "run `python -m pipeline.params_doc --write`"
