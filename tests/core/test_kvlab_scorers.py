"""Eviction decisions against the rules written out here, from what the run recorded (q and K as attention
saw them), never from the policy's own scores; and a scorer written in the test running in the lab."""

from __future__ import annotations

import pytest
import torch

from gpt_inspector.core import InspectorError
from gpt_inspector.core.kvlab import KVLab, Scorer, make, registry

PROMPT = "She eats an apple. He reads a book. They walk"
MARGIN = 1e-5  # float32 attention vs this float64 rewrite: decisions closer than this are not checked


def held(lab, layer) -> torch.Tensor:
    return ~torch.as_tensor(lab.evicted(layer))  # (Hkv, T)


def newest_row(lab, layer, allowed: torch.Tensor) -> torch.Tensor:
    """(H, T) float64: softmax(q_i K^T * scaling) of the newest query i over the entries ``allowed``
    ((Hkv, T) bool), from the recorded q and K."""
    s = lab.run
    q = s.queries(layer)[:, -1].double()  # (H, d)
    k = s.keys(layer).double()  # (Hkv, T, d)
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, 0)  # (H, T, d): each query head reads its KV head
    logits = torch.einsum("hd,htd->ht", q, k) * s.scaling(layer)  # (H, T)
    logits = logits.masked_fill(~allowed.repeat_interleave(group, 0), float("-inf"))
    return torch.softmax(logits, -1)


@pytest.mark.parametrize("family", ["gpt2", "llama"])  # one KV head per query head, and GQA (2 query heads each)
def test_tova_evicts_the_entry_the_newest_query_attends_to_least(family, tiny_lm):
    """TOVA: after each forward, per KV head, keep the budget's entries with the most attention from the
    newest query (summed over the query heads sharing the KV head); no sinks, no recent window."""
    lm = tiny_lm(family)
    budget = 6
    lab = KVLab(lm, PROMPT, make("tova", budget))
    decided = differs_from_oldest = 0
    before = {layer: torch.zeros(lm.n_kv_heads, 0, dtype=torch.bool) for layer in range(lm.n_layers)}
    for _ in range(8):
        lab.step()
        t = lab.run.cache_length
        group = lm.n_heads // lm.n_kv_heads
        for layer in range(lm.n_layers):
            # the newest query read what was held before its forward, and itself (the prompt: everything)
            cand = torch.cat(
                [before[layer], torch.ones(lm.n_kv_heads, t - before[layer].shape[1], dtype=torch.bool)], 1
            )
            if before[layer].shape[1] == 0:
                cand[:] = True
            score = newest_row(lab, layer, cand).reshape(lm.n_kv_heads, group, t).sum(1)  # (Hkv, T)
            got = held(lab, layer)
            for g in range(lm.n_kv_heads):
                idx = cand[g].nonzero()[:, 0]
                ranked = idx[torch.argsort(score[g, idx], descending=True, stable=True)]
                if len(ranked) > budget and float(score[g, ranked[budget - 1]] - score[g, ranked[budget]]) < MARGIN:
                    continue  # a near tie: float32 may order it either way
                want = torch.zeros(t, dtype=torch.bool)
                want[ranked[:budget]] = True
                assert torch.equal(got[g], want), (layer, g, t)
                decided += 1
                dropped = set(idx.tolist()) - set(ranked[:budget].tolist())
                differs_from_oldest += bool(dropped) and dropped != set(idx[: len(dropped)].tolist())
            before[layer] = got
    assert decided >= 8 * lm.n_layers * lm.n_kv_heads * 3 // 4
    # the check discriminates: a rule by position (drop the oldest) would have failed it
    assert differs_from_oldest > 0


