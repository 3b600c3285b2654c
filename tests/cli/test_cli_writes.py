"""Every file a command writes goes through the one writer: an unwritable folder is found before the work,
a full disk costs one line, the old file stays byte for byte and no temporary is left."""

from __future__ import annotations

import os

import pytest
from writing import full_disk, read_only

from gpt_inspector.cli import main
from gpt_inspector.commands import common

OLD = b"\x89PNG old file " * 430  # ~6,000 bytes, as in the report


def _commands(tiny_dir, tmp_path, out):
    model = ["--model", str(tiny_dir["gpt2"]), "--device", "cpu"]
    (tmp_path / "p.txt").write_text("She eats an apple\n", encoding="utf-8")
    sweep = ["kv-lab", *model, "--sweep", "--prompts", str(tmp_path / "p.txt"), "--policies", "int8", "--steps", "1",
             "--no-probe"]  # fmt: skip
    return {
        "trace": ["trace", *model, "--prompt", "She eats", "--steps", "2", "--out", str(out) + ".safetensors", "--force"],
        "export": ["export", *model, "--prompt", "She eats", "--steps", "1", "--layer", "0", "--head", "0", "--out", str(out) + ".png"],
        "lens": ["lens", *model, "--prompt", "She eats", "--out", str(out) + ".svg"],
        "kv-lab --out": ["kv-lab", *model, "--prompt", "She eats", "--policy", "int8", "--steps", "1", "--out", str(out) + ".pdf"],
        "kv-lab --json": ["kv-lab", *model, "--prompt", "She eats", "--policy", "int8", "--steps", "1", "--json", str(out) + ".json"],
        "sweep --out": [*sweep, "--out", str(out) + ".png"],
        "sweep --json": [*sweep, "--json", str(out) + ".json"],
    }  # fmt: skip


NAMES = ("trace", "export", "lens", "kv-lab --out", "kv-lab --json", "sweep --out", "sweep --json")


@pytest.mark.parametrize("name", NAMES)
def test_a_read_only_folder_is_refused_before_the_model_loads(tiny_dir, tmp_path, capsys, monkeypatch, name):
    ro = tmp_path / "ro"
    ro.mkdir()
    argv = _commands(tiny_dir, tmp_path, ro / "result")[name]

    def no_load(*a, **k):
        raise AssertionError("the model loaded before the destination was checked")

    monkeypatch.setattr(common, "load", no_load)
    monkeypatch.setattr(common, "session", no_load)
    with read_only(ro, monkeypatch):
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "cannot write" in err, err
    assert "Read-only file system" in err or "Permission denied" in err, err
    assert os.listdir(ro) == []


@pytest.mark.parametrize("name", NAMES)
def test_a_full_disk_keeps_the_old_file_and_leaves_no_temporary(tiny_dir, tmp_path, capsys, monkeypatch, name):
    if name == "trace":
        pytest.skip("safetensors writes from Rust, not os.write: tests/core/test_saving.py fills its disk")
    out = tmp_path / "out"
    out.mkdir()
    argv = _commands(tiny_dir, tmp_path, out / "result")[name]
    target = out / ("result" + os.path.splitext(argv[argv.index("--out" if "--out" in argv else "--json") + 1])[1])
    target.write_bytes(OLD)
    with full_disk(out, monkeypatch, after=100):
        rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if not line.startswith("[")]  # a sweep's progress bar comes first
    assert len(lines) == 1 and "No space left on device" in lines[0] and "Traceback" not in err, err
    assert target.read_bytes() == OLD
    assert os.listdir(out) == [target.name]
