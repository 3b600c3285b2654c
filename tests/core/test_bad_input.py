"""Every bad value is a clear InspectorError, and the session stays usable afterwards."""

from __future__ import annotations

import math

import pytest

import gpt_inspector as gi
from gpt_inspector.core import MaskEdit

SESSION_ARGS = [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature=1e-39), "at least 1e-30"),
    (dict(temperature=5e-324), "at least 1e-30"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=math.nan), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(seed="x"), "seed"),
]


@pytest.mark.parametrize("kwargs,word", SESSION_ARGS)
def test_bad_session_arguments(tiny_lm, kwargs, word):
    with pytest.raises(gi.InspectorError, match=word):
        gi.Session(tiny_lm("gpt2"), "hi", **kwargs)


def test_prompt_longer_than_context(tiny_lm):
    with pytest.raises(gi.InspectorError, match="context"):
        gi.Session(tiny_lm("gpt2"), prompt_ids=[3] * 64)


def test_empty_prompt_without_bos(tiny_lm, monkeypatch):
    lm = tiny_lm("gpt2")
    monkeypatch.setattr(lm, "bos_token_id", None)
    with pytest.raises(gi.InspectorError, match="empty prompt"):
        gi.Session(lm, "")


CALLS = [
    (lambda s: s.run(0), "steps"),
    (lambda s: s.run(-3), "steps"),
    (lambda s: s.attention(9, 0), "layer"),
    (lambda s: s.attention(0, 4), "head"),
    (lambda s: s.attention(-1, 0), "layer"),
    (lambda s: s.attention(0, 0, "softmax!"), "kind"),
    (lambda s: s.qkv(2), "layer"),
    (lambda s: s.set_temperature(-0.5), "temperature"),
    (lambda s: s.set_temperature(1e-39), "at least 1e-30"),
    (lambda s: s.set_decoding(1e-40, None, None), "at least 1e-30"),
    (lambda s: s.set_top_p(2.0), "top_p"),
    (lambda s: s.set_top_k(0), "top_k"),
    (lambda s: s.force_token(10**9), "token id"),
    (lambda s: s.force_token(-1), "token id"),
    (lambda s: s.set_mask_edits([MaskEdit(1, 4)]), "future"),
    (lambda s: s.set_mask_edits([MaskEdit(1, 0, head=7)]), "head"),
    (lambda s: s.set_mask_edits(["block"]), "MaskEdit"),
]


@pytest.mark.parametrize("call,word", CALLS)
def test_bad_calls_leave_session_usable(tiny_lm, call, word):
    s = gi.Session(tiny_lm("gpt2"), "She eats", temperature=1.0, seed=1)
    s.run(2)
    tokens, dec = list(s.tokens), s.decoding
    with pytest.raises(gi.InspectorError, match=word):
        call(s)
    assert s.tokens == tokens and s.decoding == dec
    s.step()
    assert s.n_steps == 3


def test_nothing_to_step_back_or_read(tiny_lm):
    s = gi.Session(tiny_lm("gpt2"), "hi")
    with pytest.raises(gi.InspectorError, match="nothing to step back"):
        s.step_back()
    with pytest.raises(gi.InspectorError, match="run a step"):
        s.attention(0, 0)
    with pytest.raises(gi.InspectorError, match="run a step"):
        s.force_token(1)


def test_fault_inside_step_keeps_last_good_step(tiny_lm, monkeypatch):
    lm = tiny_lm("llama")
    s = gi.Session(lm, "She eats")
    s.run(3)
    snapshot = (list(s.tokens), s.cache_length, s.kv_cache_bytes(), s.attention(1, 2).copy())
    layer = lm.model.model.layers[1].mlp
    orig = layer.forward

    def boom(*a, **k):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(layer, "forward", boom)
    with pytest.raises(gi.StepFailed, match="out of memory.*--device cpu"):
        s.step()
    monkeypatch.setattr(layer, "forward", orig)
    assert (s.tokens, s.cache_length, s.kv_cache_bytes()) == snapshot[:3]
    assert (s.attention(1, 2) == snapshot[3]).all()
    s.step()  # and it goes on
    assert s.n_steps == 4


def test_corrupt_and_foreign_trace_files(tiny_lm, tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    s = gi.Session(tiny_lm("gpt2"), "She eats")
    s.run(2)
    good = s.save_trace(tmp_path / "good.safetensors").read_bytes()
    cases = {
        "truncated": good[: len(good) // 2],
        "garbage": b"\x00\x01not a safetensors file at all",
        "empty": b"",
        "header_only": good[:8],
    }
    for name, data in cases.items():
        p = tmp_path / f"{name}.safetensors"
        p.write_bytes(data)
        with pytest.raises(gi.InspectorError):
            gi.load_trace(p)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"weight": np.zeros(3, np.float32)}, str(foreign), metadata={"format": "pt"})
    with pytest.raises(gi.InspectorError, match="not a gpt-inspector trace"):
        gi.load_trace(foreign)
    with pytest.raises(gi.InspectorError, match="no trace file"):
        gi.load_trace(tmp_path / "missing.safetensors")


def test_the_smallest_temperature_samples_the_greedy_tokens(tiny_lm):
    # at the floor logits / t is still finite in float32: a sample is the argmax, never NaN
    lm = tiny_lm("gpt2")
    greedy = gi.Session(lm, "She eats")
    greedy.run(6)
    cold = gi.Session(lm, "She eats", temperature=1e-30, seed=3)
    steps = cold.run(6)
    assert cold.tokens == greedy.tokens
    assert all(bool(st.probs.isfinite().all()) for st in steps)
