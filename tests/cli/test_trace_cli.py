"""`gpt-inspector trace` and the CLI's error contract: exit 2, one line on stderr, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import gpt_inspector as gi
from gpt_inspector.cli import main


def test_trace_json_and_file(tiny_dir, tmp_path, capsys):
    out = tmp_path / "t.safetensors"
    rc = main(["trace", "--model", str(tiny_dir["gpt2"]), "--device", "cpu", "--prompt", "She eats",
               "--steps", "4", "--out", str(out), "--json"])  # fmt: skip
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["steps"]) == 4 and all(len(s["top5"]) == 5 for s in data["steps"])
    assert [s["step"] for s in data["steps"]] == [1, 2, 3, 4]  # counted from 1, as the window counts
    tr = gi.load_trace(out)
    assert tr.tokens == data["tokens"] and tr.text == data["text"]
    assert data["steps"][0]["top5"][0]["prob"] >= data["steps"][0]["top5"][1]["prob"]


BAD = [
    ["trace", "--prompt", "x", "--steps", "0", "--out", "o.safetensors"],
    ["trace", "--prompt", "x", "--steps", "2", "--out", "o.safetensors", "--temperature", "-1"],
    ["trace", "--prompt", "x", "--steps", "2", "--out", "o.safetensors", "--top-p", "0"],
    ["trace", "--prompt", "x", "--steps", "2", "--out", "o.safetensors", "--top-k", "0"],
    ["trace", "--prompt", "x", "--steps", "2", "--out", "o.txt"],
    ["trace", "--prompt", "x", "--steps", "two", "--out", "o.safetensors"],
    ["trace", "--prompt", "x", "--steps", "2", "--out", "o.safetensors", "--device", "tpu"],
    ["trace", "--prompt", "x", "--steps", "2", "--out", "missing/o.safetensors"],
    ["trace", "--prompt", "x", "--steps", "2", "--out", "dir.safetensors"],
]


@pytest.mark.parametrize("argv", BAD)
def test_bad_input_exits_2_with_one_line(argv, tiny_dir, tmp_path, capsys):
    (tmp_path / "dir.safetensors").mkdir()
    argv = [a if not a.endswith((".safetensors", ".txt")) else str(tmp_path / a) for a in argv]
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(argv + ["--model", str(tiny_dir["gpt2"])]))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "error" in err
    assert not (tmp_path / "missing").exists()


def test_out_is_checked_before_the_model_runs(tiny_dir, tmp_path, monkeypatch, capsys):
    import gpt_inspector.commands.common as common

    monkeypatch.setattr(common, "session", lambda *a, **k: pytest.fail("the model ran before --out was checked"))
    assert main(["trace", "--model", str(tiny_dir["gpt2"]), "--prompt", "x", "--steps", "2",
                 "--out", str(tmp_path / "nope" / "t.safetensors")]) == 2  # fmt: skip
    assert "does not exist" in capsys.readouterr().err


def test_derived_flag_writes_the_matrices(tiny_dir, tmp_path, capsys):
    out = tmp_path / "d.safetensors"
    assert main(["trace", "--model", str(tiny_dir["gpt2"]), "--device", "cpu", "--prompt", "She eats",
                 "--steps", "2", "--out", str(out), "--derived"]) == 0  # fmt: skip
    from safetensors import safe_open

    with safe_open(str(out), framework="np") as f:
        assert "layers.0.probs" in f.keys() and f.metadata()["derived"] == "1"


def test_unknown_model_offline_subprocess(tmp_path):
    """A real process: exit status 2 and a single line, even for errors deep in transformers."""
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "gpt_inspector", "trace", "--model", "nobody/nothing-here",
                        "--prompt", "x", "--steps", "1", "--out", str(tmp_path / "o.safetensors")],
                       capture_output=True, text=True, env=env)  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "not in the local cache" in r.stderr, r.stderr


def test_out_refuses_an_existing_file_unless_forced_and_never_a_symlink(tiny_dir, tmp_path, capsys):
    out = tmp_path / "t.safetensors"
    out.write_bytes(b"precious")
    base = ["trace", "--model", str(tiny_dir["gpt2"]), "--device", "cpu", "--prompt", "She eats", "--steps", "2"]
    assert main(base + ["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists" in err and "--force" in err
    assert out.read_bytes() == b"precious"
    assert main(base + ["--out", str(out), "--force"]) == 0
    assert gi.load_trace(out).n_steps == 2
    link = tmp_path / "link.safetensors"
    link.symlink_to(out)
    capsys.readouterr()
    assert main(base + ["--out", str(link), "--force"]) == 2
    assert "symbolic link" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
