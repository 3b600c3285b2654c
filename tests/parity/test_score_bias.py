"""Additive score biases: the shown scores are the model's own, bias included, per bias form.

For each form the test writes the equation out by hand (q·kᵀ × scaling + the family's bias, from
the family's published definition) and compares it with what the inspector shows, then checks
that the bias survives a trace, that the math check counts it, and that beams carry their own.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import tiny_families
import tiny_models
import torch
import torch.nn.functional as F

import gpt_inspector as gi
from gpt_inspector.core import mathcheck
from gpt_inspector.core.models import from_model

PROMPT = "She eats an apple. He reads"
STEPS = 6


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_models.build_tokenizer(tmp_path_factory.mktemp("bias_tok"))


@pytest.fixture(scope="module")
def run(tokenizer):
    """family -> (a session stepped STEPS times through the inspector, the eager reference model)."""
    cache = {}

    def get(family):
        if family not in cache:
            model = tiny_families.build_model(family, tokenizer.convert_tokens_to_ids("<|endoftext|>"))
            ref = copy.deepcopy(model).eval()
            s = gi.Session(from_model(model, tokenizer, family), PROMPT)
            s.run(STEPS)
            cache[family] = (s, ref)
        return cache[family]

    return get


def _alibi_slopes(n_heads: int) -> torch.Tensor:
    # the ALiBi paper's slopes for a power-of-two head count: 2^(-8/H), 2^(-16/H), ...
    return 2.0 ** (-8.0 * torch.arange(1, n_heads + 1, dtype=torch.float64) / n_heads)  # (H,)


def _by_hand(s, layer: int, bias: torch.Tensor) -> torch.Tensor:
    """q·kᵀ × scaling + bias, in float64, every head: (H, T, T)."""
    q, k, _ = (torch.from_numpy(x).double() for x in s.qkv(layer))  # (H, T, d), (Hkv, T, d)
    k = k.repeat_interleave(s.n_heads // s.n_kv_heads, dim=0)  # (H, T, d)
    return q @ k.transpose(-1, -2) * s.scaling(layer) + bias  # (H, T, T)


def _shown(s, layer: int, kind: str) -> torch.Tensor:
    return torch.from_numpy(np.stack([s.attention(layer, h, kind) for h in range(s.n_heads)])).double()


def _tol(x: torch.Tensor) -> float:
    return 2e-5 * max(1.0, float(x.abs().max()))


def test_bloom_scores_are_qk_scaled_plus_slope_times_key_position(run):
    s, _ = run("bloom")
    t = s.cache_length
    j = torch.arange(t, dtype=torch.float64)
    bias = _alibi_slopes(s.n_heads)[:, None, None] * j[None, None, :]  # (H, 1, T): slope_h × j, every row
    for layer in range(s.n_layers):
        want = _by_hand(s, layer, bias)
        torch.testing.assert_close(_shown(s, layer, "scores"), want, atol=_tol(want), rtol=0)
        # raw stays q·kᵀ; the bias is part of the scores, not of raw
        torch.testing.assert_close(_shown(s, layer, "raw") * s.scaling(layer), want - bias, atol=_tol(want), rtol=0)
    torch.testing.assert_close(s.score_bias(0).slopes.double(), _alibi_slopes(s.n_heads))


def test_mpt_bias_is_measured_from_each_forwards_last_key(run):
    # MPT: slope × (j − (Tk − 1)), Tk the key length of the forward that computed the row: the prompt's
    # rows share the prefill's last key, each stepped row is its own forward (Tk = i + 1)
    s, _ = run("mpt")
    t, p = s.cache_length, s.prompt_length
    ref = torch.tensor([p - 1 if i < p else i for i in range(t)], dtype=torch.float64)  # (T,)
    dist = torch.arange(t, dtype=torch.float64)[None, :] - ref[:, None]  # (T, T)
    bias = _alibi_slopes(s.n_heads)[:, None, None] * dist[None]  # (H, T, T)
    for layer in range(s.n_layers):
        want = _by_hand(s, layer, bias)
        torch.testing.assert_close(_shown(s, layer, "scores"), want, atol=_tol(want), rtol=0)
    # a bias measured from the query instead (slope × (j − i)) would be another model's scores
    wrong = _by_hand(s, 0, _alibi_slopes(s.n_heads)[:, None, None] * (dist - (torch.arange(t) - ref)[:, None])[None])
    assert (wrong - _shown(s, 0, "scores"))[:, : p - 1].abs().max() > 0.1


@torch.no_grad()
def _doge_bias(s, layer: int, attn) -> torch.Tensor:
    """doge's dynamic mask by its definition: exp(A × softplus(dt_proj(v))) per KV head and key: (H, T)."""
    _, _, v = s.qkv(layer)  # (Hkv, T, d)
    v = torch.from_numpy(v).double()
    x = v.transpose(0, 1).reshape(v.shape[1], -1)  # (T, Hkv d)
    dt = x @ attn.dt_proj.weight.double().T + (0 if attn.dt_proj.bias is None else attn.dt_proj.bias.double())
    per_kv = torch.exp(attn.A.double() * F.softplus(dt)).T  # (Hkv, T)
    return per_kv.repeat_interleave(s.n_heads // s.n_kv_heads, dim=0)  # (H, T)


def test_doge_scores_carry_its_key_bias_and_each_head_keeps_its_own_top_keys(run):
    s, ref = run("doge")
    t = s.cache_length
    keep, window = ref.config.keep_window_size, ref.config.sliding_window
    assert keep < window < t  # the top-k window really cuts, inside the sliding window
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
    for layer in range(s.n_layers):
        attn = ref.model.layers[layer].self_attn
        rows = _doge_bias(s, layer, attn)  # (H, T)
        assert float(rows.std()) > 0.05  # a bias that varies, or the test would show nothing
        want = _by_hand(s, layer, rows[:, None, :])
        torch.testing.assert_close(_shown(s, layer, "scores"), want, atol=_tol(want), rtol=0)
        # the allowed keys: each row's `keep` largest biases among the keys its sliding window allows, per head
        allowed = np.stack([s.allowed(layer, h) for h in range(s.n_heads)])  # (H, T, T)
        for h in range(s.n_heads):
            for i in range(t):
                lo = max(0, i - window + 1)
                top = set(range(lo, i + 1))
                if len(top) > keep:
                    top = {lo + int(j) for j in rows[h, lo : i + 1].topk(keep).indices}
                assert set(np.flatnonzero(allowed[h, i]).tolist()) == top, f"layer {layer} head {h} row {i}"
        assert any((allowed[h] != allowed[0]).any() for h in range(1, s.n_heads))  # heads differ
        assert (torch.from_numpy(allowed).sum(-1) < causal.sum(-1)).any()


@pytest.mark.parametrize("family", ["bloom", "mpt", "doge"])
def test_the_bias_survives_a_trace(family, run, tmp_path):
    s, _ = run(family)
    tr = gi.load_trace(s.save_trace(tmp_path / f"{family}.safetensors"))
    for layer in range(s.n_layers):
        for kind in ("scores", "probs"):
            np.testing.assert_array_equal(tr.attention(layer, 1, kind), s.attention(layer, 1, kind))
        np.testing.assert_array_equal(tr.allowed(layer, 2), s.allowed(layer, 2))
        torch.testing.assert_close(tr.bias_rows(layer, 0, 3), s.bias_rows(layer, 0, 3), atol=0, rtol=0)


@pytest.mark.parametrize("family", ["bloom", "mpt", "doge"])
def test_the_math_check_counts_the_bias(family, run):
    s, _ = run(family)
    report = mathcheck.check_all(s)
    assert (report.max_diff <= report.tolerance).all()
    assert mathcheck.check(s, 1, 2, 3).ok
    # the same equation without the bias does not reproduce the model's outputs: the check can fail
    q, k, v = (x.astype(np.float64) for x in s.qkv(1))
    group = s.n_heads // s.n_kv_heads
    k, v = np.repeat(k, group, 0), np.repeat(v, group, 0)  # (H, T, d)
    allowed = np.stack([s.allowed(1, h) for h in range(s.n_heads)])  # (H, T, T)
    scores = np.where(allowed, q @ k.transpose(0, 2, 1) * s.scaling(1), -np.inf)  # (H, T, T)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    out = (w / w.sum(-1, keepdims=True)) @ v  # (H, T, d)
    assert np.abs(out - s.attention_output(1)).max() > 1e-3


def test_doge_beam_views_keep_each_beams_own_bias(run, tokenizer, tmp_path):
    from gpt_inspector.core.beams import BeamSearch

    # doge's top-k depends on each key's bias, so beams that took different tokens mask differently
    s, ref = run("doge")
    bs = BeamSearch(s.lm, prompt_ids=s.prompt_ids, num_beams=4, num_return_sequences=4, max_new_tokens=8)
    bs.run()
    views = [bs.result_view(r) for r in range(4)]
    assert len({tuple(v.processed_tokens) for v in views}) >= 3  # beams that really diverged
    for r, view in enumerate(views):
        ids = view.processed_tokens
        with torch.no_grad():
            att = ref(torch.tensor([ids]), output_attentions=True).attentions
        for layer in range(s.n_layers):
            np.testing.assert_allclose(view.attention_rows(layer, 0, len(ids), "probs").numpy(),
                                       att[layer][0].numpy(), atol=5e-5, rtol=0, err_msg=f"beam {r} layer {layer}")  # fmt: skip
    # a beam saved as a trace keeps its own masks and bias
    tr = gi.load_trace(views[1].save_trace(tmp_path / "beam.safetensors"))
    for layer in range(s.n_layers):
        np.testing.assert_array_equal(tr.attention_rows(layer, 0, tr.cache_length, "scores").numpy(),
                                      views[1].attention_rows(layer, 0, tr.cache_length, "scores").numpy())  # fmt: skip
        np.testing.assert_array_equal(tr.allowed_rows(layer, 0, tr.cache_length).numpy(),
                                      views[1].allowed_rows(layer, 0, tr.cache_length).numpy())  # fmt: skip


def _rewrite(src, dst, edit):
    """Copy trace ``src`` to ``dst`` with ``edit(tensors, meta)`` applied."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(src), framework="np") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  (a safetensors handle, not a dict)
    edit(tensors, meta)
    save_file(tensors, str(dst), metadata=meta)
    return dst


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda t, m: m.update(score_bias='[{"form": "alibi", "slopes": [1.0]}, null]'), "score_bias"),
        (lambda t, m: m.update(score_bias='[{"form": "relative"}, null]'), "score_bias"),
        (lambda t, m: t.pop("layers.0.bias_ref"), "bias_ref"),
        (lambda t, m: t.__setitem__("layers.1.bias_ref", t["layers.1.bias_ref"][:-1].copy()), "bias_ref"),
        (lambda t, m: t["layers.0.bias_ref"].__setitem__(0, np.nan), "not finite"),
    ],
)
def test_a_damaged_bias_in_a_trace_is_refused_in_one_line(damage, words, run, tmp_path):
    s, _ = run("mpt")
    path = _rewrite(s.save_trace(tmp_path / "ok.safetensors"), tmp_path / "bad.safetensors", damage)
    with pytest.raises(gi.InspectorError) as e:
        gi.load_trace(path)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_per_head_mask_in_a_trace_must_allow_a_key_in_every_head(run, tmp_path):
    s, _ = run("doge")

    def damage(t, m):
        t["layers.0.mask_rows"][-1, 2] = False  # head 2 of the last masked row allows nothing

    path = _rewrite(s.save_trace(tmp_path / "ok.safetensors"), tmp_path / "bad.safetensors", damage)
    with pytest.raises(gi.InspectorError, match="allows no key"):
        gi.load_trace(path)


def test_an_adapted_family_loads_from_a_folder_and_the_cli_traces_it(tokenizer, tmp_path, capsys):
    # the load path the CLI and the window use (load_model), not only from_model
    import json

    from gpt_inspector.cli import main

    folder = tmp_path / "tiny-bloom"
    model = tiny_families.build_model("bloom", tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    lm = gi.load_model(folder, device="cpu")
    assert lm.unverified is None and lm.n_heads == 4
    out = tmp_path / "bloom.safetensors"
    rc = main(["trace", "--model", str(folder), "--device", "cpu", "--prompt", "She eats", "--steps", "3",
               "--out", str(out), "--json"])  # fmt: skip
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    tr = gi.load_trace(out)
    assert tr.tokens == data["tokens"] and tr.score_bias(0).form == "alibi"


def test_the_load_self_test_compares_with_the_models_own_code(tokenizer, monkeypatch):
    # an adapter that lost the ALiBi bias must be refused at load: the self-test's reference runs
    # BLOOM's own attention (adapters.native), not the adapter a second time
    from gpt_inspector.core.adapters import biased

    real = biased.attend
    monkeypatch.setattr(biased, "attend", lambda *a, score_bias=None, **kw: real(*a, **kw))
    model = tiny_families.build_model("bloom", tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    with pytest.raises(gi.InspectorError, match="differ from the model's own eager attention"):
        from_model(model, tokenizer, "bloom")


@pytest.mark.parametrize("family", ["falcon", "bloom", "doge", "gpt_neo"])
def test_mask_edits_reach_an_adapted_familys_attention(family, tokenizer, tmp_path):
    # loaded from a folder as a user would (Falcon then gets transformers' sdpa-style boolean masks)
    from gpt_inspector.core.capture import MaskEdit

    folder = tmp_path / family
    tiny_families.build_model(family, tokenizer.convert_tokens_to_ids("<|endoftext|>")).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    s = gi.Session(gi.load_model(folder, device="cpu"), PROMPT)
    s.run(3)
    q = s.cache_length - 1
    key = int(np.argmax(s.attention(0, 1, "probs")[q]))  # the key head 1 attends to most
    before = s.current.logits.clone()
    s.set_mask_edits([MaskEdit(query=q, key=key, layer=0, head=1)])
    probs = s.attention_rows(0, q, q + 1)[:, 0]  # (H, T)
    assert float(probs[1, key]) == 0.0 and float(probs[0, key]) > 0 or not s.allowed(0, 0)[q, key]
    np.testing.assert_allclose(probs.sum(-1).numpy(), 1.0, atol=1e-5)
    assert float((s.current.logits - before).abs().max()) > 1e-4  # the model itself saw the edit
    report = mathcheck.check_all(s)  # the recorded outputs are the edited equation's
    assert (report.max_diff <= report.tolerance).all()


@pytest.mark.parametrize("family", ["mpt", "xglm"])
def test_the_cli_traces_an_adapted_family_exactly_and_says_nothing_on_stderr(family, tokenizer, tmp_path):
    # transformers 5.24 renamed the forwards' cache keyword: an adapter that missed it never filled the
    # cache (refused at load), and a caller passing the old name printed a FutureWarning on every run
    import os
    import subprocess
    import sys
    from pathlib import Path

    folder = tmp_path / f"tiny-{family}"
    model = tiny_families.build_model(family, tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "t.safetensors"
    env = dict(os.environ, PYTHONPATH=str(Path(gi.__file__).resolve().parents[1]), HF_HUB_OFFLINE="1")
    env.pop("PYTHONWARNINGS", None)
    r = subprocess.run([sys.executable, "-m", "gpt_inspector", "trace", "--model", str(folder), "--device", "cpu",
                        "--prompt", "She eats an apple", "--steps", "4", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    tr = gi.load_trace(out)
    with torch.no_grad():
        want = model.eval()(torch.tensor([tr.tokens]), output_attentions=True)
    t = len(tr.tokens) - 1  # the last token was chosen, never fed
    for layer in range(tr.n_layers):
        np.testing.assert_allclose(tr.attention_rows(layer, 0, t).numpy(), want.attentions[layer][0, :, :t, :t].numpy(),
                                   atol=5e-5, rtol=0, err_msg=f"{family}: layer {layer}")  # fmt: skip
