"""Trace format v2: primitives stored, matrices derived on load; v1 files still open; the header is
checked before any tensor is read."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

import gpt_inspector as gi
from gpt_inspector import MaskEdit
from gpt_inspector.core.trace import FORMAT

PROMPT = "She eats an apple. He reads a book."


def _session(lm, n=4, edit=True):
    s = gi.Session(lm, PROMPT, temperature=0.8, seed=3)
    s.run(n)
    if edit:
        s.set_mask_edits([MaskEdit(s.cache_length - 1, 2, layer=1, head=0)])
    return s


def _same_run(tr, s):
    assert tr.tokens == s.tokens and tr.cache_length == s.cache_length and tr.mask_edits == s.mask_edits
    for layer in range(s.n_layers):
        assert tr.softcap(layer) == s.softcap(layer) and tr.scaling(layer) == s.scaling(layer)
        np.testing.assert_array_equal(tr.attention_rows(layer, 0, s.cache_length, "raw"),
                                      s.attention_rows(layer, 0, s.cache_length, "raw"))  # fmt: skip
        for head in range(s.n_heads):
            np.testing.assert_array_equal(tr.allowed(layer, head), s.allowed(layer, head))
            for kind in ("scores", "masked_scores", "probs"):
                np.testing.assert_array_equal(tr.attention(layer, head, kind), s.attention(layer, head, kind))


@pytest.mark.parametrize("family", ["gemma2", "llama"])
def test_v2_stores_primitives_and_derives_the_rest(tiny_lm, tmp_path, family):
    # gemma2: sliding-window mask rows and a soft-cap must survive the file; llama: GQA
    s = _session(tiny_lm(family))
    path = s.save_trace(tmp_path / "t.safetensors")
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        names = set(f.keys())
        assert f.metadata()["format"] == FORMAT
    assert not any(n.endswith(("scores", "probs")) for n in names)  # nothing T x T by default
    assert any(n.endswith("mask_rows") for n in names) == (family == "gemma2")
    _same_run(gi.load_trace(path), s)


def test_reopened_trace_shows_candidate_words_not_ids(tiny_lm, as_trace):
    s = _session(tiny_lm("gpt2"), edit=False)
    tr = as_trace(s)
    for a, b in zip(tr.steps_done, s.steps_done):
        assert [(e.token_id, e.label) for e in a.top] == [(e.token_id, e.label) for e in b.top]
        assert not any(e.label.startswith("#") for e in a.top)
        assert a.label == b.label and a.prob == b.prob and a.entropy == b.entropy


@pytest.mark.parametrize("family", ["gemma2", "gpt2"])
def test_a_reopened_trace_saves_again_as_the_same_run(tiny_lm, as_trace, family):
    # a trace someone sent can be saved again (save_trace is every run source's): nothing is lost
    s = _session(tiny_lm(family))
    tr = as_trace(as_trace(s))
    _same_run(tr, s)
    for a, b in zip(tr.steps_done, s.steps_done):
        assert [(e.token_id, e.label) for e in a.top] == [(e.token_id, e.label) for e in b.top]
        assert a.label == b.label and a.prob == b.prob


def test_derived_matrices_are_opt_in_and_equal_the_accessors(tiny_lm, tmp_path):
    s = _session(tiny_lm("qwen2"))
    plain = s.save_trace(tmp_path / "plain.safetensors")
    full = s.save_trace(tmp_path / "full.safetensors", derived=True)
    assert full.stat().st_size > plain.stat().st_size
    from safetensors.numpy import load_file

    t = load_file(str(full))
    for head in range(s.n_heads):
        np.testing.assert_array_equal(t["layers.1.probs"][head], s.attention(1, head, "probs"))
        np.testing.assert_array_equal(t["layers.0.masked_scores"][head], s.attention(0, head, "masked_scores"))
    _same_run(gi.load_trace(full), s)


def test_a_trace_keeps_the_models_windows_and_older_traces_without_them_open(tiny_lm, tmp_path):
    # gemma2's layer 0 has a 4-key window: the model's own cache holds 3 positions there, the trace every one
    from safetensors import safe_open

    s = _session(tiny_lm("gemma2"), n=6, edit=False)
    path = s.save_trace(tmp_path / "t.safetensors")
    tr = gi.load_trace(path)
    for name in ("kv_cache_bytes", "kv_kept_bytes", "kv_cache_positions"):
        assert [getattr(tr, name)(i) for i in range(s.n_layers)] == [getattr(s, name)(i) for i in range(s.n_layers)]
    assert [tr.kv_cache_positions(i) for i in range(s.n_layers)] == [3, s.cache_length]
    assert tr.kv_cache_bytes() < tr.kv_kept_bytes() == s.kv_kept_bytes()
    with safe_open(str(path), framework="np") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    layout = json.loads(meta["kv_layout"])
    assert [x.pop("keeps", None) for x in layout["layers"]] == [3, None]
    # written before windows were recorded: it opens, and with no window known counts every position
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata={**meta, "kv_layout": json.dumps(layout)})
    old = gi.load_trace(tmp_path / "old.safetensors")
    assert old.kv_cache_bytes() == old.kv_kept_bytes() == s.kv_kept_bytes()
    for bad in (0, -3, 2.5, True, "3"):
        layout["layers"][0]["keeps"] = bad
        save_file(tensors, str(tmp_path / "bad.safetensors"), metadata={**meta, "kv_layout": json.dumps(layout)})
        with pytest.raises(gi.InspectorError, match="kv_layout' is malformed: bad window"):
            gi.load_trace(tmp_path / "bad.safetensors")


def _write_v1(s, path):
    """The v1 layout, as the first build wrote it: the three matrices stored per layer."""
    tensors = {"tokens": np.asarray(s.tokens, dtype=np.int64)}
    for layer in range(s.n_layers):
        q, k, v = s.qkv(layer)
        tensors.update({f"layers.{layer}.q": q, f"layers.{layer}.k": k, f"layers.{layer}.v": v,
                        f"layers.{layer}.attn_out": s.attention_output(layer)})  # fmt: skip
        for kind in ("scores", "masked_scores", "probs"):
            tensors[f"layers.{layer}.{kind}"] = np.stack([s.attention(layer, h, kind) for h in range(s.n_heads)])
    tensors["step_logits"] = np.stack([st.logits.numpy() for st in s.steps_done])
    steps = [{"index": st.index, "position": st.position, "token_id": st.token_id, "forced": st.forced,
              "finish_reason": st.finish_reason} for st in s.steps_done]  # fmt: skip
    lm = s.lm
    meta = {
        "format": "gpt-inspector-trace/1", "model": lm.name, "prompt": s.prompt, "prompt_length": str(len(s.prompt_ids)),
        "decoding": json.dumps(s.decoding.to_json()), "mask_edits": json.dumps([e.to_json() for e in s.mask_edits]),
        "seed": str(s.seed), "text": s.text, "token_labels": json.dumps(s.token_labels()), "steps": json.dumps(steps),
        "scaling": json.dumps([s.scaling(i) for i in range(lm.n_layers)]),
        "softcap": json.dumps([s.softcap(i) for i in range(lm.n_layers)]),
        "shape": json.dumps({"n_layers": lm.n_layers, "n_heads": lm.n_heads, "n_kv_heads": lm.n_kv_heads,
                             "head_dim": lm.head_dim, "context_length": lm.context_length,
                             "vocab_size": lm.vocab_size, "cache_dtype": "float32"}),
        "finished": "",
    }  # fmt: skip
    save_file(tensors, str(path), metadata=meta)
    return path


@pytest.mark.parametrize("family", ["gemma2", "gpt2"])
def test_v1_files_still_open(tiny_lm, tmp_path, family):
    s = _session(tiny_lm(family))
    tr = gi.load_trace(_write_v1(s, tmp_path / "v1.safetensors"))
    _same_run(tr, s)
    assert [st.token_id for st in tr.steps_done] == [st.token_id for st in s.steps_done]


def test_header_is_checked_before_any_tensor_is_read(tmp_path):
    """A tiny file whose header claims a 4 GiB tensor is refused from the header alone."""
    header = {
        "__metadata__": {"format": FORMAT},
        "tokens": {"dtype": "I64", "shape": [1 << 29], "data_offsets": [0, 1 << 32]},
    }
    raw = json.dumps(header).encode()
    path = tmp_path / "bomb.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 64)
    with pytest.raises(gi.InspectorError, match="bomb.safetensors"):
        gi.load_trace(path)