def test_keynorm_keeps_the_entries_with_the_lowest_key_norms(tiny_lm):
    """Key norm: per KV head, keep the budget's entries whose key has the lowest L2 norm. A key never
    changes, so after every step the held entries are the ``budget`` lowest norms of all positions so far."""
    lm = tiny_lm("llama")
    budget = 5
    lab = KVLab(lm, PROMPT, make("keynorm", budget))
    newest_dropped = False
    for _ in range(8):
        lab.step()
        t = lab.run.cache_length
        for layer in range(lm.n_layers):
            norms = lab.run.keys(layer).double().pow(2).sum(-1).sqrt()  # (Hkv, T)
            order = torch.argsort(norms, dim=1, stable=True)  # lowest first
            want = torch.zeros(lm.n_kv_heads, t, dtype=torch.bool).scatter(1, order[:, :budget], True)
            assert torch.equal(held(lab, layer), want), (layer, t)
            newest_dropped |= bool((~want[:, -1]).any())
    assert newest_dropped  # the newest entry is a candidate like any other (no recent window)
    # the check discriminates: the opposite rule (keep the highest norms) keeps other entries
    flip = torch.zeros(lm.n_kv_heads, t, dtype=torch.bool).scatter(1, order[:, -budget:], True)
    assert not torch.equal(flip, want)


class FirstChannel(Scorer):
    """Keep, per KV head, the entries whose key has the largest first channel: one layer at a time."""

    name = "first-channel"
    reads_keys = True

    def __init__(self):
        self.calls: list[tuple[int, tuple]] = []

    def score(self, seen):
        self.calls.append((seen.layer, tuple(seen.keys.shape)))
        return seen.keys[:, :, 0]  # (Hkv, Tk) float32: the policy takes it as float64


def test_a_scorer_written_here_runs_per_step_and_per_head(tiny_lm):
    lm = tiny_lm("llama")
    budget = 5
    rule = FirstChannel()
    lab = KVLab(lm, PROMPT, make(rule, budget))
    assert lab.policy.describe() == "first-channel budget 5"
    heads_differ = False
    for i in range(6):
        lab.step()
        t = lab.run.cache_length
        # called once per layer and forward, with each KV head's keys of every position so far
        assert rule.calls[-lm.n_layers :] == [(layer, (lm.n_kv_heads, t, lm.head_dim)) for layer in range(lm.n_layers)]
        assert len(rule.calls) == (i + 1) * lm.n_layers
        for layer in range(lm.n_layers):
            first = lab.run.keys(layer)[:, :, 0].double()  # (Hkv, T), fixed per entry: the top ones are held
            want = torch.zeros(lm.n_kv_heads, t, dtype=torch.bool).scatter(1, first.topk(budget, 1).indices, True)
            got = held(lab, layer)
            assert torch.equal(got, want), (layer, t)
            heads_differ |= not torch.equal(got[0], got[1])
    assert heads_differ  # each KV head decides on its own keys


class NewestQuery(Scorer):
    """TOVA written as a user would: the newest query's attention, summed over each KV head's group."""

    name = "newest-query"
    needs_attention = batched = True

    def rows(self, tq):
        return range(tq - 1, tq)

    def score(self, seen):
        a = seen.attention[..., -1, :]  # (..., H, Tk)
        return a.reshape(*seen.shape[:-1], -1, a.shape[-1]).sum(-2)  # (..., Hkv, Tk)


def test_a_registered_scorer_is_built_by_name_and_batched_like_the_built_ins(tiny_lm, monkeypatch):
    monkeypatch.setattr(registry, "SCORERS", dict(registry.SCORERS))  # the registration ends with the test
    registry.register(NewestQuery)
    lm = tiny_lm("llama")
    mine, tova = KVLab(lm, PROMPT, make("newest-query", 6)), KVLab(lm, PROMPT, make("tova", 6))
    assert [s.kl for s in mine.run_steps(8)] == [s.kl for s in tova.run_steps(8)]
    for layer in range(lm.n_layers):
        assert torch.equal(mine.policy.evicted_at[layer], tova.policy.evicted_at[layer])
    assert any(bool(held(mine, layer).logical_not().any()) for layer in range(lm.n_layers))
    with pytest.raises(InspectorError, match="name of its own"):
        registry.register(type("Nameless", (Scorer,), {}))
