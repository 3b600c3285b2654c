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
    # counted from 1, as the window's status bar counts: the third token chosen is step 3
    assert f"step 3 (position {s.steps_done[-1].position}) chose" in text


def test_knock_out_from_the_cli(tiny_dir, capsys):
    argv = ["lens", "--model", str(tiny_dir["gpt2"]), "--prompt", "She eats", "--steps", "2", "--knock-out", "1.2",
            "--knock-out", "0", "--json"]  # fmt: skip
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["knock_out"]["edits"] == [{"layer": 1, "head": 2, "patch_from": None},
                                       {"layer": 0, "head": None, "patch_from": None}]  # fmt: skip
    assert d["knock_out"]["prob_before"] != d["knock_out"]["prob_after"]
    assert all(v == 0 for v in d["attribution"][0])  # the knocked layer pushes nothing


@pytest.mark.parametrize("extra", [["--steps", "0"], ["--top", "0"], ["--knock-out", "x.1"], ["--knock-out", "9.0"]])
def test_bad_input_is_one_line(tiny_dir, capsys, extra):
    argv = ["lens", "--model", str(tiny_dir["gpt2"]), "--prompt", "x", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_lens_figure_to_png_svg_pdf(tiny_dir, tmp_path, capsys, suffix, magic):
    out = tmp_path / f"lens{suffix}"
    assert main(["lens", "--model", str(tiny_dir["gpt2"]), "--prompt", "She eats", "--steps", "2",
                 "--out", str(out)]) == 0  # fmt: skip
    data = out.read_bytes()
    assert data.startswith(magic)
    if suffix == ".svg":
        text = data.decode()
        assert "logit lens" in text and "layer 1" in text and "direct push on the logit" in text


def test_lens_out_is_checked_before_the_model_runs(tiny_dir, tmp_path, capsys):
    assert main(["lens", "--model", str(tiny_dir["gpt2"]), "--prompt", "x", "--out", str(tmp_path / "l.bmp")]) == 2
    assert "png" in capsys.readouterr().err


def test_lens_out_folder_is_checked_before_the_model_runs(tiny_dir, tmp_path, capsys, monkeypatch):
    """A typo in the folder is found before the model loads and runs, as kv-lab and export find it."""
    from gpt_inspector.commands import common

    def no_model(_args):
        raise AssertionError("the model ran before --out was checked")

    monkeypatch.setattr(common, "session", no_model)
    out = tmp_path / "no-such-folder" / "lens.png"
    assert main(["lens", "--model", str(tiny_dir["gpt2"]), "--prompt", "x", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"folder {out.parent} does not exist" in err
