"""The package as a user installs it: ``pip wheel .`` into a fresh virtualenv, not editable.

The wheel must ship the kernels' C++ source beside ``native.py``: the installed package builds
it, trains a step on the native backend's recurrence and captions a real photo. The
virtualenv sees the test environment's site-packages (torch and the rest) through a path
file, but not its editable ``sat``: ``sat_model`` is the wheel's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from sat_model.paths import shared_data
from tests.factories import ROOT

HAS_COMPILER = shutil.which(os.environ.get("CXX") or "c++") is not None

SCRIPT = """
import sys
from pathlib import Path
import torch
from PIL import Image
import sat_model
from sat_model.captioner import Captioner
from sat_model.config import ModelParams, SoftTrainConfig
from sat_model.data.vocab import SPECIALS, Vocab
from sat_model.features.encoders import build_encoder
from sat_model.model.checkpoint import save_checkpoint
from sat_model.model.factory import build_model
from sat_model.model.kernels import backend, native
from sat_model.model.losses import build_criterion

assert Path(sat_model.__file__).is_relative_to(sys.prefix), sat_model.__file__
assert native.SOURCE.is_file() and native.load() is not None
ran = []
recurrence = backend.recurrence
backend.recurrence = lambda *a: ran.append("train") or recurrence(*a)

torch.manual_seed(0)
vocab = Vocab((*SPECIALS, "a", "dog", "runs"), 1, 100, 20)
spec = build_encoder("random", input_size=64).spec
model = build_model(
    ModelParams(embed_dim=8, hidden_dim=16, attention_dim=8),
    vocab_size=len(vocab), annotation_dim=spec.annotation_dim,
    num_locations=spec.num_locations, attention="soft",
)
captions = torch.tensor([[1, 4, 5, 6, 2], [1, 5, 6, 2, 0]])
annotations = torch.randn(2, spec.num_locations, spec.annotation_dim)
loss = build_criterion("soft", SoftTrainConfig())(model(annotations, captions), captions).loss
loss.backward()
torch.optim.Adam(model.parameters()).step()
save_checkpoint(
    sys.argv[1], model_config=model.config, vocab=vocab, model_state=model.state_dict(),
    extra_config={"attention": "soft", "encoder": {**spec.to_fields(), "resize": 72}},
)
[caption] = Captioner.from_dir(sys.argv[1]).caption([Image.open(sys.argv[2]).convert("RGB")])
assert set(caption.words) <= {"a", "dog", "runs", "<unk>"}, caption
assert ran == ["train"], ran
print("ok", caption.words)
"""


@pytest.mark.slow
@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on PATH")
def test_the_wheel_installs_trains_and_captions_with_the_kernels(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy: building leaves build/ and egg-info behind
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, source / name)
    for package in ("sat_model", "pipeline"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__py*"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    wheels = tmp_path / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps"]
    build += ["--no-build-isolation", "--wheel-dir", str(wheels)]
    subprocess.run(build, check=True, env=env, capture_output=True, timeout=600)
    [wheel] = wheels.glob("sat-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout.strip()
    # the test environment's packages as a plain path: its .pth files (the editable sat) stay out
    (Path(site) / "shared.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = [python, "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)]
    subprocess.run(install, check=True, env=env, capture_output=True, timeout=600)
    photo = next((shared_data() / "flickr8k-sample" / "Flickr8k_Dataset").glob("*.jpg"))
    run = subprocess.run(
        [python, "-c", SCRIPT, str(tmp_path / "model"), str(photo)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("ok"), run.stdout
