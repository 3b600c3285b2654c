"""`gpt-inspector export`: heatmaps from a trace or a fresh run; bad input is exit 2, one line."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from gpt_inspector.cli import main


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def trace_file(tiny_lm, tmp_path_factory):
    from gpt_inspector import Session

    s = Session(tiny_lm("gpt2"), "She eats an apple")
    s.run(3)
    return s.save_trace(tmp_path_factory.mktemp("trace") / "t.safetensors")


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["export", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_one_head_from_a_trace(trace_file, tmp_path, capsys):
    out = tmp_path / "h.png"
    rc, _, err = _run(capsys, "--trace", trace_file, "--layer", 1, "--head", 2, "--out", out)
    assert rc == 0, err
    assert "layer 1 head 2" in err and str(out) in err
    w1, h1 = _png_size(out)
    rc, _, err = _run(
        capsys, "--trace", trace_file, "--layer", 1, "--head", 2, "--out", tmp_path / "h4.png", "--scale", 4
    )
    assert rc == 0, err
    w4, h4 = _png_size(tmp_path / "h4.png")
    assert abs(w4 - 2 * w1) <= 1 and abs(h4 - 2 * h1) <= 1  # the default scale is 2


def test_grids_and_svg_from_a_trace(trace_file, tmp_path, capsys):
    from gpt_inspector import load_trace

    labels = load_trace(trace_file).token_labels()[:-1]
    rc, _, err = _run(capsys, "--trace", trace_file, "--layer", 0, "--head", "all", "--kind", "masked_scores",
                      "--out", tmp_path / "layer.svg")  # fmt: skip
    assert rc == 0, err
    text = "".join(e.text or "" for e in ET.parse(tmp_path / "layer.svg").iter("{http://www.w3.org/2000/svg}text"))
    assert "head 3" in text and "masked" in text
    rc, _, err = _run(
        capsys, "--trace", trace_file, "--layer", 1, "--head", 0, "--kind", "scores", "--out", tmp_path / "h.svg"
    )
    assert rc == 0, err
    text = "".join(e.text or "" for e in ET.parse(tmp_path / "h.svg").iter("{http://www.w3.org/2000/svg}text"))
    assert all(label in text for label in labels)
    rc, _, err = _run(capsys, "--trace", trace_file, "--layer", "all", "--out", tmp_path / "all.png")
    assert rc == 0, err
    assert min(_png_size(tmp_path / "all.png")) > 100
    rc, _, err = _run(capsys, "--trace", trace_file, "--layer", 1, "--head", 0, "--out", tmp_path / "h.pdf")
    assert rc == 0, err
    assert (tmp_path / "h.pdf").read_bytes().startswith(b"%PDF-")


def test_from_a_model_run_matches_the_trace(tiny_dir, trace_file, tmp_path, capsys):
    live = tmp_path / "live.png"
    rc, _, err = _run(capsys, "--model", tiny_dir["gpt2"], "--device", "cpu", "--prompt", "She eats an apple",
                      "--steps", 3, "--layer", 0, "--head", 1, "--out", live)  # fmt: skip
    assert rc == 0, err
    rc, _, err = _run(capsys, "--trace", trace_file, "--layer", 0, "--head", 1, "--out", tmp_path / "saved.png")
    assert rc == 0, err
    assert live.read_bytes() == (tmp_path / "saved.png").read_bytes()


def test_full_resolution_one_head(trace_file, tmp_path, capsys, monkeypatch):
    """--full-resolution: the SVG embeds the T x T matrix unresampled, the PNG names it in its subtitle;
    every file is written in row bands (figures.stream, tested against the in-memory figure in tests/figures)."""
    import base64
    import io

    from matplotlib.image import imread

    from gpt_inspector import figures, load_trace
    from gpt_inspector.figures import stream

    streamed, real = [], stream.write_head
    monkeypatch.setattr(stream, "write_head", lambda *a, **k: streamed.append(a[4]) or real(*a, **k))

    t = load_trace(trace_file).cache_length
    rc, _, err = _run(
        capsys, "--trace", trace_file, "--layer", 1, "--head", 2, "--full-resolution", "--out", tmp_path / "f.svg"
    )
    assert rc == 0, err
    assert "layer 1 head 2 (--full-resolution)" in err
    root = ET.parse(tmp_path / "f.svg").getroot()
    images = [e for e in root.iter("{http://www.w3.org/2000/svg}image") if e.get("width") == str(t)]
    assert len(images) == 1
    data = base64.b64decode(images[0].get("{http://www.w3.org/1999/xlink}href").split(",", 1)[1])
    assert imread(io.BytesIO(data)).shape[:2] == (t, t)
    text = "".join(e.text or "" for e in root.iter("{http://www.w3.org/2000/svg}text"))
    assert "full resolution" in text
    rc, _, err = _run(
        capsys, "--trace", trace_file, "--layer", 1, "--head", 2, "--full-resolution", "--out", tmp_path / "f.png"
    )
    assert rc == 0, err
    want = figures.head_figure(load_trace(trace_file), 1, 2, "probs", dpi=200, full_resolution=True)
    assert _png_size(tmp_path / "f.png") == figures.pixel_size(want, 200)  # laid out at the default scale, 2
    rc, _, err = _run(
        capsys, "--trace", trace_file, "--layer", 1, "--head", 2, "--full-resolution", "--out", tmp_path / "f.pdf"
    )
    assert rc == 0, err
    assert f"/Width {t} /Height {t}".encode() in (tmp_path / "f.pdf").read_bytes()
    assert [os.path.splitext(str(p))[1] for p in streamed] == [".svg", ".png", ".pdf"]
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    from gpt_inspector.figures import fullres

    assert f"Past {fullres.MAX_CELLS:,}" in " ".join(capsys.readouterr().out.split())  # the help states the real limit


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--trace", "{missing}", "--layer", "0", "--head", "0", "--out", "{out}.png"], "no trace file"),
        (["--trace", "{trace}", "--layer", "2", "--head", "0", "--out", "{out}.png"], "--layer must be in [0, 2)"),
        (["--trace", "{trace}", "--layer", "0", "--head", "4", "--out", "{out}.png"], "--head must be in [0, 4)"),
        (["--trace", "{trace}", "--layer", "-1", "--head", "0", "--out", "{out}.png"], "--layer must be"),
        (["--trace", "{trace}", "--layer", "0", "--head", "0", "--out", "{out}.jpg"], ".png, .svg or .pdf"),
        (["--trace", "{trace}", "--layer", "0", "--head", "0", "--out", "{out}"], ".png, .svg or .pdf"),
        (["--trace", "{trace}", "--layer", "zero", "--head", "0", "--out", "{out}.png"], "integer or 'all'"),
        (["--trace", "{trace}", "--layer", "0", "--out", "{out}.png"], "--head"),
        (["--trace", "{trace}", "--layer", "all", "--head", "1", "--out", "{out}.png"], "drop --head"),
        (
            ["--trace", "{trace}", "--layer", "0", "--head", "0", "--kind", "nope", "--out", "{out}.png"],
            "invalid choice",
        ),
        (["--trace", "{trace}", "--layer", "0", "--head", "0", "--out", "{out}.png", "--scale", "0"], "scale"),
        (["--trace", "{trace}", "--layer", "0", "--head", "0", "--out", "{out}/sub/x.png"], "does not exist"),
        (
            ["--trace", "{trace}", "--prompt", "hi", "--layer", "0", "--head", "0", "--out", "{out}.png"],
            "drop --prompt",
        ),
        (["--trace", "{notrace}", "--layer", "0", "--head", "0", "--out", "{out}.png"], "not a readable trace"),
        (["--layer", "0", "--head", "0", "--out", "{out}.png"], "--trace FILE, or --prompt and --steps"),
        (
            [
                "--model",
                "{model}",
                "--prompt",
                "hi",
                "--steps",
                "0",
                "--layer",
                "0",
                "--head",
                "0",
                "--out",
                "{out}.png",
            ],
            "steps",
        ),
        (
            [
                "--model",
                "{model}",
                "--prompt",
                "hi",
                "--steps",
                "1",
                "--layer",
                "3",
                "--head",
                "0",
                "--out",
                "{out}.png",
            ],
            "--layer",
        ),
        (
            ["--trace", "{trace}", "--layer", "0", "--head", "all", "--full-resolution", "--out", "{out}.png"],
            "one head",
        ),
        (["--trace", "{trace}", "--layer", "all", "--full-resolution", "--out", "{out}.svg"], "one head"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, needle, trace_file, tiny_dir, tmp_path, capsys):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a trace at all")
    subs = {"{missing}": str(tmp_path / "none.safetensors"), "{trace}": str(trace_file), "{out}": str(tmp_path / "o"),
            "{notrace}": str(junk), "{model}": str(tiny_dir["gpt2"])}  # fmt: skip
    args = []
    for a in argv:
        for k, v in subs.items():
            a = a.replace(k, v)
        args.append(a)
    try:
        rc = main(["export", *args])
    except SystemExit as e:  # argparse reports its own errors by exiting
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2, (rc, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0], lines[0]
    assert not any(tmp_path.glob("o*")), "nothing is written on bad input"


def test_real_process_prints_no_traceback(tmp_path):
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", HF_HUB_OFFLINE="1")
    r = subprocess.run(
        [sys.executable, "-m", "gpt_inspector", "export", "--trace", str(tmp_path / "no.safetensors"),
         "--layer", "0", "--head", "0", "--out", str(tmp_path / "x.png")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip() == f"gpt-inspector: error: no trace file at {tmp_path / 'no.safetensors'}"
