import typing
from pathlib import Path

import pytest

from sat_model.config import Params, ParamsError, load_params
from tests.factories import ROOT


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(text)
    return path


def test_project_params_load_and_match_defaults_where_unset() -> None:
    params = load_params(ROOT / "params.yaml")
    assert params.data.source == "synthetic"
    assert params.data.vocab.max_size == 10_000  # the paper's vocabulary size


def test_unknown_key_is_rejected_with_its_dotted_path(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  soft:\n    learning_rate: 0.1\n")
    with pytest.raises(ParamsError, match=r"train\.soft\.learning_rate"):
        load_params(path)


def test_wrong_type_is_rejected_with_its_dotted_path(tmp_path: Path) -> None:
    path = write(tmp_path, "encoder:\n  batch_size: '32'\n")
    with pytest.raises(ParamsError, match=r"encoder\.batch_size"):
        load_params(path)


def test_every_bad_key_is_listed_at_once(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  dropout: high\nray:\n  num_cpus: 1.5\n")
    with pytest.raises(ParamsError) as err:
        load_params(path)
    assert "model.dropout" in str(err.value) and "ray.num_cpus" in str(err.value)


def test_unknown_section_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ParamsError, match="optimiser"):
        load_params(write(tmp_path, "optimiser: {}\n"))


def test_dotted_override_uses_dvc_exp_syntax_and_yaml12_floats(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  soft:\n    lr: 1.0e-3\n")
    params = load_params(path, overrides=["train.soft.lr=2e-4", "train.hard.lambda_r=0.5"])
    assert params.train.soft.lr == pytest.approx(2e-4)
    assert params.train.hard.lambda_r == pytest.approx(0.5)


def test_bad_override_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ParamsError, match=r"train\.hard\.semi_sampling_per"):
        load_params(write(tmp_path, ""), overrides=["train.hard.semi_sampling_per=word"])


def test_real_source_requires_a_root(tmp_path: Path) -> None:
    with pytest.raises(ParamsError, match=r"data\.root"):
        load_params(write(tmp_path, "data:\n  source: flickr8k\n"))


def test_params_are_frozen() -> None:
    params = Params()
    with pytest.raises(ValueError):
        params.train.seed = 3  # type: ignore[misc]


def _leaf_keys(model: type, prefix: str = "") -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and hasattr(sub, "model_fields"):
            keys |= _leaf_keys(sub, f"{prefix}{name}.")
        elif typing.get_origin(sub) is dict:  # a mapping (promotion.floor): its default's keys
            default = field.get_default(call_default_factory=True)
            keys |= {f"{prefix}{name}.{key}" for key in default}
        else:
            keys.add(f"{prefix}{name}")
    return keys


def _yaml_leaf_keys(tree: dict, prefix: str = "") -> set[str]:
    keys = set()
    for name, value in tree.items():
        if isinstance(value, dict):
            keys |= _yaml_leaf_keys(value, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def test_project_params_file_writes_out_every_key() -> None:
    # DVC tracks the keys in the file, not the models' defaults: a key the code reads but the
    # file omits would never re-run a stage when changed
    import yaml

    written = _yaml_leaf_keys(yaml.safe_load((ROOT / "params.yaml").read_text()))
    assert written == _leaf_keys(Params)


def test_a_cross_section_rule_is_one_plain_line_naming_its_keys(tmp_path: Path) -> None:
    """A rule over two sections (train.mirror needs encoder.mirror_train) has no single key:
    its message stands alone, without pydantic's "<root>" or "Value error, " prefixes."""
    with pytest.raises(ParamsError) as err:
        load_params(write(tmp_path, "train:\n  mirror: 0.5\n"))
    assert str(err.value) == (
        "invalid params:\n  train.mirror is 0.5 but encoder.mirror_train is false: the extract "
        "stage writes the mirrored train features only with mirror_train: true"
    )
    params = load_params(write(tmp_path, "encoder:\n  mirror_train: true\ntrain:\n  mirror: 0.5\n"))
    assert params.train.mirror == 0.5


@pytest.mark.parametrize(
    ("written", "meant"),
    [("true", True), ("Yes", True), ("ON", True), ("false", False), ("no", False), ("Off", False)],
)
def test_a_boolean_reads_as_yaml_and_people_write_it(
    tmp_path: Path, written: str, meant: bool
) -> None:
    # YAML 1.2 (DVC's) reads only true/false as booleans: `yes` and `On` arrive as words
    path = write(tmp_path, f"encoder:\n  keep_aspect: {written}\n")
    assert load_params(path).encoder.keep_aspect is meant
    assert load_params(write(tmp_path, ""), [f"model.gate={written}"]).model.gate is meant
    use_gpu = load_params(write(tmp_path, ""), [f"ray.use_gpu={written}"]).ray.use_gpu
    assert use_gpu == ("true" if meant else "false")


@pytest.mark.parametrize("written", ["1", "y", "maybe", "'2'"])
def test_a_boolean_refuses_what_is_not_one(tmp_path: Path, written: str) -> None:
    with pytest.raises(ParamsError, match=r"model\.gate"):
        load_params(write(tmp_path, ""), [f"model.gate={written}"])
    with pytest.raises(ParamsError, match=r"ray\.use_gpu"):
        load_params(write(tmp_path, ""), [f"ray.use_gpu={written}"])


def test_use_gpu_auto_in_any_case(tmp_path: Path) -> None:
    assert load_params(write(tmp_path, "ray: {use_gpu: AUTO}\n")).ray.use_gpu == "auto"


def test_params_round_trip_through_json_as_ray_workers_receive_them() -> None:
    """A sweep's trials rebuild their params from JSON (tuples arrive as lists, booleans as
    JSON's true/false): every section validates again to the same values."""
    params = Params()
    again = Params.model_validate_json(params.model_dump_json())
    assert again == params
