"""Faults, untrusted files and long sessions: errors cost a message, never the session."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpt_inspector as gi
from gpt_inspector.core import MaskEdit


def test_recipe_replays_same_tokens_through_every_kind_of_change(tiny_lm):
    lm = tiny_lm("llama")
    s = gi.Session(lm, "She eats an apple", temperature=1.2, top_k=40, seed=11)
    s.run(3)
    s.set_temperature(0.7)
    s.run(2)
    s.step_back()
    s.force_token(7)
    s.set_mask_edits([MaskEdit(s.cache_length - 1, 0, layer=1)])
    s.run(2)
    s.set_decoding(top_p=0.8, redecide=True)
    s.run(2)
    recipe = json.loads(json.dumps(s.recipe()))  # survives JSON, as the autosave file does
    r = gi.Session.replay(lm, recipe)
    assert r.tokens == s.tokens and r.mask_edits == s.mask_edits and r.decoding == s.decoding
    np.testing.assert_array_equal(r.current.logits.numpy(), s.current.logits.numpy())
    with pytest.raises(gi.InspectorError, match="recipe"):
        gi.Session.replay(lm, {"format": "nope"})
    bad = dict(recipe, ops=[{"op": "explode"}])
    with pytest.raises(gi.InspectorError, match="unknown recipe operation"):
        gi.Session.replay(lm, bad)


def test_step_back_cancels_step_in_recipe(tiny_lm):
    s = gi.Session(tiny_lm("gpt2"), "hi")
    for _ in range(50):
        s.step()
        s.step_back()
    s.step()
    assert s.recipe()["ops"] == [{"op": "step"}]


def test_fault_during_mask_recompute_restores_everything(tiny_lm, monkeypatch):
    lm = tiny_lm("gpt2")
    s = gi.Session(lm, "She eats an apple")
    s.run(4)
    before = (list(s.tokens), s.cache_length, s.current.probs.clone(), s.attention(1, 1).copy())
    calls = {"n": 0}
    mlp = lm.model.transformer.h[1].mlp
    orig = mlp.forward

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated fault")
        return orig(*a, **k)

    monkeypatch.setattr(mlp, "forward", flaky)
    with pytest.raises(gi.StepFailed, match="simulated fault"):
        s.set_mask_edits([MaskEdit(3, 1)])
    monkeypatch.setattr(mlp, "forward", orig)
    assert s.mask_edits == [] and s.tokens == before[0] and s.cache_length == before[1]
    np.testing.assert_allclose(s.current.probs.numpy(), before[2].numpy())
    np.testing.assert_allclose(s.attention(1, 1), before[3], atol=1e-6)
    s.step()


@pytest.fixture(scope="module")
def good_trace(tiny_lm, tmp_path_factory):
    s = gi.Session(tiny_lm("gpt2"), "She eats")
    s.run(2)
    return s.save_trace(tmp_path_factory.mktemp("fuzz") / "good.safetensors").read_bytes()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_trace_loader_raises_only_our_error(good_trace, tmp_path_factory, data):
    blob = bytearray(good_trace)
    how = data.draw(st.sampled_from(["flip", "truncate", "header", "splice"]))
    hlen = int.from_bytes(blob[:8], "little")
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(blob) - 1))
            blob[i] = data.draw(st.integers(0, 255))
    elif how == "truncate":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    elif how == "header":  # mutate inside the JSON header, where shapes and metadata live
        i = data.draw(st.integers(8, 8 + hlen - 1))
        blob[i] = data.draw(st.sampled_from(list(b'0123456789{}[]",:-ae ')))
    else:
        junk = data.draw(st.binary(min_size=1, max_size=64))
        i = data.draw(st.integers(0, len(blob)))
        blob = blob[:i] + junk + blob[i:]
    path = tmp_path_factory.mktemp("f") / "x.safetensors"
    path.write_bytes(bytes(blob))
    try:
        tr = gi.load_trace(path)
    except gi.InspectorError:
        return
    # whatever loads must be self-consistent enough to show
    for layer in range(tr.n_layers):
        tr.qkv(layer)
        for head in range(tr.n_heads):
            tr.attention(layer, head, "probs")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(["shape", "steps", "token_labels", "scaling", "decoding", "mask_edits", "seed", "prompt_length"]),
       value=st.one_of(st.text(max_size=30), st.integers().map(str), st.just("{}"), st.just("[]"), st.just("null"),
                       st.just('{"n_layers": -1}'), st.just("[1e309]")))  # fmt: skip
def test_fuzz_trace_metadata(good_trace, tmp_path_factory, key, value):
    from safetensors import safe_open
    from safetensors.numpy import save_file

    src = tmp_path_factory.mktemp("m") / "good.safetensors"
    src.write_bytes(good_trace)
    with safe_open(str(src), "np") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta[key] = value
    dst = src.with_name("bad.safetensors")
    save_file(tensors, str(dst), metadata=meta)
    try:
        gi.load_trace(dst)
    except gi.InspectorError:
        pass


WRONG_VALUES = ['["x"]', "5", "1e400", str(10**30), "-1", '{"a": 1}', '"x"', "null", "[[[[[]]]]]", "[1, 2, 3]", "",
                "true", '[{"query": 10000000000000000000, "key": 0, "blocked": true}]',
                '[{"layer": 0, "head": 0, "patch_from": [-5]}]']  # fmt: skip


def test_every_metadata_field_with_every_wrong_type_is_refused_or_readable(good_trace, tmp_path):
    """Each field of a trace's metadata, replaced by each value of a wrong type or range: either our one
    refusal, or a trace every reader can read (a list where a string belongs and a mask edit at a
    position past 2^63 reached the window as TypeError and "Overflow when unpacking long")."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    src = tmp_path / "good.safetensors"
    src.write_bytes(good_trace)
    with safe_open(str(src), "np") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    refused = 0
    for key in meta:
        for value in WRONG_VALUES:
            dst = tmp_path / "bad.safetensors"
            save_file(tensors, str(dst), metadata={**meta, key: value})
            try:
                tr = gi.load_trace(dst)
            except gi.InspectorError as e:
                assert "\n" not in str(e)
                refused += 1
                continue
            tr.token_labels, tr.steps_done, tr.text, tr.prompt, tr.decoding, tr.kv_cache_bytes, tr.label(0)
            for layer in tr.attention_layers:
                tr.qkv(layer)
                for head in range(tr.n_heads):
                    tr.attention(layer, head, "probs")
    assert refused > len(meta) * 5  # most of them are refused, not read around


