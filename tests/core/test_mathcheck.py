"""Attention math check: the textbook formula in float64 reproduces what the model computed."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

import gpt_inspector as gi
from gpt_inspector.core.capture import MaskEdit
from gpt_inspector.core.errors import InspectorError
from gpt_inspector.core.mathcheck import FORMULA, check, check_all

FAMILIES = ["gpt2", "llama", "qwen2", "gpt_neox"]
PROMPT = "She eats an apple. He reads a book"


def _session(lm, steps=5, **kw):
    s = gi.Session(lm, PROMPT, temperature=1.0, seed=4, **kw)
    s.run(steps)
    return s


def _corrupt(buf, layer, head, pos, dim, delta):
    # records are inference tensors; they can only be touched inside inference mode
    with torch.inference_mode():
        buf[layer].t[0, head, pos, dim] += delta


@pytest.mark.parametrize("family", FAMILIES)
def test_every_head_and_position_matches(family, tiny_lm):
    s = _session(tiny_lm(family))
    r = check_all(s)
    assert r.ok, r.summary()
    assert r.max_diff.shape == (s.n_layers, s.n_heads)
    assert r.n_positions == s.cache_length
    assert r.max_abs_diff < 1e-5
    assert not r.failures()
    assert "match" in r.summary()
    json.dumps(r.to_json())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_single_check_reads_the_shared_kv_head(family, tiny_lm):
    s = _session(tiny_lm(family))
    lm = s.lm
    head = s.n_heads - 1
    c = check(s, 1, head)  # default: the newest position
    assert c.position == s.cache_length - 1
    assert c.kv_head == lm.kv_head_of(head) and (lm.n_kv_heads == 1 or c.kv_head > 0)
    assert c.ok and c.max_abs_diff < 1e-5
    assert c.weights.shape == (s.cache_length,)
    assert c.weights.sum() == pytest.approx(1.0)
    np.testing.assert_allclose(c.model, s.attention_output(1)[head, c.position], rtol=0, atol=0)
    # the weights are the session's own softmax row, and the output is weights @ V
    np.testing.assert_allclose(c.weights, s.attention(1, head, "probs")[c.position], atol=1e-6)
    _, _, v = s.qkv(1)
    np.testing.assert_allclose(c.recomputed, c.weights @ v[c.kv_head].astype(np.float64), atol=1e-12)
    assert c.formula == FORMULA
    json.dumps(c.to_json())


def test_mask_edits_are_part_of_the_formula(tiny_lm):
    s = _session(tiny_lm("gpt2"))
    s.set_mask_edits([MaskEdit(query=6, key=2, layer=1, head=3), MaskEdit(query=8, key=0)])
    assert check_all(s).ok
    c = check(s, 1, 3, 6)
    assert c.ok and not c.allowed[2] and c.weights[2] == 0.0
    assert c.weights[7:].sum() == 0.0  # causal: nothing after the query
    assert check(s, 0, 1, 8).weights[0] == 0.0


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_corrupted_output_record_is_flagged(family, tiny_lm):
    s = _session(tiny_lm(family))
    p = s.head_output_start + 2  # the recorder keeps head outputs from the prompt's last position on
    _corrupt(s.recorder.out, 1, 2, 2, 0, 1e-3)
    r = check_all(s)
    assert not r.ok
    assert r.failures() == [(1, 2, p, pytest.approx(1e-3, rel=1e-2), pytest.approx(r.tolerance[1, 2]))]
    assert f"layer 1 head 2 position {p}" in r.summary()
    c = check(s, 1, 2, p)
    assert not c.ok and c.worst_dim == 0
    assert check(s, 1, 2, p + 1).ok and check(s, 1, 1, p).ok


def test_corrupted_query_record_is_flagged(tiny_lm):
    s = _session(tiny_lm("qwen2"))
    _corrupt(s.recorder.q, 0, 1, 6, 3, 0.5)
    r = check_all(s)
    assert [f[:3] for f in r.failures()] == [(0, 1, 6)]


def test_nan_is_never_ok(tiny_lm):
    s = _session(tiny_lm("gpt_neox"))
    _corrupt(s.recorder.out, 0, 0, 2, 1, float("nan"))
    p = s.head_output_start + 2
    r = check_all(s, layers=[0])
    assert not r.ok and r.failures()[0][:3] == (0, 0, p)
    assert not check(s, 0, 0, p).ok
    json.dumps(r.to_json())


def test_trace_checks_and_a_tampered_trace_fails(tiny_lm, tmp_path):
    s = _session(tiny_lm("llama"))
    path = s.save_trace(tmp_path / "t.safetensors")
    tr = gi.load_trace(path)
    r = check_all(tr)
    assert r.ok and r.max_abs_diff < 1e-5
    assert check(tr, 1, 3).max_abs_diff == pytest.approx(check(s, 1, 3).max_abs_diff, abs=1e-9)

    with safe_open(str(path), framework="np") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["layers.0.attn_out"][3, 2, 5] += 0.01  # row 2 of the kept rows
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=meta)
    r = check_all(gi.load_trace(bad))
    assert [f[:3] for f in r.failures()] == [(0, 3, tr.head_output_start + 2)]


def test_explicit_tolerance(tiny_lm):
    s = _session(tiny_lm("gpt2"))
    assert not check_all(s, tolerance=1e-12).ok  # float32 rounding is visible at this scale
    assert check(s, 0, 0, tolerance=1.0).tolerance == 1.0
    assert check_all(s, layers=1).layers == [1]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda s: check(s, 2, 0), "layer must be"),
        (lambda s: check(s, 0, 4), "head must be"),
        (lambda s: check(s, 0, 0, 99), "position must be"),
        (lambda s: check(s, 0, 0, -1), "position must be"),
        (lambda s: check(s, 0, 0, tolerance=-1), "tolerance"),
        (lambda s: check_all(s, layers=[]), "no layers"),
        (lambda s: check_all(s, layers=[True]), "layer must be"),
    ],
)
def test_bad_input(call, message, tiny_lm):
    s = _session(tiny_lm("gpt2"), steps=1)
    with pytest.raises(InspectorError, match=message):
        call(s)


def test_nothing_processed(tiny_lm):
    with pytest.raises(InspectorError, match="run a step"):
        check_all(gi.Session(tiny_lm("gpt2"), "She"))


@pytest.mark.parametrize("what", ["q", "k", "v", "attn_out", "all"])
@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_non_finite_trace_is_a_mismatch_on_both_paths(tiny_lm, tmp_path, what, value):
    """A trace whose q/k/v are +inf once said "all match": inf == inf hid the broken equation."""
    s = _session(tiny_lm("gpt2"), steps=2)
    path = s.save_trace(tmp_path / "t.safetensors")
    with safe_open(str(path), framework="np") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    names = ["q", "k", "v", "attn_out"] if what == "all" else [what]
    for n in names:
        tensors[f"layers.1.{n}"][...] = value
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=meta)
    tr = gi.load_trace(bad)
    r = check_all(tr)
    assert not r.ok and "exceed" in r.summary()
    assert check_all(tr, layers=[0]).ok  # the untouched layer still matches
    for head in range(tr.n_heads):
        assert not r.max_diff[1, head] <= r.tolerance[1, head]
        for pos in range(tr.head_outputs_from, tr.cache_length):
            single = check(tr, 1, head, pos)
            assert not single.ok, single.summary()
    assert json.loads(json.dumps(check(tr, 1, 0).to_json()))["ok"] is False


def test_single_head_and_report_agree_cell_by_cell_on_a_partial_inf(tiny_lm, tmp_path):
    s = _session(tiny_lm("llama"), steps=3)
    path = s.save_trace(tmp_path / "t.safetensors")
    with safe_open(str(path), framework="np") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["layers.0.k"][1, 4, 0] = np.inf  # KV head 1 at key 4: read by query heads 2 and 3 from position 4 on
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=meta)
    tr = gi.load_trace(bad)
    r = check_all(tr, layers=[0])
    for head in range(tr.n_heads):
        start = tr.head_outputs_from  # a trace holds head outputs from the prompt's last position on
        assert start > 4
        singles = [check(tr, 0, head, p).ok for p in range(start, tr.cache_length)]
        assert all(singles) == bool(r.max_diff[0, head] <= r.tolerance[0, head])
        if tr.kv_head_of(head) == 1:
            assert not any(singles)


def test_a_trace_checks_from_the_prompts_last_position_and_says_so(tiny_lm, as_trace):
    """A trace keeps head outputs where steps decide tokens; earlier rows are refused, not made up."""
    s = _session(tiny_lm("gpt2"), steps=3)
    tr = as_trace(s)
    start = len(s.prompt_ids) - 1
    assert tr.head_outputs_from == tr.head_output_start == start and s.head_outputs_from == 0
    r = check_all(tr)
    assert r.ok and r.first_position == start and r.n_positions == tr.cache_length - start
    assert f"from position {start}" in r.summary()
    with pytest.raises(InspectorError, match=f"position 0 is not kept .*from position {start}"):
        check(tr, 0, 0, 0)
    assert np.isnan(tr.attention_output(0)[:, :start]).all()
    np.testing.assert_array_equal(tr.attention_output(0)[:, start:], s.attention_output(0)[:, start:])


def test_a_sessions_earlier_prompt_rows_follow_its_edits(tiny_lm):
    """The rows the recorder does not keep are recomputed under the edits in force, and again after a change."""
    s = _session(tiny_lm("llama"), steps=2)
    clean = s.attention_output(0)[:, :4].copy()
    s.set_mask_edits([MaskEdit(3, 1, layer=0, head=2)])
    edited = s.attention_output(0)
    assert not np.allclose(edited[2, 3], clean[2, 3]) and np.array_equal(edited[1, :4], clean[1])
    assert check_all(s).ok
    s.set_mask_edits([])
    np.testing.assert_array_equal(s.attention_output(0)[:, :4], clean)
