"""The quickstart (docs/guide/quickstart.md) and the whole pipeline as a DVC user runs it, on
one project: this working tree's files in a fresh git repository with tiny params.

One project per module: the quickstart's first block, `make run`, as written (its `dvc repro` is
the module's only one), then the quickstart's next blocks (`sat caption`, `sat serve` and a
request) and the behaviours DVC users rely on (nothing re-runs when nothing changed; a remote a
fresh clone pulls from). The blocks are read from the page, so an edit to the page changes what
runs. Two departures, both outside the commands' text: ``.venv`` in the project links to the
environment running the tests (``make run`` would otherwise install one; the copy's
``pyproject.toml`` is dated before that environment's install so make sees it current), and
``serve.port`` is a free port, written into the project's params and put in place of 8080 in the
request. The Flickr8k profile (two hours on the real photos) and the own-data blocks (a user's
``~/photos``) are not run here: each says why, ``make -n`` shows that their ``make run
PROFILE=...`` is the recipe walked here on the profile's files, and test_own_data.py walks the
own-data commands on a folder of sample photos. A soft-model param edit as a `dvc exp run`, and
`dvc metrics`, are walked against a team's MLflow server (test_team_mlflow.py). Real DVC, Ray
and MLflow (SQLite).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from sat_model.params import apply_overrides, read_yaml
from tests.factories import ROOT
from tests.figures import figure_panels
from tests.pipeline.projects import (
    METRIC_KEYS,
    TINY,
    assert_repro_ran,
    check_recorded_sweep,
    project_for_make_run,
    stages_run,
)
from tests.pipeline.servers import free_port, stop_process_group, wait_for_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ray,
    pytest.mark.mlflow,
    pytest.mark.java,
    pytest.mark.skipif(shutil.which("java") is None, reason="METEOR and PTB need Java"),
]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "RAY_ADDRESS"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    return env


def dvc(project: Path, *args: str) -> str:
    """Run a dvc command in ``project``; return its output, failing with it on error."""
    out = subprocess.run(
        [str(Path(sys.executable).parent / "dvc"), *args],
        cwd=project,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, f"dvc {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout + out.stderr


PAGE = ROOT / "docs" / "guide" / "quickstart.md"
BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)

# quickstart blocks that this module does not run, by their first line, and why
NOT_RUN = {
    "make run PROFILE=flickr8k": "needs the Flickr8k photos and about two hours of training",
    ".venv/bin/sat profile new mine": (
        "needs your ~/photos; tests/pipeline/stages/test_own_data.py walks these commands on a "
        "folder of sample photos"
    ),
}


def quickstart_blocks() -> list[str]:
    """The quickstart page's ``bash`` blocks that run here, in order."""
    blocks = BLOCK.findall(PAGE.read_text(encoding="utf-8"))
    return [b for b in blocks if not any(b.startswith(k) for k in NOT_RUN)]