def _rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_soak_2000_step_back_cycles_memory_flat(tiny_lm, record_property):
    s = gi.Session(tiny_lm("llama"), "She eats an apple", temperature=1.0, seed=0)
    s.run(5)
    for _ in range(200):  # warm-up: allocator pools settle
        s.step()
        s.step_back()
    start = _rss_mib()
    for _ in range(2000):
        s.step()
        s.step_back()
    grown = _rss_mib() - start
    record_property("rss_growth_mib", round(grown, 2))
    print(f"soak: 2000 step/step-back cycles, RSS {start:.1f} MiB -> {start + grown:.1f} MiB ({grown:+.2f} MiB)")
    assert s.n_steps == 5 and len(s.recipe()["ops"]) == 5
    assert grown < 8, f"RSS grew {grown:.1f} MiB over 2000 cycles"


def test_fault_inside_a_beam_step_keeps_the_search_at_its_last_good_step(tiny_lm, hf_sdpa, monkeypatch):
    import torch

    from gpt_inspector.core.beams import BeamSearch

    lm = tiny_lm("gpt2")
    ids = list(lm.tokenizer("She eats an apple")["input_ids"])
    b = BeamSearch(lm, prompt_ids=ids, num_beams=3, num_return_sequences=2, max_new_tokens=6)
    b.step()
    b.step()
    before = (b.cache_length, b.beams, b.n_steps)
    mlp = lm.model.transformer.h[0].mlp
    orig = mlp.forward
    monkeypatch.setattr(mlp, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("CUDA out of memory")))
    with pytest.raises(gi.StepFailed, match="fewer beams"):
        b.step()
    monkeypatch.setattr(mlp, "forward", orig)
    assert (b.cache_length, b.beams, b.n_steps) == before
    b.run()
    with torch.no_grad():
        ref = hf_sdpa("gpt2").generate(torch.tensor([ids]), do_sample=False, num_beams=3, num_return_sequences=2,
                                       max_new_tokens=6, output_scores=True, return_dict_in_generate=True)  # fmt: skip
    assert b.result().sequences == ref.sequences.tolist()


