"""The lockstep invariant under serving constraints: a run under a schedule, whole pages or AdaKV's shared
budget computes what HF eager computes with the same kept sets written as per-head 4-D masks (the entry
evicted after the forward that left T positions is hidden from query T on)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from gpt_inspector.core.kvlab import KVLab, make

PROMPT = "She eats an apple. He reads a book. They walk"
NEVER = torch.iinfo(torch.long).max
_BLOCKS: dict[int, torch.Tensor] = {}  # layer -> (1, H, T, T) bool, set by the test


def _masked_eager(module, query, key, value, attention_mask, **kwargs):
    block = _BLOCKS.get(module.layer_idx)
    if block is not None:
        t = key.shape[2]
        base = attention_mask[:, :, :, :t]
        attention_mask = base.expand(-1, block.shape[1], -1, -1).masked_fill(
            block[..., -query.shape[2] :, :t], torch.finfo(query.dtype).min
        )
    return sys.modules[type(module).__module__].eager_attention_forward(
        module, query, key, value, attention_mask, **kwargs
    )


AttentionInterface.register("kvlab_serving_ref", _masked_eager)
AttentionMaskInterface.register("kvlab_serving_ref", eager_mask)


@pytest.mark.parametrize(
    "family,name,opts",
    [
        ("gpt2", "h2o", {"budget": 12, "schedule": 3, "page": 4}),
        ("llama", "tova", {"budget": 8, "share": "layer"}),
        ("llama", "keynorm", {"budget": 8, "page": 2, "share": "layer", "schedule": 2}),
        ("gpt2", "streaming", {"budget": 10, "sinks": 2, "schedule": "prefill"}),
    ],
)
def test_scheduled_paged_shared_runs_equal_hf_eager_with_the_kept_sets_as_masks(family, name, opts, tiny_lm, tiny_dir):
    lm = tiny_lm(family)
    budget = opts.pop("budget")
    lab = KVLab(lm, PROMPT, make(name, budget, **opts), free_running=True)
    lab.run_steps(10)
    run, t = lab.run, lab.run.cache_length
    group = lm.n_heads // lm.n_kv_heads
    q = torch.arange(t)[:, None]  # (T, 1)
    evicted = 0
    for layer in range(lm.n_layers):
        ev = lab.policy.evicted_at[layer][:, :t].cpu()  # (Hkv, T)
        evicted += int((ev < NEVER).sum())
        per_kv = ev[:, None, :] <= q[None]  # (Hkv, T, T): query i may not read entry j once evicted_at <= i
        _BLOCKS[layer] = per_kv[[h // group for h in range(lm.n_heads)]][None]  # (1, H, T, T)
    assert evicted > 0, "the budget must evict something or the test proves nothing"
    ref_model = AutoModelForCausalLM.from_pretrained(tiny_dir[family], attn_implementation="kvlab_serving_ref").eval()
    try:
        with torch.no_grad():
            ref = ref_model(torch.tensor([run.processed_tokens])).logits[0]  # (T, V)
    finally:
        _BLOCKS.clear()
    for st in run.steps_done:
        np.testing.assert_allclose(st.logits.numpy(), ref[st.position].numpy(), atol=2e-5, rtol=0)
    with torch.no_grad():  # and the masks matter: without them the logits differ
        plain = ref_model(torch.tensor([run.processed_tokens])).logits[0]
    assert max(float((st.logits - plain[st.position]).abs().max()) for st in run.steps_done) > 1e-3
