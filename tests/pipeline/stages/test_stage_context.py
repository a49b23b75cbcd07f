"""The one stage shape: a context with one project-root rule, ``run(ctx, ...)`` per stage."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pipeline.cli.main import build_parser
from pipeline.stages import evaluate, load_context, project_root
from sat_model.config import ParamsError
from sat_model.paths import absolute
from tests.factories import ROOT


def test_the_project_root_is_the_params_files_folder_wherever_the_command_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "params.yaml").write_text("train:\n  models_dir: trained\n")
    monkeypatch.chdir(tmp_path)  # not the project: the root must not follow the cwd
    ctx = load_context("project/params.yaml", ["eval.split=val"])
    assert ctx.root == project.resolve()
    assert ctx.path(ctx.params.train.models_dir) == project.resolve() / "trained"
    assert ctx.params.eval.split == "val" and ctx.overrides == ("eval.split=val",)
    # the default params.yaml of a command run outside a project: the cwd
    assert project_root("params.yaml") == tmp_path.resolve()


def test_absolute_keeps_absolute_paths_and_anchors_relative_ones(tmp_path: Path) -> None:
    assert absolute("/data/features", tmp_path) == Path("/data/features")
    assert absolute("data/features", tmp_path) == tmp_path.resolve() / "data" / "features"
    assert absolute("~/x", tmp_path) == Path.home() / "x"


def test_a_bad_params_file_is_a_params_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ParamsError, match="not found"):
        load_context(tmp_path / "absent.yaml")


def test_sat_evaluate_takes_exactly_the_evaluate_stages_flags() -> None:
    stage = argparse.ArgumentParser()
    evaluate.add_arguments(stage)
    sat = build_parser()
    command = next(a for a in sat._subparsers._group_actions if a.dest == "command")
    ours = command.choices["evaluate"]

    def flags(parser: argparse.ArgumentParser) -> dict[str, object]:
        return {
            a.dest: (a.default, a.choices)
            for a in parser._actions
            if a.dest not in ("help", "params", "overrides", "verbose", "handler")
        }

    assert flags(ours) == flags(stage)
    assert set(flags(stage)) == {"model", "attention", "split", "out"}


@pytest.mark.parametrize(
    ("stage", "extra"),
    [
        ("prepare", []),
        ("extract", []),
        ("train", ["--attention", "soft"]),
        ("evaluate", ["--attention", "soft"]),
        ("register", []),
        ("tune", []),
    ],
)
def test_a_bad_params_value_is_one_line_and_status_1_from_every_stage(
    stage: str, extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What `dvc repro` shows after a typo in params.yaml: the key and the allowed values."""
    import importlib

    (tmp_path / "params.yaml").write_text("encoder:\n  name: efficientnet_lite9\n")
    main = importlib.import_module(f"pipeline.stages.{stage}").main
    with pytest.raises(SystemExit) as exited:
        main(["--params", str(tmp_path / "params.yaml"), "-S", "train.soft.lr=fast", *extra])
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{stage}: error: invalid params:")
    assert "encoder.name" in err and "efficientnet_lite2" in err and "train.soft.lr" in err
    assert "Traceback" not in err


def test_the_evaluate_stage_reports_a_folder_that_is_no_model_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m pipeline.stages.evaluate --model <folder>`` (the stage's own command, as
    its docstring offers it) on a folder without a checkpoint: one line and status 1, as
    ``sat evaluate`` says it, not a traceback."""
    params = tmp_path / "params.yaml"
    params.write_text((ROOT / "params.yaml").read_text(encoding="utf-8"))
    (tmp_path / "not_a_model").mkdir()
    argv = ["--params", str(params), "--model", str(tmp_path / "not_a_model")]
    assert evaluate.main([*argv, "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"evaluate: error: no checkpoint at {tmp_path}/not_a_model/model.safetensors"
    ]
