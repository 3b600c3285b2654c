"""Serving constraints on an eviction policy (schedules, whole pages, AdaKV's shared layer budget,
append-only, paged bytes) against the rules written out here, on tiny GPT-2 (one KV head per query
head) and Llama (GQA: 2 query heads per KV head) checkpoints. Scores come from the run's recorded q
and K (as attention saw them), never from the policy's own."""

from __future__ import annotations

import math

import pytest
import torch

from gpt_inspector.core import InspectorError
from gpt_inspector.core.kvlab import KVLab, make

PROMPT = "She eats an apple. He reads a book. They walk"
MARGIN = 1e-5  # float32 attention vs this float64 rewrite: decisions closer than this are not checked
SAFEGUARD = 0.2  # AdaKV's safeguard share, as in kvpress


def held(lab, layer) -> torch.Tensor:
    return ~torch.as_tensor(lab.evicted(layer))  # (Hkv, T)


def due(schedule, step: int) -> bool:
    """The schedule written out: the prompt's forward (step 0) always evicts; then every step, never, or every N."""
    if schedule == "append":
        return False
    if step == 0:
        return True
    return {"step": True, "prefill": False}.get(schedule, step % schedule == 0 if isinstance(schedule, int) else None)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("schedule", ["step", "prefill", 3, "append"])
