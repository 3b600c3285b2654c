"""Cache privacy probe: the prompt comes back out of the KV cache, given nothing but the cache."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import gpt_inspector as gi
from gpt_inspector.core import probe as probe_mod
from gpt_inspector.core import probe_direct
from gpt_inspector.core.capture import MaskEdit
from gpt_inspector.core.errors import InspectorError
from gpt_inspector.core.probe import probe_cache, probe_session

FAMILIES = ["gpt2", "llama", "qwen2", "gpt_neox"]
PROMPT = "The cat sat on the mat. One two three"
DEMO = Path(__file__).resolve().parents[2] / "resources" / "demo-gpt2"


@pytest.fixture(scope="module")
def sessions(tiny_lm):
    cache = {}

    def get(family):
        if family not in cache:
            s = gi.Session(tiny_lm(family), PROMPT, temperature=1.0, seed=2)  # sampling: varied generated tokens
            s.run(4)
            cache[family] = s
        return cache[family]

    return get


def _kv(s, layers=None):
    """The session's cache as plain numpy, as an attacker holding a dump would have it."""
    out = {}
    for layer in range(s.n_layers) if layers is None else layers:
        _, k, v = s.qkv(layer)
        out[layer] = (k, v)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_layer0_recovers_every_cached_token(family, sessions):
    s = sessions(family)
    r = probe_session(s)
    lp = r.layer(0)
    assert lp.method == "direct"
    assert lp.n_positions == s.cache_length
    assert lp.tokens == s.processed_tokens
    assert lp.n_recovered == lp.n_exact == s.cache_length
    assert r.all_recovered and r.n_recovered == s.cache_length
    for p in lp.positions:
        assert p.correct and p.exact
        assert p.distance < 1e-5
        assert p.margin > 0.05  # the runner-up is nowhere near: the recovery is unambiguous
        assert p.runner_up_id != p.token_id
    assert r.texts[0] == s.lm.tokenizer.decode(s.processed_tokens)
    json.dumps(r.to_json())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_probe_cache_uses_only_the_cache(family, sessions):
    s = sessions(family)
    # numpy dump without tokens: judged by exact match alone
    r = probe_cache(s.lm, _kv(s, [0]))
    lp = r.layer(0)
    assert r.true_tokens is None and all(p.correct is None for p in lp.positions)
    assert lp.tokens == s.processed_tokens and lp.n_recovered == s.cache_length
    # the transformers cache object itself, and a per-layer list with a batch dimension
    assert probe_cache(s.lm, s.cache).layer(0).tokens == s.processed_tokens
    k, v = (torch.from_numpy(a)[None] for a in _kv(s, [0])[0])
    assert probe_cache(s.lm, [(k, v)]).layer(0).tokens == s.processed_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_deeper_layer_with_cached_prefix(family, sessions):
    s = sessions(family)
    r = probe_session(s, layers=(0, 1))
    lp = r.layer(1)
    assert lp.method == "cache"
    assert lp.tokens == s.processed_tokens
    assert lp.n_exact == s.cache_length
    assert max(p.distance for p in lp.positions) < 1e-5


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_deeper_layer_greedy_from_that_layer_alone(family, sessions):
    s = sessions(family)
    r = probe_cache(s.lm, _kv(s, [1]), layers=[1], true_tokens=s.processed_tokens)
    lp = r.layer(1)
    assert lp.method == "greedy"  # layer 0 was not given: the prefix comes from recovered tokens
    assert lp.n_recovered == s.cache_length and lp.n_exact == s.cache_length


def test_greedy_forced_even_with_lower_layers(sessions):
    s = sessions("qwen2")
    lp = probe_session(s, layers=1, context="greedy").layer(1)
    assert lp.method == "greedy" and lp.tokens == s.processed_tokens


def test_deeper_layer_respects_mask_edits(tiny_lm):
    lm = tiny_lm("gpt2")
    s = gi.Session(lm, PROMPT)
    s.run(2)
    s.set_mask_edits([MaskEdit(query=5, key=1, layer=0), MaskEdit(query=7, key=0)])
    lp = probe_session(s, layers=(1,)).layer(1)
    # the cached layer-1 keys at 5 and 7 were computed under the edits; candidates must be too
    assert lp.n_exact == s.cache_length
    assert lp.tokens == s.processed_tokens


