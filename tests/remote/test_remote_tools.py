"""The tools over the link: lens, math check, export, a downloaded trace and the CLI's ``--connect``,
each equal to the same tool run on a local session of the same checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import gpt_inspector as gi
from gpt_inspector.cli import main
from gpt_inspector.core.edits import HeadEdit
from gpt_inspector.core.lens import lens
from gpt_inspector.core.mathcheck import check, check_all

PROMPT = "She eats an apple. He reads"


@pytest.fixture
def pair(server, local_lm):
    """(remote, local): the same session, three steps in, on the server and here."""
    r = gi.connect(server.url, prompt=PROMPT)
    s = gi.Session(local_lm, PROMPT)
    # the first lens on a model installs its residual hooks; from then on a step records the residual
    # (an incremental forward) where the first lens recomputed it (a whole-prefix forward): the two differ
    # in float32 rounding, so both sides take the lens once first, whatever the shared server ran before
    r.run(1), s.run(1)
    lens(r), lens(s)
    r.run(2), s.run(2)
    yield r, s
    r.close()


def test_lens_and_math_check_run_on_the_engine_and_give_the_local_numbers(pair):
    r, s = pair
    a, b = lens(r), lens(s)
    assert a.to_json() == b.to_json() and np.array_equal(a.attribution, b.attribution)
    assert [x.top for x in a.layers] == [x.top for x in b.layers]  # the logits too, not only what to_json keeps
    for layer, head, pos in ((0, 1, None), (1, 3, s.cache_length - 2)):
        x, y = check(r, layer, head, pos), check(s, layer, head, pos)
        assert (x.layer, x.head, x.kv_head, x.position, x.tolerance) == (y.layer, y.head, y.kv_head, y.position,
                                                                         y.tolerance)  # fmt: skip
        for f in ("weights", "allowed", "recomputed", "model"):
            assert np.array_equal(getattr(x, f), getattr(y, f)), f
    x, y = check_all(r), check_all(s)
    assert x.layers == y.layers and np.array_equal(x.max_diff, y.max_diff)
    assert np.array_equal(x.worst_position, y.worst_position) and np.array_equal(x.tolerance, y.tolerance)
    # the head outputs the engine keeps (rows before the prompt's last recomputed there), one layer asked for
    assert torch.equal(r.head_outputs(1), s.head_outputs(1))


def test_export_and_save_trace_land_here_with_the_engines_numbers(pair, tmp_path):
    r, s = pair
    gi.render_heatmap(r, 1, 2, "probs", tmp_path / "remote.svg")
    gi.render_heatmap(s, 1, 2, "probs", tmp_path / "local.svg")
    assert (tmp_path / "remote.svg").read_bytes() == (tmp_path / "local.svg").read_bytes()
    path = r.save_trace(tmp_path / "run.safetensors")  # written by the engine, downloaded here
    t = gi.load_trace(path)
    assert t.tokens == s.tokens
    for layer in range(s.n_layers):
        assert np.array_equal(t.attention(layer, 0), s.attention(layer, 0))
        assert torch.equal(t.keys(layer), s.keys(layer)) and torch.equal(t.queries(layer), s.queries(layer))
    with pytest.raises(gi.InspectorError, match="end in .safetensors"):
        r.save_trace(tmp_path / "run.json")


def test_cli_trace_and_lens_take_connect(server, local_lm, tmp_path, capsys):
    out = tmp_path / "t.safetensors"
    assert (
        main(["trace", "--connect", server.url, "--prompt", PROMPT, "--steps", "3", "--out", str(out), "--json"]) == 0
    )
    got = json.loads(capsys.readouterr().out)
    s = gi.Session(local_lm, PROMPT)
    s.run(3)
    assert got["tokens"] == s.tokens and got["text"] == s.text and got["kv_cache_bytes"] == s.kv_cache_bytes()
    assert [x["prob"] for x in got["steps"]] == [st.prob for st in s.steps_done]
    assert gi.load_trace(out).tokens == s.tokens
    assert main(["lens", "--connect", server.url, "--prompt", PROMPT, "--steps", "3", "--knock-out", "1.2",
                 "--json"]) == 0  # fmt: skip
    got = json.loads(capsys.readouterr().out)
    s.set_head_edits([HeadEdit(1, 2)])
    want = lens(s).to_json()
    assert {k: got[k] for k in want} == want


@pytest.mark.parametrize(
    "args, words",
    [
        (["--connect", "http://127.0.0.1:1/?token=x"], "ws://HOST:PORT"),
        (["--connect", "WRONG"], "valid token is required"),
        (["--connect", "URL", "--model", "gpt2"], "leave out --model"),
    ],
)
def test_cli_connect_refuses_a_bad_url_or_token_in_one_line(server, args, words, capsys, tmp_path):
    url = server.url.split("?")[0] + "?token=wrong"
    args = [url if a == "WRONG" else server.url if a == "URL" else a for a in args]
    code = main(["trace", *args, "--prompt", "x", "--steps", "1", "--out", str(tmp_path / "t.safetensors")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and words in err and "Traceback" not in err
    assert server.url.split("token=")[1] not in err


def test_the_view_sized_reads_are_the_local_readers_bit_for_bit(pair):
    # what the window reads past 1,024 positions (pooled rows, pooled raw columns, a zoomed tile) and the
    # overview's bins, at small blocks on the tiny run: the engine's answer is the local reader's
    r, s = pair
    t = s.cache_length
    assert np.array_equal(r.overview_bins(0, t, 2), s.overview_bins(0, t, 2))
    assert np.array_equal(r.overview_bins(t - 1, t, 4), s.overview_bins(t - 1, t, 4))
    for kind in ("raw", "scores", "masked_scores", "probs"):
        a, b = r.pooled_rows(1, 3, kind, 2, t, t, 2), s.pooled_rows(1, 3, kind, 2, t, t, 2)
        assert np.array_equal(a, b, equal_nan=True), kind
        a, b = r.attention_block(0, 1, kind, 1, t - 1, 2, t), s.attention_block(0, 1, kind, 1, t - 1, 2, t)
        assert np.array_equal(a, b, equal_nan=True), kind
        a = r.attention_block(0, 2, kind, 0, 4, 4, t, every=True, block=2)
        b = s.attention_block(0, 2, kind, 0, 4, 4, t, every=True, block=2)
        assert np.array_equal(a, b, equal_nan=True), kind
    assert torch.equal(r.allowed_rows(1, 2, t), s.allowed_rows(1, 2, t))
    assert np.array_equal(r.allowed(1, 0), s.allowed(1, 0))
    assert (r.kv_cache_bytes(), r.kv_kept_bytes(), r.kv_cache_bytes(length=t - 2)) == (
        s.kv_cache_bytes(), s.kv_kept_bytes(), s.kv_cache_bytes(length=t - 2))  # fmt: skip


def test_cli_math_check_probe_cache_and_export_take_connect(server, local_lm, tmp_path, capsys):
    from gpt_inspector.core.probe import probe_session

    base = ["--connect", server.url, "--prompt", PROMPT, "--steps", "2"]
    s = gi.Session(local_lm, PROMPT)
    s.run(2)
    assert main(["math-check", *base, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(check_all(s).to_json(), ensure_ascii=True))
    assert main(["probe-cache", *base, "--layers", "0,1", "--json"]) == 0
    got, want = json.loads(capsys.readouterr().out), probe_session(s, [0, 1]).to_json()
    for x in (got, want):
        for layer in x["layers"]:
            layer.pop("seconds")
    assert got == json.loads(json.dumps(want))
    out = tmp_path / "l1.svg"
    assert main(["export", *base, "--layer", "1", "--head", "2", "--kind", "probs", "--out", str(out)]) == 0
    gi.render_heatmap(s, 1, 2, "probs", tmp_path / "local.svg")
    assert out.read_bytes() == (tmp_path / "local.svg").read_bytes()
    with gi.connect(server.url) as r:  # every command gave the engine's one client slot back when it ended
        assert r.tokens == s.tokens
