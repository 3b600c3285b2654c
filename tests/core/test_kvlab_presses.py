"""A press (kvpress's scoring interface) as a lab policy, on kvpress's semantics, against kvpress's
procedure written out here in plain transformers: the context prefilled, its cache cut to the press's
``topk`` per KV head, the question and the greedy answer run on the cut cache."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import DynamicCache

from gpt_inspector.core import InspectorError
from gpt_inspector.core.hf import call
from gpt_inspector.core.kvlab import KVLab, from_press, presses

PROMPT = "She eats an apple. He reads a book. They walk to the park. The cat sat on the mat and"
CONTEXT = 14
STEPS = 3


@dataclass
class ValueNorm:
    """A press written here: the entries whose values are longest kept."""

    compression_ratio: float = 0.5

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        return values.norm(dim=-1)  # (1, Hkv, C)


def hf_press_run(hf, ids: list[int], context: int, score_of, ratio: float, steps: int):
    """kvpress's pipeline in plain transformers: (kept (L, Hkv, C) bool, logits (steps, V))."""
    ctx = torch.tensor([ids[:context]])
    cache = DynamicCache()
    with torch.no_grad():
        call(hf, cache, input_ids=ctx, use_cache=True)  # the cache under this release's keyword
    kept = []
    for layer in cache.layers:
        k, v = layer.keys, layer.values  # (1, Hkv, C, d)
        n = max(1, int(context * (1 - ratio)))
        idx = score_of(k, v).topk(n, dim=-1).indices  # (1, Hkv, n)
        mask = torch.zeros(k.shape[:3], dtype=torch.bool).scatter_(-1, idx, True)
        kept.append(mask[0])
        gather = idx[..., None].expand(-1, -1, -1, k.shape[-1])
        layer.keys, layer.values = k.gather(2, gather), v.gather(2, gather)
    logits = []
    with torch.no_grad():
        pos = torch.arange(context, len(ids))[None]
        out = call(hf, cache, input_ids=torch.tensor([ids[context:]]), position_ids=pos)
        for i in range(steps):
            logits.append(out.logits[0, -1].float())
            nxt = out.logits[0, -1].argmax()
            out = call(hf, cache, input_ids=nxt.view(1, 1), position_ids=torch.tensor([[len(ids) + i]]))
    return torch.stack(kept), torch.stack(logits)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])  # GQA 2:1, GQA 4:1, no GQA and no RoPE
def test_a_press_written_here_keeps_its_topk_and_the_answer_reads_only_those(family, tiny_lm, hf_eager):
    lm = tiny_lm(family)
    policy = from_press(ValueNorm(0.5), context=CONTEXT)
    lab = KVLab(lm, PROMPT, policy, free_running=True)
    for _ in range(STEPS):
        lab.step()
    ids = lab.run.prompt_ids
    kept, logits = hf_press_run(hf_eager(family), ids, CONTEXT, lambda k, v: v.norm(dim=-1), 0.5, STEPS)
    t = lab.run.cache_length
    for layer in range(lm.n_layers):
        held = ~policy.evicted(layer, t)
        assert torch.equal(held[:, :CONTEXT], kept[layer]), f"layer {layer}: kept sets differ"
        assert bool(held[:, CONTEXT:].all()), "the question and the answer are never evicted"
        assert int(held[:, :CONTEXT].sum(1).max()) == CONTEXT // 2
    ours = torch.stack([s.logits.float() for s in lab.run.steps_done])  # (steps, V)
    assert float((ours - logits).abs().max()) < 1e-4
    # the cut matters: the full cache's answer is not the press's
    assert float((torch.stack([s.logits.float() for s in lab.reference.steps_done]) - logits).abs().max()) > 1e-2


def test_kvlab_copy_of_knorm_is_the_key_norm_rule(tiny_lm, hf_eager):
    """The lab's copy of KnormPress against its rule written out: the lowest key norms kept."""
    lm = tiny_lm("llama")
    policy = from_press(presses.KnormPress(0.5), context=CONTEXT)
    lab = KVLab(lm, PROMPT, policy, free_running=True)
    for _ in range(STEPS):
        lab.step()
    kept, logits = hf_press_run(hf_eager("llama"), lab.run.prompt_ids, CONTEXT, lambda k, v: -k.norm(dim=-1), 0.5,
                                STEPS)  # fmt: skip
    for layer in range(lm.n_layers):
        assert torch.equal(~policy.evicted(layer, lab.run.cache_length)[:, :CONTEXT], kept[layer])
    assert float((torch.stack([s.logits.float() for s in lab.run.steps_done]) - logits).abs().max()) < 1e-4


def test_every_step_keeps_the_ratio_of_the_sequence_per_head(tiny_lm):
    """Decoding eviction (every=1): after each step every KV head holds int(T * (1 - ratio)) entries,
    the best-scoring of those it still held, by the press's score written out here."""
    lm = tiny_lm("llama")
    policy = from_press(ValueNorm(0.5), every=1)
    lab = KVLab(lm, PROMPT, policy)
    for _ in range(4):
        before = [~policy.evicted(layer, lab.run.cache_length) for layer in range(lm.n_layers)]
        lab.step()
        t = lab.run.cache_length
        if len(lab.history) == 1:
            continue  # the prompt's forward: compressed once as the context
        for layer in range(lm.n_layers):
            held = ~policy.evicted(layer, t)  # (Hkv, T)
            assert held.sum(1).tolist() == [int(t * 0.5)] * lm.n_kv_heads
            v = lab.run.values(layer)[:, :t].norm(dim=-1)  # (Hkv, T)
            cand = torch.cat([before[layer], torch.ones(lm.n_kv_heads, 1, dtype=torch.bool)], 1)
            want = v.masked_fill(~cand, -1).topk(int(t * 0.5), dim=-1).indices
            assert torch.equal(held, torch.zeros_like(held).scatter_(1, want, True))


def test_a_broken_press_is_one_line(tiny_lm):
    lm = tiny_lm("llama")

    class Wrong:
        compression_ratio = 0.5

        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            return keys.norm(dim=-1)[0]  # the batch dimension lost

    with pytest.raises(InspectorError, match=r"Wrong.score returned \(2, 14\)"):
        KVLab(lm, PROMPT, from_press(Wrong(), context=CONTEXT)).step()
    with pytest.raises(InspectorError, match="has no score"):
        from_press(object())
    with pytest.raises(InspectorError, match="context is 99 tokens"):
        KVLab(lm, PROMPT, from_press(ValueNorm(), context=99)).step()
