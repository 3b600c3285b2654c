"""`gpt-inspector lens`: the table and the JSON agree with the API; bad input is one line, exit 2."""

from __future__ import annotations

import json

import pytest

from gpt_inspector.cli import main


def test_lens_json_matches_the_api(tiny_dir, capsys):
    import gpt_inspector as gi
    from gpt_inspector.core.lens import lens

    argv = ["lens", "--model", str(tiny_dir["gpt2"]), "--device", "cpu", "--prompt", "She eats", "--steps", "3"]
    assert main(argv + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    s = gi.Session(gi.load_model(tiny_dir["gpt2"], device="cpu"), "She eats")
    s.run(3)
    r = lens(s)
    assert d["token_id"] == r.token_id and len(d["layers"]) == s.lm.n_layers
    assert d["layers"][-1]["logit"] == pytest.approx(r.layers[-1].logit)
    assert len(d["attribution"]) == s.lm.n_layers and len(d["attribution"][0]) == s.lm.n_heads
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "p(chosen)" in text and "heads pushing it most" in text


@pytest.mark.parametrize("extra", [["--steps", "0"], ["--top", "0"]])
def test_bad_input_is_one_line(tiny_dir, capsys, extra):
    argv = ["lens", "--model", str(tiny_dir["gpt2"]), "--prompt", "x", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