@pytest.mark.parametrize("page", [1, 4])
def test_streaming_keeps_sinks_and_the_newest_units_as_of_its_last_eviction(family, schedule, page, tiny_lm):
    """StreamingLLM: with B entries in pages of S (S = 1: entries), the last evicting forward left T* cached
    positions; the kept positions are those of unit p // S < ceil(sinks / S), or of unit >= ceil(T* / S) -
    (B // S - ceil(sinks / S)) (its newest units), and every position cached since. Nothing before T* > B."""
    lm = tiny_lm(family)
    budget, sinks = 12, 2
    lab = KVLab(lm, PROMPT, make("streaming", budget, sinks=sinks, schedule=schedule, page=page))
    p_len = lab.run.prompt_length
    evicting = 0
    last = p_len
    for _ in range(12):
        lab.step()
        t = lab.run.cache_length
        if due(schedule, t - p_len):
            last = t
        units, sink_units = budget // page, math.ceil(sinks / page)
        pos = torch.arange(t)
        if schedule == "append" or math.ceil(last / page) <= units:
            want = torch.ones(t, dtype=torch.bool)
        else:
            want = (pos // page < sink_units) | (pos // page >= math.ceil(last / page) - (units - sink_units))
        evicting += int((~want).sum())
        for layer in range(lm.n_layers):
            assert torch.equal(held(lab, layer), want.expand(lm.n_kv_heads, t)), (layer, t, schedule, page)
    assert (evicting > 0) == (schedule != "append")


def tova_scores(lab, layer, allowed: torch.Tensor) -> torch.Tensor:
    """(Hkv, T) float64: softmax(q_i K^T * scaling) of the newest query over the ``allowed`` entries, summed
    over the query heads that read each KV head (TOVA's score), from the recorded q and K."""
    s = lab.run
    q = s.queries(layer)[:, -1].double()  # (H, d)
    k = s.keys(layer).double()  # (Hkv, T, d)
    hkv, group = k.shape[0], q.shape[0] // k.shape[0]
    logits = torch.einsum("hd,htd->ht", q, k.repeat_interleave(group, 0)) * s.scaling(layer)  # (H, T)
    logits = logits.masked_fill(~allowed.repeat_interleave(group, 0), float("-inf"))
    return torch.softmax(logits, -1).reshape(hkv, group, -1).sum(1)


def rule_keep(before: torch.Tensor, score: torch.Tensor, budget: int, page: int, shared: bool):
    """The page / shared-budget rule in plain loops: (kept (Hkv, T) bool, closest score gap at a decision).

    Units of ``page`` positions; a unit is held if any entry is; its score is its held entries' mean. TOVA
    protects no sinks and no recent window; with pages the page being filled is always kept. Per head: at
    most budget // page units, best first (ties: the older). Shared: the layer's heads together hold at
    most Hkv * (budget // page); each keeps its own best floor(0.2 * room) first, then the best of all."""
    hkv, t = before.shape
    n_units, cap = -(-t // page), budget // page
    units = {}  # (head, unit) -> score, held units only
    for g in range(hkv):
        for u in range(n_units):
            idx = [p for p in range(u * page, min(t, (u + 1) * page)) if before[g, p]]
            if idx:
                units[g, u] = sum(float(score[g, p]) for p in idx) / len(idx)
    protect = {(g, u) for (g, u) in units if page > 1 and u == n_units - 1}
    keep = set(protect)
    gaps = []

    def best(cands, n):
        ranked = sorted(cands, key=lambda x: (-units[x], x[0], x[1]))  # ties: lower head, older unit
        if 0 < n < len(ranked):
            gaps.append(units[ranked[n - 1]] - units[ranked[n]])
        return ranked[:n]

    if not shared:
        for g in range(hkv):
            mine = [x for x in units if x[0] == g]
            if len(mine) <= cap:
                keep |= set(mine)
                continue
            keep |= set(best([x for x in mine if x not in protect], cap - sum(1 for x in protect if x[0] == g)))
    elif len(units) <= hkv * cap:
        keep = set(units)
    else:
        rooms = {g: cap - sum(1 for x in protect if x[0] == g) for g in range(hkv)}
        for g in range(hkv):
            keep |= set(best([x for x in units if x[0] == g and x not in protect], math.floor(SAFEGUARD * rooms[g])))
        left = sum(rooms.values()) - (len(keep) - len(protect))
        keep |= set(best([x for x in units if x not in keep], left))
    out = torch.zeros(hkv, t, dtype=torch.bool)
    for g, u in keep:
        out[g, u * page : (u + 1) * page] = before[g, u * page : (u + 1) * page]
    return out, min(gaps, default=math.inf)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("page,share,schedule", [(4, "head", "step"), (1, "layer", "step"), (4, "layer", 2)])
def test_tova_pages_and_shared_budgets_follow_the_rule(family, page, share, schedule, tiny_lm):
    lm = tiny_lm(family)
    budget = 8
    lab = KVLab(lm, PROMPT, make("tova", budget, page=page, share=share, schedule=schedule))
    p_len = lab.run.prompt_length
    before = {layer: None for layer in range(lm.n_layers)}
    checked = evicted = 0
    for _ in range(10):
        lab.step()
        t = lab.run.cache_length
        for layer in range(lm.n_layers):
            b = before[layer]
            cand = torch.ones(lm.n_kv_heads, t, dtype=torch.bool)
            if b is not None:
                cand[:, : b.shape[1]] = b  # what the newest query read: the held entries, and itself
            got = held(lab, layer)
            if not due(schedule, t - p_len):
                assert torch.equal(got, cand)
            else:
                want, gap = rule_keep(cand, tova_scores(lab, layer, cand), budget, page, share == "layer")
                if gap >= MARGIN:
                    assert torch.equal(got, want), (layer, t)
                    checked += 1
                    evicted += int((cand & ~want).sum())
            before[layer] = got
    assert checked >= 10 and evicted > 0


def test_shared_budget_sums_to_the_layers_budget_and_moves_between_heads(tiny_lm):
    """AdaKV on Llama (2 KV heads): once a layer is over Hkv x B, it holds exactly Hkv x B entries
    after every eviction, and the heads do not all hold B (the budget went where the scores were)."""
    lm = tiny_lm("llama")
    budget = 7
    lab = KVLab(lm, PROMPT, make("tova", budget, share="layer"))
    uneven = 0
    for _ in range(8):
        lab.step()
        for layer in range(lm.n_layers):
            per_head = held(lab, layer).sum(1)  # (Hkv,)
            assert int(per_head.sum()) == lm.n_kv_heads * budget
            uneven += int((per_head != budget).any())
    assert uneven > 0
    # per head, as before: every head holds exactly B
    lab = KVLab(lm, PROMPT, make("tova", budget))
    lab.run_steps(3)
    assert all(bool((held(lab, layer).sum(1) == budget).all()) for layer in range(lm.n_layers))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("page", [1, 4, 16])
def test_paged_bytes_count_whole_pages_beside_the_exact_bytes(family, page, tiny_lm):
    """bytes = held entries x 2 (K and V) x head size x 4 (float32); paged: per KV head, the pages
    with an entry held x page size x the same; the full cache's pages: ceil(T / page) per head."""
    lm = tiny_lm(family)
    lab = KVLab(lm, PROMPT, make("h2o", 9, page=page) if page < 16 else make("h2o", None, page=page))
    for st in lab.steps(7):
        t = lab.run.cache_length
        per_entry = 2 * lm.head_dim * 4
        exact = paged = 0
        for layer in range(lm.n_layers):
            h = held(lab, layer)
            exact += int(h.sum()) * per_entry
            for g in range(lm.n_kv_heads):
                paged += len({int(p) // page for p in h[g].nonzero()[:, 0]}) * page * per_entry
        assert sum(st.bytes_policy) == exact
        assert sum(st.bytes_paged) == paged
        assert sum(st.bytes_full_paged) == lm.n_layers * lm.n_kv_heads * -(-t // page) * page * per_entry
        assert sum(st.bytes_full) == lm.n_layers * lm.n_kv_heads * t * per_entry
        assert st.to_json()["bytes_paged"] == paged and st.page == page
    assert sum(st.bytes_paged) > sum(st.bytes_policy) or page == 1  # a partly filled page costs a whole one


def test_append_only_evicts_nothing_and_counts_pages(tiny_lm):
    lm = tiny_lm("llama")
    lab = KVLab(lm, PROMPT, make("h2o", 4, schedule="append", page=16))
    lab.run_steps(5)
    s = lab.summary()
    assert s["bytes_policy"] == s["bytes_full"] and all(int(e) == 0 for e in lab.history[-1].evicted_now)
    assert s["bytes_paged"] == s["bytes_full_paged"] > s["bytes_full"]
    assert s["settings"] == {"schedule": "append", "page": 16, "share": "head"}
    assert lab.history[-1].kl == 0.0


def test_step_back_replays_a_scheduled_paged_shared_run(tiny_lm):
    lm = tiny_lm("llama")
    lab = KVLab(lm, PROMPT, make("h2o", 8, page=2, share="layer", schedule=3))
    first = [st.kl for st in lab.run_steps(7)]
    ev = [lab.evicted(i).copy() for i in range(lm.n_layers)]
    for _ in range(4):
        lab.step_back()
    again = first[:3] + [st.kl for st in lab.run_steps(4)]
    assert again == first
    assert all((lab.evicted(i) == ev[i]).all() for i in range(lm.n_layers))


@pytest.mark.parametrize(
    "opts,words",
    [
        ({"schedule": "sometimes"}, "schedule must be"),
        ({"schedule": 0}, "schedule must be"),
        ({"page": 0}, "page must be"),
        ({"share": "model"}, "share must be"),
        ({"page": 8}, "pages of 8"),  # a budget of 12 is 1 page: nothing beyond the page being filled
    ],
)
def test_bad_serving_options_are_refused_in_words(opts, words, tiny_lm):
    lm = tiny_lm("gpt2")
    with pytest.raises(InspectorError, match=words):
        KVLab(lm, PROMPT, make("tova", 12, **opts))
