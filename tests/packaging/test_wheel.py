"""The built wheel carries the demo model, and an installed package starts on it from anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    import importlib.util

    # with setuptools at hand, build offline: an isolated build would fetch it from the index
    offline = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *offline, str(ROOT), "-w", str(out)],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = out.glob("*.whl")
    return whl


def test_wheel_holds_the_demo_model(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert f"gpt_inspector/demo_model/{f}" in names
    assert not any(n.startswith("resources/") for n in names)


def test_installed_package_resolves_the_demo_model_inside_itself(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(target)}
    env.pop("GPT_INSPECTOR_DEMO_MODEL", None)
    code = (
        "import gpt_inspector as gi; lm = gi.load_model(); print(gi.__file__); print(gi.DEMO_MODEL); print(lm.n_layers)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    pkg_file, demo, layers = r.stdout.split()
    assert Path(pkg_file).is_relative_to(target) and Path(demo) == target / "gpt_inspector" / "demo_model"
    assert int(layers) == 4