_HOSTILE = r"""
import json, resource, struct, sys
import gpt_inspector as gi

path, claim_gib = sys.argv[1], float(sys.argv[2])
# a header consistent with its own metadata: one step whose logits claim ``claim_gib`` GiB
V = 1 << 24
n_steps = max(1, int(claim_gib * 2**30 / (V * 4)))
L, H, d, P = 1, 1, 8, 1
T = P + n_steps - 1
n_tok = P + n_steps
tensors = {"tokens": ("I64", [n_tok])}
for n in ("q", "k", "v", "attn_out"):
    tensors[f"layers.0.{n}"] = ("F32", [H, T, d])
tensors["step_logits"] = ("F32", [n_steps, V])
meta = {
    "format": "gpt-inspector-trace/2", "model": "m", "prompt": "p", "text": "t", "seed": "0",
    "prompt_length": str(P),
    "shape": json.dumps(dict(n_layers=L, n_heads=H, n_kv_heads=H, head_dim=d, context_length=n_tok, vocab_size=V)),
    "decoding": json.dumps({"temperature": 0.0, "top_k": None, "top_p": None}), "mask_edits": "[]",
    "token_labels": json.dumps(["x"] * n_tok), "scaling": "[1.0]",
    "steps": json.dumps([{"index": i, "position": i, "token_id": 0, "forced": False, "top": []} for i in range(n_steps)]),
}
header, off = {"__metadata__": meta}, 0
for k, (dt, shape) in tensors.items():
    n = 8 if dt == "I64" else 4
    for s in shape:
        n *= s
    header[k] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
    off += n
blob = json.dumps(header).encode()
blob += b" " * (-len(blob) % 8)
with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)) + blob)
    f.truncate(8 + len(blob) + off)  # the data region is a hole: claimed, never written
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    gi.load_trace(path)
    print("LOADED")
except gi.InspectorError as e:
    print("REFUSED", e)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print("GROWTH_KIB", peak - base)
"""


@pytest.mark.parametrize("claim_gib", [4.0, 1024.0])
def test_hostile_sparse_trace_is_refused_without_reading(tmp_path, claim_gib):
    """A consistent header claiming GiB over a hole: refused before any tensor is read (peak RSS)."""
    import subprocess
    import sys

    script = tmp_path / "hostile.py"
    script.write_text(_HOSTILE)
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(gi.__file__).resolve().parents[1]))  # this checkout, not another
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "big.safetensors"), str(claim_gib)],
                         capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "REFUSED" in out.stdout, out.stdout
    assert "sparse" in out.stdout or "memory" in out.stdout
    growth_kib = int(out.stdout.split("GROWTH_KIB")[1])
    assert growth_kib < 100 * 1024, f"peak RSS grew {growth_kib / 1024:.0f} MiB while refusing"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(["shape", "steps", "token_labels", "scaling", "decoding", "mask_edits", "softcap"]),
       depth=st.sampled_from([1, 50, 900, 5000, 100_000]), opener=st.sampled_from(["[", '{"a":']))  # fmt: skip
def test_fuzz_deeply_nested_metadata_raises_only_our_error(good_trace, tmp_path_factory, key, depth, opener):
    from safetensors import safe_open
    from safetensors.numpy import save_file

    src = tmp_path_factory.mktemp("n") / "good.safetensors"
    src.write_bytes(good_trace)
    with safe_open(str(src), "np") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    closer = "]" if opener == "[" else "}"
    meta[key] = opener * depth + "1" + closer * depth
    dst = src.with_name("nested.safetensors")
    save_file(tensors, str(dst), metadata=meta)
    try:  # a shallow value may be harmless (unknown decoding keys are ignored); anything else is ours
        gi.load_trace(dst)
    except gi.InspectorError:
        pass


def test_deeply_nested_safetensors_header_raises_only_our_error(tmp_path):
    import struct

    for depth in (200, 100_000):
        body = b'{"__metadata__":{"format":"gpt-inspector-trace/2"},"x":' + b"[" * depth + b"]" * depth + b"}"
        p = tmp_path / f"deep{depth}.safetensors"
        p.write_bytes(struct.pack("<Q", len(body)) + body)
        with pytest.raises(gi.InspectorError):
            gi.load_trace(p)