def test_chunking_over_vocabulary_and_positions(sessions, monkeypatch):
    s = sessions("llama")
    ref = probe_session(s, layers=(0, 1))
    monkeypatch.setattr(probe_mod, "_ROWS", 50)  # 320 tokens -> 7 vocabulary chunks, one position each
    calls = []
    small = probe_session(s, layers=(0,), progress=lambda done, total: calls.append((done, total)))
    assert small.layer(0).tokens == ref.layer(0).tokens
    n = s.cache_length
    # one vocabulary pass (7 chunks) serves every position; then a ranking and a check per position
    assert len(calls) == 7 + 2 * n and calls[-1] == (len(calls), len(calls))
    monkeypatch.setattr(probe_mod, "_ROWS", 100)
    monkeypatch.setattr(probe_mod, "_PREFIX_BYTES", 100_000)  # deeper layer: chunks shrink as the prefix grows
    calls.clear()
    short = probe_cache(s.lm, _kv(s), layers=(1,), true_tokens=s.processed_tokens, progress=lambda *a: calls.append(a))
    assert calls[-1][0] == calls[-1][1] == len(calls) > 2 * n  # several chunks per position, counted exactly
    assert short.layer(1).tokens == ref.layer(1).tokens
    for a, b in zip(short.layer(1).positions, ref.layer(1).positions):
        assert a.runner_up_id == b.runner_up_id
        assert a.margin == pytest.approx(b.margin, abs=1e-5)