def _bash(project: Path, block: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # type: ignore[call-overload, no-any-return]
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=project,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=1800,
        **kw,
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The project with tiny params (committed) and a free serving port, after the quickstart's
    `make run`; its output in ``first_repro.log``."""
    path = project_for_make_run(tmp_path_factory.mktemp("clone") / "sat")
    port = free_port()
    raw = apply_overrides(
        read_yaml((path / "params.yaml").read_text()), [*TINY, f"serve.port={port}"]
    )
    (path / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "commit", "-qam", "tiny params"], cwd=path, check=True)
    (path / "port").write_text(str(port))
    with (path / ".git" / "info" / "exclude").open("a") as exclude:  # this module's own files
        exclude.write("/port\n/first_repro.log\n")
    make_run = quickstart_blocks()[0]
    out = _bash(path, make_run)
    (path / "first_repro.log").write_text(out.stdout + out.stderr)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    yield path


def test_every_quickstart_block_is_run_here_or_says_why_not() -> None:
    run = quickstart_blocks()
    assert [b.splitlines()[0] for b in run[:3]] == [
        "make run",
        ".venv/bin/sat caption data/prepared/images/test_00000.png --attention-out attention/",
        ".venv/bin/sat serve",
    ]
    assert len(run) == 4, "a new quickstart block: run it below or say in NOT_RUN why not"
    blocks = BLOCK.findall(PAGE.read_text(encoding="utf-8"))
    assert all(any(b.startswith(k) for b in blocks) for k in NOT_RUN), "NOT_RUN is stale"


def _says_what_the_models_know(command: str, stderr: str) -> None:
    """``command`` (caption, serve) said on stderr, in one line, that the models know scenes."""
    (line,) = [x for x in stderr.splitlines() if x.startswith(f"sat {command}: ")]
    assert line.startswith(f"sat {command}: note: {SCENES_NOTE}"), stderr


def test_quickstart_from_make_run_to_a_served_caption(project: Path, tmp_path: Path) -> None:
    _, caption, serve, request = quickstart_blocks()
    log = (project / "first_repro.log").read_text()
    assert re.search(r"^soft\s+0\.\d{4}", log, re.M), log
    # which variant wins is the tiny models' draw: one of the two registered versions is champion
    assert re.search(r"^champion: sat-captioner version [12] \((soft|hard) attention", log, re.M)

    out = _bash(project, caption)
    assert out.returncode == 0, out.stderr
    assert re.search(r"test_00000\.png\S*\s+\w+", out.stdout), out.stdout
    assert (project / "attention/images/test_00000.png").is_file(), "no attention figure"
    assert "test_00000.png" in (project / "attention/index.html").read_text()
    _says_what_the_models_know("caption", out.stderr)

    port = (project / "port").read_text()
    said, err = tmp_path / "stdout", tmp_path / "stderr"
    with said.open("w") as stdout, err.open("w") as stderr:
        server = subprocess.Popen(
            ["bash", "-c", serve],
            cwd=project,
            env=_env(),
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        wait_for_port(int(port), server, "sat serve", timeout_s=120)
        out = _bash(project, request.replace("127.0.0.1:8080", f"127.0.0.1:{port}"))
    finally:
        stop_process_group(server)
    assert "serving models:/sat-captioner@champion" in said.read_text(), err.read_text()
    _says_what_the_models_know("serve", err.read_text())
    assert out.returncode == 0, out.stderr
    (prediction,) = json.loads(out.stdout)["predictions"]
    assert prediction["error"] is None
    assert isinstance(prediction["caption"], str) and prediction["caption"].split()

    # what the quickstart and `dvc plots show` left is ignored; dvc.lock alone changed, since
    # the tiny params are not the committed ones, and the pipeline is up to date
    dvc(project, "plots", "show")
    git = ["git", "status", "--porcelain", "--untracked-files=all"]
    status = subprocess.run(git, cwd=project, capture_output=True, text=True, check=True)
    assert status.stdout.splitlines() == [" M dvc.lock"], status.stdout
    assert "Data and pipelines are up to date" in dvc(project, "status", "dvc.yaml")


def test_every_readme_command_is_a_quickstart_command() -> None:
    """The README's blocks are the quickstart's lines (and `make test`, which runs this), so
    walking the quickstart walks them."""
    readme = BLOCK.findall((ROOT / "README.md").read_text(encoding="utf-8"))
    page = BLOCK.findall(PAGE.read_text(encoding="utf-8"))
    quickstart = {line for b in page for line in b.splitlines()}
    commands = [line.split("#")[0].strip() for b in readme for line in b.splitlines()]
    assert "make run" in commands and "make test" in commands
    missing = [c for c in commands if c and c != "make test" and c not in quickstart]
    assert not missing, f"README commands the quickstart does not walk: {missing}"


def _make_run_dry(*args: str) -> list[list[str]]:
    """The commands ``make run`` would run (``make -n``, the install taken as done), as words."""
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", "-o", ".venv/.installed", "run", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return [shlex.split(line) for line in out.stdout.replace("\\\n", " ").splitlines()]


def test_a_profiles_make_run_not_run_here_is_the_walked_recipe_on_its_files() -> None:
    """``make run PROFILE=...`` (the blocks NOT_RUN names) runs the commands of the walked
    ``make run``, the same head, repro and summary, on the profile's params, pipeline and
    reports: test_own_data.py walks that repro of a profile, test_profiles.py the Flickr8k
    profile's files."""
    blocks = [
        b for b in BLOCK.findall(PAGE.read_text(encoding="utf-8")) if b not in quickstart_blocks()
    ]
    lines = [
        line for b in blocks for line in b.splitlines() if line.startswith("make run PROFILE=")
    ]
    walked = _make_run_dry()
    assert len(walked) == 2 and "pipeline.ray.head" in walked[0]  # the head, then the summary
    assert [line.split("PROFILE=")[1] for line in lines] == ["flickr8k", "mine"]
    for line in lines:
        folder = f"profiles/{line.split('PROFILE=')[1]}"
        expected = [[w.replace("./", f"{folder}/") for w in command] for command in walked]
        expected[0].append(f"{folder}/dvc.yaml")  # `dvc repro` ends the head's command
        assert _make_run_dry(line.split()[-1]) == expected, line


def test_repro_runs_every_stage_and_writes_every_output(project: Path) -> None:
    log = (project / "first_repro.log").read_text()
    ran = stages_run(log)
    # what the user reads: no traceback, and none of MLflow's warnings or download bars
    for noise in ("Traceback", "Warning:", "Downloading artifacts"):
        assert noise not in log, f"{noise!r} in the dvc repro output:\n{log[-3000:]}"
    assert ran == {
        "prepare",
        "extract",
        "train@soft",
        "train@hard",
        "evaluate@soft",
        "evaluate@hard",
        "register",
    }
    for rel in (
        "data/prepared/captions.parquet",
        "data/prepared/images.parquet",
        "data/prepared/vocab.json",
        "data/features/train.arrow",
        "data/features/test.arrow",
        "models/soft/model.safetensors",
        "models/hard/model.safetensors",
        "reports/soft/captions.json",
        "reports/hard/attention/index.html",
    ):
        assert (project / rel).is_file(), rel
    for attention in ("soft", "hard"):
        metrics = json.loads((project / f"reports/{attention}/metrics.json").read_text())
        assert metrics.keys() >= METRIC_KEYS
        counts = json.loads((project / f"reports/{attention}/captions.json").read_text())
        assert "pointing_words" in counts  # generated scenes carry boxes: grounding is scored


# each stage's output folder or file, as dvc.yaml declares it
STAGE_OUTPUTS = {
    "prepare": "data/prepared",
    "extract": "data/features",
    "train@soft": "models/soft",
    "train@hard": "models/hard",
    "evaluate@soft": "reports/soft",
    "evaluate@hard": "reports/hard",
    "register": "reports/registry.json",
}


def test_each_stage_says_in_one_line_what_it_did_where_and_how_long(project: Path) -> None:
    log = (project / "first_repro.log").read_text()
    for stage, output in STAGE_OUTPUTS.items():
        done = re.compile(rf"{re.escape(stage)}: \S.* -> {output} \((\d+s|\d+m\d\ds|\d+h\d\dm)\)")
        assert sum(bool(done.fullmatch(line)) for line in log.splitlines()) == 1, (stage, log)
    assert not re.search(r"\d\.\d{7,}", log), log  # no raw floats: scores read at 4 places
    assert not re.search(r"^\s*[{}\[\]\"]", log, re.MULTILINE), log  # no JSON dumped
    for chatter in ("Successfully registered", "Created version", "already exists"):
        assert chatter not in log, f"MLflow's {chatter!r} in the dvc repro output"
    # the register line names the champion and, for a version left out, why
    register = next(line for line in log.splitlines() if line.startswith("register: "))
    assert re.search(r"champion: version \d \((soft|hard)", register), register


def test_training_shows_progress_within_each_epoch_as_lines_in_a_log(project: Path) -> None:
    """dvc repro's output captured (not a terminal): plain lines, no bar drawn with \\r."""
    log = (project / "first_repro.log").read_text()
    assert "\r" not in log
    lines = log.splitlines()
    for attention in ("soft", "hard"):
        within = [
            i
            for i, line in enumerate(lines)
            if re.fullmatch(
                rf"train {attention}  epoch 1/1  batch \d+/\d+  \d+ captions/s  epoch ETA \S+", line
            )
        ]
        epoch = [
            i
            for i, line in enumerate(lines)
            if line.startswith(f"train {attention}  epoch 1/1  loss")
        ]
        assert within and len(epoch) == 1, log
        assert max(within) < epoch[0]  # within the epoch, then the epoch's line


def _score_keys() -> set[str]:
    from sat_model.evaluation.metrics import metric_keys

    return {*metric_keys(), "pointing_accuracy"}  # the registered metrics and grounding


def test_dvc_metrics_show_is_the_test_scores_of_both_models(project: Path) -> None:
    table = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in dvc(project, "metrics", "show", "--md").splitlines()
        if line.startswith("|") and not line.startswith("|--")
    ]
    header, rows = table[0], table[1:]
    assert header[0] == "Path" and set(header[1:]) <= _score_keys(), header
    assert {"bleu_4", "meteor", "cider"} <= set(header)
    assert sorted(row[0] for row in rows) == [
        "reports/hard/metrics.json",
        "reports/soft/metrics.json",
    ]


