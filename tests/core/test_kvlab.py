"""The KV cache lab: policies' decisions, the lockstep measures, the records, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gpt_inspector as gi
from gpt_inspector.core import InspectorError
from gpt_inspector.core.kvlab import KVLab, kl_divergence, make

PROMPT = "She eats an apple. He reads a book. They walk"
NEVER = torch.iinfo(torch.long).max


def held(lab, layer):
    return ~torch.as_tensor(lab.evicted(layer))  # (Hkv, T)


@pytest.mark.parametrize("name,opts", [("streaming", {}), ("h2o", {}), ("snapkv", {}), ("tova", {}), ("keynorm", {}),
                                       ("custom", {"scorer": lambda layer, k, p: -k.norm(dim=-1)}),
                                       ("int8", {"residual": 64}), ("fp8-e5m2", {"residual": 64})])  # fmt: skip
def test_unlimited_budget_is_the_reference_exactly(name, opts, tiny_lm):
    lm = tiny_lm("llama")
    lab = KVLab(lm, PROMPT, make(name, None, **opts), free_running=True)
    steps = lab.run_steps(8)
    assert [s.kl for s in steps] == [0.0] * len(steps)
    assert all(s.agree for s in steps) and lab.first_divergence is None and lab.parted_at is None
    assert lab.run.tokens == lab.reference.tokens
    for a, b in zip(lab.run.steps_done, lab.reference.steps_done):
        assert torch.equal(a.logits, b.logits)
    assert steps[-1].bytes_policy == steps[-1].bytes_full
    assert float(np.abs(np.stack([s.lost_mass for s in steps])).max()) == 0.0


def test_streaming_keeps_the_sinks_and_the_newest_window(tiny_lm):
    lm = tiny_lm("gpt2")
    lab = KVLab(lm, PROMPT, make("streaming", 7, sinks=2))
    for st in lab.steps(6):
        t = lab.run.cache_length
        want = torch.zeros(t, dtype=torch.bool)
        want[:2] = True
        want[t - 5 :] = True
        for layer in range(lm.n_layers):
            assert torch.equal(held(lab, layer), want.expand(lm.n_kv_heads, -1))
        assert sum(st.bytes_policy) == lm.n_layers * 2 * lm.n_kv_heads * 7 * lm.head_dim * 4
        assert sum(st.bytes_full) == lm.n_layers * 2 * lm.n_kv_heads * t * lm.head_dim * 4


def test_on_a_sliding_window_the_full_cache_is_the_models_window_and_a_policy_holds_no_more(tiny_lm):
    # gemma2's layer 0 has a 4-key window: the model's own cache (generate's) holds its newest 3 positions
    lm = tiny_lm("gemma2")
    entry = 2 * lm.head_dim * 4  # one KV head's K and V at one position, float32
    full, lab = KVLab(lm, PROMPT, make("h2o", None)), KVLab(lm, PROMPT, make("h2o", 6))
    for a, b in zip(full.steps(6), lab.steps(6)):
        t = full.run.cache_length
        assert a.bytes_full == b.bytes_full == [3 * lm.n_kv_heads * entry, t * lm.n_kv_heads * entry] != a.bytes_kept
        assert a.bytes_kept == b.bytes_kept == [t * lm.n_kv_heads * entry] * 2  # what the inspector keeps
        assert a.bytes_policy == a.bytes_full  # unlimited: the model's own cache, window and all
        # the entries h2o holds, of those the window has not dropped (layer 0: the newest 3)
        assert b.bytes_policy == [int(held(lab, 0)[:, t - 3 :].sum()) * entry, int(held(lab, 1).sum()) * entry]
        assert b.bytes_policy[1] < b.bytes_full[1] and b.bytes_ratio < 1
    assert int(held(lab, 0).sum()) > int(held(lab, 0)[:, t - 3 :].sum())  # entries older than the window count nowhere
    assert full.summary()["bytes_kept"] == sum(a.bytes_kept) > full.summary()["bytes_full"]


def test_on_a_latent_cache_the_full_cache_and_a_policy_count_latent_rows(tmp_path):
    import tiny_families
    import tiny_models

    from gpt_inspector.core.models import from_model

    tok = tiny_models.build_tokenizer(tmp_path)
    lm = from_model(tiny_families.build_model("deepseek_v3", tok.convert_tokens_to_ids("<|endoftext|>")), tok, "dsv3")
    row = lm.kv_layout.layers[0].cache_numbers * 4  # one position's latent and rotary key, float32
    full, lab = KVLab(lm, PROMPT, make("streaming", None)), KVLab(lm, PROMPT, make("streaming", 6, sinks=1))
    for a, b in zip(full.steps(3), lab.steps(3)):
        t = full.run.cache_length
        assert a.bytes_policy == a.bytes_full == a.bytes_kept == [t * row] * lm.n_layers == b.bytes_full
        assert b.bytes_policy == [6 * row] * lm.n_layers  # every KV head keeps the same 6: 6 latent rows


@pytest.mark.parametrize("name", ["h2o", "tova", "keynorm", "streaming"])
def test_every_kv_head_holds_at_most_its_budget(name, tiny_lm):
    lm = tiny_lm("llama")
    lab = KVLab(lm, PROMPT, make(name, 6, layer_budgets={0: [4, 9]}))
    for _ in lab.steps(8):
        assert (held(lab, 0).sum(1) <= torch.tensor([4, 9])).all()
        assert (held(lab, 1).sum(1) <= 6).all()
        assert held(lab, 1)[:, -1].all() or name in ("tova", "keynorm")  # the newest entry stays where protected


def test_h2o_keeps_the_heaviest_accumulated_attention(tiny_lm):
    """Independent of the policy's bookkeeping: accumulate the run's own attention rows (which
    mask evicted entries) and check the kept non-recent entries are the top scorers each step."""
    lm = tiny_lm("gpt2")
    budget = 8
    lab = KVLab(lm, PROMPT, make("h2o", budget))
    lab.step()
    layer = 1
    acc = lab.run.attention_rows(layer, 0, lab.run.cache_length).sum(1).double()  # (H, T) the prompt's rows
    for _ in range(5):
        prev = held(lab, layer).clone()
        lab.step()
        t = lab.run.cache_length
        row = lab.run.attention_rows(layer, t - 1, t)[:, 0].double()  # (H, T) the new query
        acc = torch.cat([acc, torch.zeros(lm.n_heads, 1, dtype=torch.float64)], 1) + row
        keep = held(lab, layer)
        for h in range(lm.n_heads):
            cand = torch.cat([prev[h], torch.tensor([True])])
            cand[t - budget // 2 :] = False  # the recent half is kept regardless
            kept = keep[h] & cand
            dropped = cand & ~keep[h]
            if dropped.any():
                assert float(acc[h][kept].min()) >= float(acc[h][dropped].max()) - 1e-9


def test_snapkv_compresses_the_prompt_once_then_keeps_everything(tiny_lm):
    lm = tiny_lm("llama")
    lab = KVLab(lm, PROMPT, make("snapkv", 9, window=3))
    lab.step()
    p = lab.run.prompt_length
    assert (held(lab, 0).sum(1) == 9).all() and held(lab, 0)[:, p - 3 :].all()
    lab.run_steps(4)
    assert (held(lab, 0).sum(1) == 9 + 4).all()


def test_custom_scorer_sees_keys_and_probs_and_drives_eviction(tiny_lm):
    lm = tiny_lm("llama")
    seen = []

    def newest_first(layer, keys, probs):
        seen.append((layer, tuple(keys.shape), tuple(probs.shape)))
        return torch.arange(keys.shape[1], dtype=torch.float64).expand(keys.shape[0], -1)

    lab = KVLab(lm, PROMPT, make("custom", 5, scorer=newest_first))
    lab.run_steps(3)
    p = lab.run.prompt_length
    assert seen[0] == (0, (lm.n_kv_heads, p, lm.head_dim), (lm.n_heads, p, p))
    t = lab.run.cache_length
    want = torch.zeros(t, dtype=torch.bool)
    want[t - 5 :] = True
    assert torch.equal(held(lab, 1), want.expand(lm.n_kv_heads, -1))


@pytest.mark.parametrize("name,opts", [("h2o", {"budget": 6}), ("tova", {"budget": 5}),
                                       ("int2", {"group": 4, "residual": 3}), ("fp8-e4m3", {"residual": 1}),
                                       ("int4", {"group": 4, "residual": 2, "scheme": "transformers"})])  # fmt: skip
def test_records_are_what_the_policy_attention_read(name, opts, tiny_lm):
    """The newest row, derived from the run's records by the shared reader, times the recorded
    values, reproduces the recorded head output; evicted entries get exactly 0."""
    lm = tiny_lm("gpt2")
    budget = opts.pop("budget", None)
    lab = KVLab(lm, PROMPT, make(name, budget, **opts))
    lab.run_steps(6)
    s = lab.run
    t = s.cache_length
    for layer in range(lm.n_layers):
        probs = s.attention_rows(layer, t - 1, t)  # (H, 1, T)
        v = s.values(layer).float()  # (Hkv, T, d), as read
        out = torch.einsum("hqt,htd->hqd", probs, v)
        torch.testing.assert_close(out[:, 0], s.head_outputs(layer)[:, t - 1].float(), atol=2e-5, rtol=1e-4)
        ev = (
            (lab.policy.evicted_at[layer] <= t - 1).cpu() if budget else None
        )  # (Hkv, T) gone before the newest query ran
        if budget is not None:
            assert ev.any() and (probs[:, 0][ev] == 0).all()
            assert not s.allowed(layer, 0)[t - 1][ev[0].numpy()].any()


def test_quantization_row_error_and_bytes(tiny_lm):
    lm = tiny_lm("gpt2")  # head_dim 8, 4 KV heads, float32
    group, residual = 4, 3
    lab = KVLab(lm, PROMPT, make("int4", group=group, residual=residual))
    st = lab.run_steps(5)[-1]
    t = lab.run.cache_length
    # the last forward read t entries: the oldest t - 3 quantized (keys in whole groups of 4)
    old = t - residual
    qk = old // group * group
    ek, ev = lab.row_error(1)
    assert (ek[:, :qk] > 0).all() and (ek[:, qk:] == 0).all()
    assert (ev[:, :old] > 0).all() and (ev[:, old:] == 0).all()
    assert 0 < float(ek.max()) < 0.5
    hd = lm.n_kv_heads * lm.head_dim
    full = (t - qk + t - old) * hd * 4
    packed = math.ceil((qk + old) * hd * 4 / 8)
    scales = 2 * ((qk // group) * hd + old * (hd // group)) * 4
    assert st.bytes_policy == [full + packed + scales] * lm.n_layers


def test_kl_top1_and_lost_mass_are_computed_from_both_runs(tiny_lm):
    lm = tiny_lm("gpt2")
    lab = KVLab(lm, PROMPT, make("streaming", 6, sinks=1))
    steps = lab.run_steps(6)
    for st, a, b in zip(steps, lab.reference.steps_done, lab.run.steps_done):
        p = torch.softmax(a.logits.double(), -1)
        want = float((p * (p.log() - torch.log_softmax(b.logits.double(), -1))).sum())
        assert st.kl == pytest.approx(want, rel=1e-9, abs=1e-12)
        assert st.agree == (int(a.logits.argmax()) == int(b.logits.argmax()))
    assert steps[0].kl == 0.0  # the prompt's forward attends in full
    assert any(s.kl > 1e-3 for s in steps[1:])
    # lost mass: the reference's newest-row attention on the entries the policy had evicted
    t = lab.run.cache_length
    for layer in range(lm.n_layers):
        ref = np.stack([lab.reference.attention(layer, h)[t - 1] for h in range(lm.n_heads)])  # (H, T)
        gone = (lab.policy.evicted_at[layer] <= t - 1).cpu().numpy()  # (Hkv=H, T) gone before the newest query ran
        np.testing.assert_allclose(steps[-1].lost_mass[layer], (ref * gone).sum(1), atol=1e-6)
    assert steps[-1].lost_mass.max() > 0
    assert kl_divergence(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])) == 0.0


def test_teacher_forced_feeds_the_reference_token_and_free_running_parts(tiny_lm):
    lm = tiny_lm("llama")
    forced = KVLab(lm, PROMPT, make("streaming", 4, sinks=1))
    steps = forced.run_steps(8)
    assert forced.run.tokens == forced.reference.tokens
    assert forced.first_divergence is not None
    assert any(s.policy_token != s.reference_token for s in steps)
    free = KVLab(lm, PROMPT, make("streaming", 4, sinks=1), free_running=True)
    free.run_steps(8)
    k = free.parted_at
    assert k is not None
    n = free.run.prompt_length
    assert free.run.tokens[: n + k] == free.reference.tokens[: n + k]
    assert free.run.tokens[n + k] != free.reference.tokens[n + k]


def test_probe_on_the_compressed_cache(tiny_lm):
    lm = tiny_lm("gpt2")
    full = KVLab(lm, PROMPT, make("h2o", None))
    full.step()
    r = full.probe()
    assert r.recovered == r.held == r.prompt_tokens == full.run.prompt_length
    lab = KVLab(lm, PROMPT, make("streaming", 6, sinks=2))
    lab.run_steps(3)
    r = lab.probe()
    assert r.held == 2 + max(0, 4 - 2)  # the sinks and the window's prompt positions still in it
    assert r.recovered <= r.held


BAD = [
    (lambda: make("h2o", 0), "at least 1"),
    (lambda: make("h2o", -3), "at least 1"),
    (lambda: make("h2o", 10_000), "more than the model's context"),
    (lambda: make("h2o", 2.5), "whole number"),
    (lambda: make("lru", 8), "unknown policy"),
    (lambda: make("int4", 8), "takes no budget"),
    (lambda: make("int4", group=3), "does not divide"),
    (lambda: make("streaming", 3, sinks=3), "no room"),
    (lambda: make("h2o", 8, layer_budgets={7: 4}), "layers"),
    (lambda: make("h2o", 8, layer_budgets={0: [1, 2, 3]}), "KV heads"),
    (lambda: make("custom", 8), "scoring function"),
    (lambda: make("int4", scheme="hqq"), "unknown quantization scheme"),
    (lambda: make("int8", scheme="transformers"), "int4 or int2"),
    (lambda: make("int4", residual=0, scheme="transformers"), "at least 1"),
    (lambda: make("int4", residual=-1), "residual must be"),
]


@pytest.mark.parametrize("build,words", BAD)
def test_bad_policies_are_refused_in_one_line(build, words, tiny_lm):
    lm = tiny_lm("llama")
    with pytest.raises(InspectorError, match=words) as e:
        KVLab(lm, PROMPT, build())
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("scorer,words", [
    (lambda layer, k, p: 1 / 0, "raised ZeroDivisionError"),
    (lambda layer, k, p: torch.zeros(3), "returned shape"),
    (lambda layer, k, p: torch.full(k.shape[:2], float("nan")), "NaN"),
])  # fmt: skip
def test_a_failing_scorer_leaves_everything_as_it_was(scorer, words, tiny_lm):
    lm = tiny_lm("llama")
    live = gi.Session(lm, PROMPT)
    live.run(2)
    before = [s.logits.clone() for s in live.steps_done]
    calls = []

    def flaky(layer, k, p):
        calls.append(layer)
        if len(calls) > 2 * lm.n_layers:  # fine for the prompt and one step, then fails
            return scorer(layer, k, p)
        return torch.arange(k.shape[1], dtype=torch.float64).expand(k.shape[0], -1)

    lab = KVLab(lm, PROMPT, make("custom", 6, scorer=flaky))
    lab.run_steps(2)
    snap = [t.clone() for t in lab.policy.evicted_at], lab.run.cache_length, list(lab.run.tokens)
    with pytest.raises(InspectorError, match=words):
        lab.step()
    assert lab.run.cache_length == snap[1] and lab.run.tokens == snap[2]
    assert lab.reference.n_steps == lab.run.n_steps == 2 and len(lab.history) == 2
    assert all(torch.equal(a, b) for a, b in zip(lab.policy.evicted_at, snap[0]))
    assert all(torch.equal(a.logits, b) for a, b in zip(live.steps_done, before))
    live.step()  # the live session goes on as before
    fresh = gi.Session(lm, PROMPT)
    fresh.run(3)
    assert torch.equal(fresh.current.logits, live.current.logits)


def test_a_policy_must_come_from_make(tiny_lm):
    with pytest.raises(InspectorError, match="kvlab.make"):
        KVLab(tiny_lm("gpt2"), PROMPT, "h2o")


@pytest.mark.parametrize("name,opts", [("h2o", {"budget": 5}), ("int2", {"group": 4, "residual": 2})])
def test_an_interrupt_anywhere_in_a_lab_step_leaves_the_lab_as_it_was(name, opts, tiny_lm, monkeypatch):
    from gpt_inspector.core.kvlab import lab as lab_module

    lm = tiny_lm("gpt2")
    budget = opts.pop("budget", None)
    lab = KVLab(lm, PROMPT, make(name, budget, **opts))
    lab.run_steps(3)
    real = lab_module.KVLab._measure
    monkeypatch.setattr(lab_module.KVLab, "_measure", lambda self, *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        lab.step()
    assert len(lab.history) == lab.run.n_steps == lab.reference.n_steps == 3
    assert lab.run.cache_length == lab.reference.cache_length
    monkeypatch.setattr(lab_module.KVLab, "_measure", real)
    again = lab.run_steps(3)
    clean = KVLab(lm, PROMPT, make(name, budget, **opts))
    want = clean.run_steps(6)[3:]
    assert [s.kl for s in again] == [s.kl for s in want]
    assert lab.run.tokens == clean.run.tokens
    for layer in range(lm.n_layers):
        assert torch.equal(lab.run.keys(layer), clean.run.keys(layer))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_lab_run_saves_as_a_trace_that_replays_its_evictions(family, tiny_lm, tmp_path):
    lm = tiny_lm(family)
    lab = KVLab(lm, PROMPT, make("h2o", 5))
    lab.run_steps(3)
    run = lab.run
    saved = gi.load_trace(run.save_trace(tmp_path / "t.safetensors"))
    t = run.cache_length
    assert saved.cache_length == t and saved.kv_policy.describe() == lab.policy.describe()
    gone = 0
    for layer in range(lm.n_layers):
        # softmax over the keys the reopened trace allows, times V (float64, written out here), is the
        # head output the model's attention returned under the policy
        q, k, v = (torch.as_tensor(x, dtype=torch.float64) for x in saved.qkv(layer))  # (H, T, d), (Hkv, T, d) x2
        rep = saved.n_heads // saved.n_kv_heads
        scores = q @ k.repeat_interleave(rep, 0).transpose(1, 2) * saved.scaling(layer)  # (H, T, T)
        p = torch.softmax(scores.masked_fill(~saved.allowed_rows(layer, 0, t), float("-inf")), -1)
        start = run.head_output_start
        want = run.head_outputs(layer)[:, start:].double()  # (H, T - start, d)
        assert torch.allclose((p @ v.repeat_interleave(rep, 0))[:, start:], want, atol=1e-5)
        assert torch.equal(saved.kv_policy.evicted(layer, t), lab.policy.evicted(layer, t))
        assert [saved.kv_cache_bytes(layer, n) for n in range(1, t + 1)] == [
            run.kv_cache_bytes(layer, n) for n in range(1, t + 1)
        ]
        gone += int(lab.policy.evicted(layer, t).sum())
    assert gone > 0  # the budget dropped entries: the check above saw them masked
    quant = KVLab(lm, PROMPT, make("int2", None, group=4, residual=2))
    quant.run_steps(1)
    with pytest.raises(InspectorError, match="quantizing policy cannot be saved as a trace"):
        quant.run.save_trace(tmp_path / "q.safetensors")


@pytest.mark.parametrize("excess", [1, 3])
def test_eviction_keeps_protected_entries_and_the_best_scores_ties_to_the_older(excess):
    """The eviction rule on its own, against the rule written out (both the one-over fast path and the ranking)."""
    from gpt_inspector.core.kvlab import Eviction

    g = torch.Generator().manual_seed(excess)
    pol = Eviction("h2o", 10, sinks=2, recent=3)
    pol.bind(1, 4, 2, 8, 64, 4)
    tk = 10 + excess
    pol.evicted_at[0] = torch.full((2, tk), NEVER)
    score = torch.randint(0, 4, (2, tk), generator=g).double()  # few distinct values: many ties
    pol._evict(0, score, torch.tensor([10, 10]), tk)
    for h in range(2):
        protect = set(range(2)) | set(range(tk - 3, tk))
        cand = [j for j in range(tk) if j not in protect]
        ranked = sorted(cand, key=lambda j: (-float(score[h, j]), j))  # best first, older first among equals
        keep = protect | set(ranked[: 10 - len(protect)])
        got = {j for j in range(tk) if pol.evicted_at[0][h, j] == NEVER}
        assert got == keep
        assert all(int(pol.evicted_at[0][h, j]) == tk for j in range(tk) if j not in keep)


@pytest.mark.parametrize("name", ["h2o", "tova", "streaming", "keynorm"])
def test_a_decode_steps_batched_eviction_equals_each_layer_evicting_on_its_own(name, tiny_lm, monkeypatch):
    # decode steps score and evict all layers in one pass after the forward; the per-layer path is the
    # written-out rule. Layers with different budgets (and GQA groups) go through the same pass
    from gpt_inspector.core.kvlab import Eviction

    lm = tiny_lm("llama")
    runs = []
    for batched in (True, False):
        if not batched:
            monkeypatch.setattr(Eviction, "_uniform_budget", lambda self, layer: False)
        lab = KVLab(lm, PROMPT, make(name, 6, layer_budgets={1: 9}))
        steps = lab.run_steps(10)
        runs.append((lab, steps))
    (a, sa), (b, sb) = runs
    assert a.run.tokens == b.run.tokens and [s.kl for s in sa] == [s.kl for s in sb]
    for layer in range(lm.n_layers):
        assert torch.equal(a.policy.evicted_at[layer], b.policy.evicted_at[layer])
        assert torch.equal(a.policy.scores[layer], b.policy.scores[layer])
    assert any(bool((ev < NEVER).any()) for ev in a.policy.evicted_at)
