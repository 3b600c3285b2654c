"""The transformers range the package declares, as a user meets it from the command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpt_inspector as gi
from gpt_inspector.core import hf


@pytest.mark.parametrize(("version", "old"), [("5.13.0", True), ("5.20.2", True), ("5.21.0", False), ("5.24.0", False)])
def test_the_floor_is_the_declared_one(version, old):
    assert hf._too_old(version) is old


def test_an_older_transformers_is_refused_in_one_line(tmp_path):
    # a stand-in transformers package that says it is 5.13 (the release before get_layer_types_and_kwargs)
    fake = tmp_path / "transformers"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "5.13.0"\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(Path(gi.__file__).resolve().parents[1])]))
    r = subprocess.run([sys.executable, "-m", "gpt_inspector", "trace", "--prompt", "She", "--steps", "1", "--out",
                        str(tmp_path / "t.safetensors")],
                       capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "needs transformers>=5.21.0,<5.25, this environment has 5.13.0" in r.stderr
    # --help never imports transformers, so it still works
    r = subprocess.run([sys.executable, "-m", "gpt_inspector", "--help"], capture_output=True, text=True, env=env,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0 and "usage: gpt-inspector" in r.stdout