def test_dvc_exp_show_holds_no_counts_or_identities_among_its_metrics(project: Path) -> None:
    header = dvc(project, "exp", "show", "--no-pager", "--csv").splitlines()[0].split(",")
    metrics = [column.split(":", 1) for column in header if ".json:" in column]
    assert {path for path, _ in metrics} == {
        "reports/soft/metrics.json",
        "reports/hard/metrics.json",
    }
    assert {key for _, key in metrics} <= _score_keys(), metrics


def test_repro_registers_both_models_and_a_champion(project: Path) -> None:
    from mlflow import MlflowClient

    registry = json.loads((project / "reports/registry.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    versions = client.search_model_versions("name='sat-captioner'")
    assert len(versions) == 2
    assert {v.tags.get("sat.attention") for v in versions} == {"soft", "hard"}
    champion = client.get_model_version_by_alias("sat-captioner", "champion")
    assert champion.version in {v.version for v in versions}
    assert str(registry["champion"]) == str(champion.version)


def _dvc_lock_md5(project: Path, out: str) -> str:
    """The md5 that dvc.lock records for the stage output ``out``."""
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    (md5,) = {
        o["md5"] for st in lock["stages"].values() for o in st.get("outs", []) if o["path"] == out
    }
    return md5


def test_every_registered_version_has_a_card_that_agrees_with_the_reports(project: Path) -> None:
    registry = json.loads((project / "reports/registry.json").read_text())
    prepared = json.loads((project / "data/prepared/prepare_report.json").read_text())
    hashes = [_dvc_lock_md5(project, "data/prepared"), _dvc_lock_md5(project, "data/features")]
    for entry in registry["versions"]:  # the champion's card by default, the other's by number
        which = [] if entry["version"] == registry["champion"] else ["--version", entry["version"]]
        shown = sat(project, "card", *which)
        assert shown.returncode == 0 and shown.stderr == "", shown.stderr
        card = shown.stdout
        assert card.startswith(f"# sat-captioner version {entry['version']}: model card")
        assert all(f"`{md5}`" in card for md5 in hashes)  # the data it was built from
        assert f"| images test | {prepared['images_test']} |" in card  # 8: TINY's test images
        metrics = json.loads((project / f"reports/{entry['attention']}/metrics.json").read_text())
        assert metrics.keys() >= METRIC_KEYS
        for key, value in metrics.items():  # the scores reports/ holds, every one
            assert f"| {key} | {value:.4f} |" in card
        assert "on the test split (8 images)" in card and "beam 2" in card  # TINY's eval
        assert f"| `model.attention` | {entry['attention']} |" in card
        assert "| `model.embed_dim` | 16 |" in card and "| `train.seed` | 0 |" in card
        assert "captions the generated scenes of coloured shapes" in card
        training = re.search(r"\| training time \| ([\d.]+) min \|", card)
        assert training and 0 < float(training[1]) < 60, card
        hardware = r"\| hardware \| 1 worker\(s\); each on (cpu \(\d+ threads?\)|cuda \()"
        assert re.search(hardware, card), card
        aliases = "champion" if entry["version"] == registry["champion"] else "none"
        assert card.endswith(f"## In the registry now\n\n- aliases: {aliases}\n")


def test_a_review_compares_the_two_versions_with_their_figures(
    project: Path, tmp_path: Path
) -> None:
    registry = json.loads((project / "reports/registry.json").read_text())
    champion = registry["champion"]
    (other,) = [v for v in registry["versions"] if v["version"] != champion]
    out = tmp_path / "review"
    done = sat(project, "review", other["version"], "--out", str(out), "--photos", "2")
    assert done.returncode == 0, done.stderr
    md = (out / "review.md").read_text()
    page = (out / "review.html").read_text()
    attention = {v["version"]: v["attention"] for v in registry["versions"]}
    for version, label in ((other["version"], "candidate"), (champion, "champion")):
        assert f"version {version} ({label}, {attention[version]})" in md
    ours = json.loads((project / f"reports/{other['attention']}/metrics.json").read_text())
    theirs = json.loads((project / f"reports/{attention[champion]}/metrics.json").read_text())
    for key in METRIC_KEYS:  # side by side, and the delta
        row = f"| {key} | {ours[key]:.4f} | {theirs[key]:.4f} | {ours[key] - theirs[key]:+.4f} |"
        assert row in md
    assert f"| model.attention | {other['attention']} | {attention[champion]} |" in md
    for version in (other["version"], champion):  # the same two test photos, captioned by each
        for stem in ("test_00000", "test_00001"):
            figure = f"version-{version}/images/{stem}.png"
            caption = re.search(rf"([^|>]+)<br>!\[[^]]*\]\({re.escape(figure)}\)", md)
            assert caption, (figure, md)
            assert f'<img src="{figure}"' in page
            words = caption[1].split()
            assert sum(map(len, figure_panels(out / figure))) == 1 + len(words)


def test_second_repro_runs_nothing(project: Path) -> None:
    assert_repro_ran(project, lambda: dvc(project, "repro"), ran=set())


def test_an_edit_upstream_in_another_checkout_reruns_only_the_edited_stages(
    project: Path, tmp_path: Path
) -> None:
    """A teammate's copy of the project in another folder, after an edit to the prepare stage's
    code, then to the extract stage's: each runs again alone and writes the same bytes (the
    prepared table records its image folder relative to itself; the extraction's engine and
    timing are kept outside the features), so nothing after it runs."""
    copy = tmp_path / "elsewhere" / "sat"
    shutil.copytree(project, copy, symlinks=True)
    features = (copy / "data/features/extract_report.json").read_bytes()
    for stage in ("prepare", "extract"):  # one edit, one repro: each stops where it began
        code = copy / "pipeline" / "stages" / f"{stage}.py"
        code.write_text(code.read_text() + "\n# a teammate's edit\n")
        assert_repro_ran(copy, lambda: dvc(copy, "repro"), ran={stage})
    assert (copy / "data/features/extract_report.json").read_bytes() == features
    timing = json.loads((copy / "reports/extract_timing.json").read_text())
    assert timing["engine"] == "local" and timing["images_per_s"] > 0


def test_the_sweep_runs_as_the_readme_gives_it(project: Path, tmp_path: Path) -> None:
    """`dvc repro sweeps/dvc.yaml` (README, Sweeps): the on-demand tune stage over the features
    the pipeline made, in a copy of the project, its best trial where the README says; two
    trials of two epochs, both at once, so that ASHA has an epoch to stop one at."""
    copy = tmp_path / "sweep" / "sat"
    shutil.copytree(project, copy, symlinks=True)
    params = copy / "params.yaml"
    small = ["tune.num_samples=2", "tune.max_epochs=2", "tune.max_concurrent=2"]
    params.write_text(yaml.safe_dump(apply_overrides(read_yaml(params.read_text()), small)))
    out = dvc(copy, "repro", "sweeps/dvc.yaml")
    assert stages_run(out) == {"sweeps/dvc.yaml:tune"}
    check_recorded_sweep(copy, out, trials=2)
    best = yaml.safe_load((copy / "reports/tune/best_params.yaml").read_text())
    assert best["attention"] == "soft" and best["apply"].startswith("dvc exp run -S train.soft.")
    # recorded in its lock
    sweep = "sweeps/dvc.yaml"
    assert_repro_ran(copy, lambda: dvc(copy, "repro", sweep), ran=set(), pipeline=sweep)


def test_pointing_the_pipeline_at_a_cluster_and_a_server_reruns_nothing(project: Path) -> None:
    """Connection settings, set in params.yaml as the README says, are not stage params."""
    params = project / "params.yaml"
    before = params.read_text()
    connection = [
        "ray.address=http://10.0.0.1:8265",
        "ray.storage_path=s3://team-bucket/ray",
        "ray.num_cpus=64",
        "ray.cpus_per_worker=8",
        "ray.max_failures=5",
        "mlflow.tracking_uri=http://10.0.0.2:5000",
        "mlflow.artifact_root=s3://team-bucket/mlflow",
        "mlflow.experiment=team",
    ]
    params.write_text(yaml.safe_dump(apply_overrides(read_yaml(before), connection)))
    try:
        status = dvc(project, "status", "dvc.yaml")  # the sweep (sweeps/dvc.yaml) never ran
        assert "Data and pipelines are up to date" in status, status
        # a result param still counts: the check above is not blind
        params.write_text(
            yaml.safe_dump(apply_overrides(read_yaml(before), [*connection, "ray.num_workers=2"]))
        )
        changed = dvc(project, "status", "dvc.yaml")
        assert "train@soft" in changed and "train@hard" in changed, changed
        assert "extract" not in changed, changed
    finally:
        params.write_text(before)


def _git(cwd: Path, *args: str) -> str:
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    return subprocess.run([*git, *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def test_push_then_a_fresh_clone_pulls_and_finds_nothing_to_run(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README "DVC remote", as a team walks it, against a real S3 API (moto) on 127.0.0.1."""
    from tests.pipeline.servers import S3_CREDENTIALS, s3_server

    for key, value in S3_CREDENTIALS.items():  # credentials only from the environment
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)  # the endpoint comes from the config
    with s3_server(tmp_path) as s3:
        s3.create_bucket("sat-dvc")
        dvc(project, "remote", "add", "-d", "store", "s3://sat-dvc/cache")
        dvc(project, "remote", "modify", "store", "endpointurl", s3.endpoint_url)
        assert "testing" not in (project / ".dvc" / "config").read_text()  # no secret in git
        _git(project, "add", "dvc.lock", ".dvc/config")
        _git(project, "commit", "-qm", "pipeline run and its DVC remote")
        assert "pushed" in dvc(project, "push")
        assert "in sync" in dvc(project, "status", "--cloud", "dvc.yaml")
        listed = s3.client().list_objects_v2(Bucket="sat-dvc", MaxKeys=10000)["Contents"]
        cache = project / ".dvc" / "cache"
        local = {p.relative_to(cache).as_posix() for p in (cache / "files").rglob("*")}
        pushed = {o["Key"].removeprefix("cache/") for o in listed}
        assert pushed == {k for k in local if (cache / k).is_file()}

        fresh = tmp_path / "fresh"
        subprocess.run(["git", "clone", "-q", str(project), str(fresh)], check=True)
        assert not (fresh / "models").exists()
        # the pipeline's outputs: with no target, dvc pull also wants the dataset profiles'
        # (profiles/*/dvc.yaml), never run here, and fails on them as missing
        dvc(fresh, "pull", "dvc.yaml")
    for rel in (
        "data/features/train.arrow",
        "models/soft/model.safetensors",
        "models/hard/curves.csv",
        "reports/hard/metrics.json",
        "reports/soft/attention/index.html",
        "reports/registry.json",
    ):
        assert (fresh / rel).read_bytes() == (project / rel).read_bytes(), rel
    # the pipeline (dvc.yaml); the on-demand sweep (sweeps/dvc.yaml) never ran in this project
    assert "Data and pipelines are up to date" in dvc(fresh, "status", "dvc.yaml")
    assert_repro_ran(fresh, lambda: dvc(fresh, "repro"), ran=set())


# ------------------------------------------------------ what a user sees after `make run`
def sat(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The installed ``sat`` command in ``project``, its output as text."""
    command = [str(Path(sys.executable).parent / "sat"), *args]
    return subprocess.run(
        command, cwd=project, env=_env(), capture_output=True, text=True, timeout=600
    )


SCENES_NOTE = "trained on the generated scenes of coloured shapes (data.source: synthetic)"


def test_the_summary_says_the_models_know_the_scenes_and_gives_the_quickstarts_caption(
    project: Path,
) -> None:
    """The summary that ``make run`` ends with; the command it gives is the quickstart's next
    block, which test_quickstart_from_make_run_to_a_served_caption runs as a user pastes it."""
    log = (project / "first_repro.log").read_text().splitlines()
    summary = log[next(i for i, x in enumerate(log) if "bin/sat summary --reports" in x) :]
    (note,) = [line for line in summary if line.startswith("note: ")]
    assert SCENES_NOTE in note and "make run PROFILE=flickr8k" in note
    (hint,) = [line for line in summary if line.startswith("caption an image:")]
    command = hint.split(":", 1)[1].split()
    image = command[2]  # a scene that this run generated
    assert command[:2] == [".venv/bin/sat", "caption"] and image.startswith("data/prepared/")
    assert (project / image).is_file()
    assert " ".join(command) == quickstart_blocks()[1].splitlines()[0]


def test_sat_train_will_not_replace_what_dvc_tracks(project: Path) -> None:
    from pipeline.tracking.registry import checkpoint_sha256

    before = checkpoint_sha256(project / "models" / "soft")
    # -S ray.use_gpu=true, as a user writes it, is accepted: the refusal is the next question
    done = sat(
        project, "train", "--attention", "soft", "-S", "train.soft.lr=1", "-S", "ray.use_gpu=true"
    )
    assert done.returncode == 1 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("sat train: error: models/soft is the output of DVC stage train@soft")
    assert "dvc exp run -S train.soft.lr=1" in line and "-S train.models_dir=" in line
    assert checkpoint_sha256(project / "models" / "soft") == before
    assert "Data and pipelines are up to date" in dvc(project, "status", "dvc.yaml")


def test_sat_evaluate_writes_its_report_beside_what_dvc_tracks(project: Path) -> None:
    tracked = (project / "reports" / "soft" / "metrics.json").read_bytes()
    done = sat(project, "evaluate", "--attention", "soft")
    assert done.returncode == 0, done.stderr
    assert "reports/soft is the output of DVC stage evaluate@soft" in done.stderr
    assert "this report goes to reports/eval/soft" in done.stderr
    scores = json.loads((project / "reports" / "eval" / "soft" / "metrics.json").read_text())
    assert scores.keys() >= METRIC_KEYS
    assert (project / "reports" / "soft" / "metrics.json").read_bytes() == tracked
    refused = sat(project, "evaluate", "--attention", "soft", "--out", "reports/hard")
    assert refused.returncode == 1
    assert refused.stderr.startswith("sat evaluate: error: --out reports/hard is the output of")
    assert "Data and pipelines are up to date" in dvc(project, "status", "dvc.yaml")
