"""`gpt-inspector probe-cache` and `math-check`: JSON output and exit codes."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import gpt_inspector as gi
from gpt_inspector.cli import main


def _model(tiny_dir, family="llama"):
    return ["--model", str(tiny_dir[family]), "--device", "cpu"]


def test_probe_cache_json(tiny_dir, capsys):
    rc = main(["probe-cache", *_model(tiny_dir), "--prompt", "The cat sat on the mat", "--steps", "3",
               "--layers", "0,1", "--json"])  # fmt: skip
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert [lp["layer"] for lp in data["layers"]] == [0, 1]
    assert [lp["method"] for lp in data["layers"]] == ["direct", "cache"]
    n = data["positions"]
    assert n == len(data["true_tokens"]) >= 8
    for lp in data["layers"]:
        assert lp["recovered"] == lp["total"] == lp["exact"] == n
        assert [p["token_id"] for p in lp["positions"]] == data["true_tokens"]
        assert all(p["correct"] and p["margin"] > 0 for p in lp["positions"])


def test_probe_cache_text(tiny_dir, capsys):
    rc = main(["probe-cache", *_model(tiny_dir, "gpt2"), "--prompt", "She eats an apple"])
    out = capsys.readouterr()
    assert rc == 0
    lines = out.out.splitlines()
    assert lines[0].startswith("layer 0 (direct)")
    assert sum(line.rstrip().endswith("✓") for line in lines) >= 4
    assert "✗" not in out.out
    assert "recovered" in lines[-1] and "'She eats an apple'" in lines[-1]
    assert "layer 0 (direct): recovered" in out.err


def test_probe_cache_greedy(tiny_dir, capsys):
    rc = main(["probe-cache", *_model(tiny_dir, "gpt_neox"), "--prompt", "One two three", "--layers", "1",
               "--context", "greedy", "--json"])  # fmt: skip
    assert rc == 0
    lp = json.loads(capsys.readouterr().out)["layers"][0]
    assert lp["method"] == "greedy" and lp["recovered"] == lp["total"]


def test_math_check_live_json(tiny_dir, capsys):
    rc = main(["math-check", *_model(tiny_dir, "qwen2"), "--prompt", "She eats", "--steps", "4", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["max_abs_diff"] < 1e-5
    assert len(data["layers"]) == 2 and all(len(lay["heads"]) == 4 for lay in data["layers"])
    assert data["formula"].startswith("out = softmax")


def test_math_check_one_vector(tiny_dir, capsys):
    rc = main(["math-check", *_model(tiny_dir), "--prompt", "She eats", "--layer", "1", "--head", "3",
               "--position", "1", "--json"])  # fmt: skip
    assert rc == 0
    c = json.loads(capsys.readouterr().out)
    assert (c["layer"], c["head"], c["kv_head"], c["position"]) == (1, 3, 1, 1)
    assert len(c["recomputed"]) == len(c["model"]) == 8 and c["ok"]
    rc = main(["math-check", *_model(tiny_dir), "--prompt", "She eats", "--layer", "0", "--head", "0"])
    out = capsys.readouterr().out
    assert rc == 0 and "recomputed" in out and out.rstrip().endswith("match")


@pytest.fixture(scope="module")
def traces(tiny_lm, tmp_path_factory):
    d = tmp_path_factory.mktemp("traces")
    s = gi.Session(tiny_lm("gpt2"), "She eats an apple")
    s.run(3)
    good = s.save_trace(d / "good.safetensors")
    with safe_open(str(good), framework="np") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["layers.1.attn_out"][2, 2, 0] += 0.05  # kept rows start at the prompt's last position
    bad = d / "bad.safetensors"
    save_file(tensors, str(bad), metadata=meta)
    return good, bad, len(s.prompt_ids) - 1 + 2


def test_math_check_trace_ok_and_mismatch(traces, capsys):
    good, bad, pos = traces
    assert main(["math-check", "--trace", str(good)]) == 0
    out = capsys.readouterr()
    assert "layer  1:" in out.out and "match the model" in out.out and out.err == ""
    assert main(["math-check", "--trace", str(bad)]) == 1
    out = capsys.readouterr()
    assert "✗" in out.out
    assert "mismatch" in out.err and f"layer 1 head 2 position {pos}" in out.err
    assert len(out.err.strip().splitlines()) == 1
    assert main(["math-check", "--trace", str(bad), "--layer", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    assert main(["math-check", "--trace", str(bad), "--layer", "1", "--head", "2", "--position", str(pos)]) == 1
    capsys.readouterr()
    # a prompt position before the kept head outputs: one line, exit 2, not a made-up verdict
    assert main(["math-check", "--trace", str(bad), "--layer", "1", "--head", "2", "--position", "0"]) == 2
    err = capsys.readouterr().err
    assert "not kept" in err and len(err.strip().splitlines()) == 1
    assert main(["math-check", "--trace", str(bad), "--tolerance", "1"]) == 0


BAD = [
    ["math-check"],
    ["math-check", "--trace", "{tmp}/missing.safetensors"],
    ["math-check", "--trace", "{good}", "--prompt", "x"],
    ["math-check", "--trace", "{good}", "--layer", "9"],
    ["math-check", "--trace", "{good}", "--head", "1"],
    ["math-check", "--trace", "{good}", "--layer", "0", "--head", "1", "--position", "99"],
    ["math-check", "--trace", "{good}", "--tolerance", "-1"],
    ["math-check", "--trace", "{good}", "--layer", "one"],
    ["math-check", "{model}", "--prompt", "x", "--steps", "0"],
    ["probe-cache", "{model}", "--prompt", "x", "--layers", "a,b"],
    ["probe-cache", "{model}", "--prompt", "x", "--layers", ","],
    ["probe-cache", "{model}", "--prompt", "x", "--layers", "7"],
    ["probe-cache", "{model}", "--prompt", "x", "--steps", "0"],
    ["probe-cache", "{model}", "--prompt", "x", "--context", "psychic"],
    ["probe-cache", "--model", "{tmp}/nowhere", "--prompt", "x"],
    ["probe-cache", "{model}"],
]


@pytest.mark.parametrize("argv", BAD)
def test_bad_input_exits_2_with_one_line(argv, traces, tiny_dir, tmp_path, capsys):
    good, _, _ = traces
    args = []
    for a in argv:
        if a == "{model}":
            args += _model(tiny_dir, "gpt2")
        else:
            args.append(a.format(tmp=tmp_path, good=good))
    assert _exit_code(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _exit_code(args) -> int:
    # argparse reports its own errors by SystemExit, the commands by main()'s return value
    try:
        return main(args)
    except SystemExit as e:
        return e.code