def test_progress_callback_can_abort(sessions):
    s = sessions("gpt2")

    def stop(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        probe_session(s, progress=stop)


def test_tampered_position_is_not_exact(sessions):
    s = sessions("gpt_neox")
    kv = _kv(s, [0])
    k, v = (a.copy() for a in kv[0])
    rng = np.random.default_rng(0)
    k[:, 3] = rng.normal(size=k[:, 3].shape)  # noise instead of a token's key at position 3
    r = probe_cache(s.lm, {0: (k, v)}, true_tokens=s.processed_tokens)
    lp = r.layer(0)
    assert not lp.positions[3].exact
    assert lp.positions[3].distance > 0.1
    assert all(p.exact and p.correct for i, p in enumerate(lp.positions) if i != 3)
    assert lp.n_exact == s.cache_length - 1


def test_half_precision_cache(tiny_dir):
    lm = gi.load_model(tiny_dir["llama"], device="cpu", dtype="bfloat16")
    s = gi.Session(lm, PROMPT)
    s.run(1)
    lp = probe_session(s).layer(0)
    assert lp.tolerance > 1e-3  # a looser default: half types round every element
    assert lp.tokens == s.processed_tokens and lp.n_exact == s.cache_length


@pytest.mark.parametrize(
    "kv, layers, kw, message",
    [
        ({}, (0,), {}, "empty"),
        ({0: (np.zeros((3, 3, 8), np.float32), np.zeros((3, 3, 8), np.float32))}, (0,), {}, "do not fit"),
        ({0: (np.zeros((2, 3, 8, 8), np.float32),) * 2}, (0,), {}, "batch size 2"),
        ({0: (np.zeros((2, 3), np.float32),) * 2}, (0,), {}, "must be (kv_heads"),
        ({0: (np.zeros((2, 3, 8), np.int64),) * 2}, (0,), {}, "must hold floats"),
        ({0: "nope"}, (0,), {}, "(keys, values) pair"),
        ({7: None}, (0,), {}, "cache layer must be"),
        ("not a cache", (0,), {}, "must be a cache"),
        (None, (1,), {}, "not in the given cache"),
        (None, (2,), {}, "probe layer must be"),
        (None, (), {}, "no layers"),
        (None, (0,), {"context": "psychic"}, "unknown context"),
        (None, (0,), {"tolerance": 0}, "tolerance must be positive"),
        (None, (0,), {"true_tokens": [1, 2]}, "true tokens"),
    ],
)
def test_bad_input_is_an_inspector_error(kv, layers, kw, message, sessions):
    s = sessions("llama")
    if kv is None:
        kv = _kv(s, [0])
    with pytest.raises(InspectorError, match=re.escape(message)):
        probe_cache(s.lm, kv, layers, **kw)


def test_cache_context_needs_lower_layers(sessions):
    s = sessions("llama")
    with pytest.raises(InspectorError, match="needs layers"):
        probe_cache(s.lm, _kv(s, [1]), layers=[1], context="cache")


def test_mismatched_layer_lengths(sessions):
    s = sessions("llama")
    kv = _kv(s)
    kv[1] = (kv[1][0][:, :-1], kv[1][1][:, :-1])
    with pytest.raises(InspectorError, match="positions"):
        probe_cache(s.lm, kv)


def test_session_without_steps(tiny_lm):
    with pytest.raises(InspectorError, match="run a step"):
        probe_session(gi.Session(tiny_lm("gpt2"), "She eats"))


@pytest.mark.skipif(not (DEMO / "model.safetensors").is_file(), reason="demo model not trained yet")
def test_demo_model_gives_its_prompt_away():
    lm = gi.load_model(DEMO, device="cpu")
    s = gi.Session(lm, "She eats apple pie with her friend. Then they walk home")
    s.run(3)
    r = probe_session(s)
    assert r.layer(0).tokens == s.processed_tokens
    assert r.layer(0).n_exact == s.cache_length


def test_a_beam_and_a_trace_are_probed_or_refused_in_one_line(tiny_lm, tmp_path):
    # Tools ▸ Probe with an inspected beam on screen raised AttributeError ('BeamView' has no 'cache'); a beam is
    # probed through the K/V its path recorded, and a trace (no model to replay candidates) says why not
    from gpt_inspector.core.beams import BeamSearch

    lm = tiny_lm("llama")
    bs = BeamSearch(lm, PROMPT, num_beams=2, num_return_sequences=2, max_new_tokens=3)
    bs.run()
    view = bs.result_view(1)
    got = probe_session(view, layers=[0, 1])
    assert got.true_tokens == view.processed_tokens and got.all_recovered
    assert [p.token_id for p in got.layers[0].positions] == view.processed_tokens  # each position its own token
    s = gi.Session(lm, PROMPT)
    s.run(2)
    s.save_trace(tmp_path / "t.safetensors")
    with pytest.raises(InspectorError, match="a trace file has no model") as e:
        probe_session(gi.load_trace(tmp_path / "t.safetensors"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family, shared", [("gpt2", True), ("llama", True), ("qwen2", True), ("gpt_neox", True),
                                            ("gemma2", True)])  # fmt: skip
def test_shared_search_equals_the_reference(family, shared, tiny_lm, monkeypatch):
    # the shared layer-0 search (one vocabulary pass, ranked then verified) against the reference
    # (the whole vocabulary at every position), on a clean cache and one with two positions replaced
    # by noise, where the nearest candidates are not the token and the verification has to work
    s = gi.Session(tiny_lm(family), PROMPT, temperature=1.0, seed=3)
    s.run(3)
    kv = _kv(s, [0])
    k, v = (a.copy() for a in kv[0])
    rng = np.random.default_rng(1)
    for pos in (2, 6):
        k[:, pos] += rng.normal(size=k[:, pos].shape) * np.abs(k[:, pos]).mean()
        v[:, pos] += rng.normal(size=v[:, pos].shape) * np.abs(v[:, pos]).mean()
    monkeypatch.setattr(probe_direct, "_POSITIONS", 3)  # GPT-2's ranking in several blocks of positions
    used = []
    real = probe_mod.position_map
    monkeypatch.setattr(probe_mod, "position_map", lambda *a: used.append(real(*a)) or used[-1])
    got = [probe_cache(s.lm, c, true_tokens=s.processed_tokens).layer(0) for c in (kv, {0: (k, v)})]
    assert [u is not None for u in used] == [shared, shared]  # every family here shares one vocabulary pass
    monkeypatch.setattr(probe_mod, "position_map", lambda *a: None)
    ref = [probe_cache(s.lm, c, true_tokens=s.processed_tokens).layer(0) for c in (kv, {0: (k, v)})]
    for g, r in zip(got, ref):
        assert [p.token_id for p in g.positions] == [p.token_id for p in r.positions]
        assert [p.runner_up_id for p in g.positions] == [p.runner_up_id for p in r.positions]
        assert [p.exact for p in g.positions] == [p.exact for p in r.positions]
        for a, b in zip(g.positions, r.positions):
            assert a.distance == pytest.approx(b.distance, rel=1e-5, abs=1e-6)
            assert a.runner_up_distance == pytest.approx(b.runner_up_distance, rel=1e-5, abs=1e-6)
    assert not ref[1].positions[2].exact and not ref[1].positions[6].exact  # the noise did displace them
