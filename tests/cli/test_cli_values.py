"""Every numeric option is bounded and the prompt's encoding checked: exit 2, one line, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpt_inspector as gi
from gpt_inspector.cli import main

BAD_UTF8 = os.fsdecode(b"She eats \xff\xfe apple")  # as Python hands invalid UTF-8 argv to us

TRACE = ["trace", "--prompt", "She eats", "--steps", "2", "--out", "{out}"]
COMPARE = ["compare", "--prompt", "She eats", "--max-new-tokens", "2"]
CASES = [
    ("trace seed 2**64", TRACE + ["--seed", str(2**64)], "--seed"),
    ("trace seed -1", TRACE + ["--seed", "-1"], "--seed"),
    ("trace seed 10**100", TRACE + ["--seed", str(10**100)], "--seed"),
    ("trace temperature 1e309", TRACE + ["--temperature", "1e309"], "temperature"),
    ("trace temperature nan", TRACE + ["--temperature", "nan"], "temperature"),
    ("trace top-k 0", TRACE + ["--top-k", "0"], "top_k"),
    ("trace top-p inf", TRACE + ["--top-p", "inf"], "top_p"),
    ("trace steps 0", ["trace", "--prompt", "x", "--steps", "0", "--out", "{out}"], "--steps"),
    ("trace bad utf-8 prompt", ["trace", "--prompt", BAD_UTF8, "--steps", "2", "--out", "{out}"], "lone surrogate"),
    ("trace lone surrogate", ["trace", "--prompt", "a\ud800b", "--steps", "2", "--out", "{out}"], "lone surrogate"),
    ("compare seed 2**64", COMPARE + ["--sample", "--seed", str(2**64)], "--seed"),
    ("compare length-penalty 1e308", COMPARE + ["--length-penalty", "1e308"], "overflows"),
    ("compare length-penalty inf", COMPARE + ["--length-penalty", "inf"], "finite"),
    ("compare num-beams 10**9", COMPARE + ["--num-beams", str(10**9)], "GiB"),
    ("compare num-beams 0", COMPARE + ["--num-beams", "0"], "--num-beams"),
    ("compare max-new-tokens 10**9", ["compare", "--prompt", "x", "--max-new-tokens", str(10**9)], "context"),
    ("compare bad utf-8", ["compare", "--prompt", BAD_UTF8, "--max-new-tokens", "2"], "lone surrogate"),
    ("math-check seed 2**64", ["math-check", "--prompt", "x", "--steps", "2", "--seed", str(2**64)], "seed"),
]


@pytest.mark.parametrize("name,argv,match", CASES, ids=[c[0] for c in CASES])
def test_cli_value_exits_2_with_one_line(tiny_dir, tmp_path, capsys, name, argv, match):
    argv = [a.replace("{out}", str(tmp_path / "o.safetensors")) for a in argv]
    try:
        rc = main(argv + ["--model", str(tiny_dir["gpt2"]), "--device", "cpu"])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert match in err, err
    assert not (tmp_path / "o.safetensors").exists()


SUBPROCESS = [c for c in CASES if c[0] in ("trace seed 2**64", "trace bad utf-8 prompt", "compare num-beams 10**9",
                                           "compare length-penalty 1e308")]  # fmt: skip


@pytest.mark.parametrize("name,argv,match", SUBPROCESS, ids=[c[0] for c in SUBPROCESS])
def test_cli_value_in_a_real_process(tiny_dir, tmp_path, name, argv, match):
    argv = [os.fsencode(a.replace("{out}", str(tmp_path / "o.safetensors"))) for a in argv]
    env = dict(os.environ, PYTHONPATH=str(Path(gi.__file__).resolve().parents[1]), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable.encode(), b"-m", b"gpt_inspector", *argv,
                        b"--model", os.fsencode(tiny_dir["gpt2"]), b"--device", b"cpu"],
                       capture_output=True, env=env, timeout=300)  # fmt: skip
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert match in err
