"""The KV cache lab's contract: a simulated policy computes what plain transformers computes with
the policy written out independently.

Eviction: HF eager attention (the family's own ``eager_attention_forward``) with, per layer, the
per-head 4-D mask that hides each evicted entry from the query where it was evicted on.
Quantization: HF ``generate`` whose attention reads keys and values fake-quantized by the
equations written out below (KIVI: keys per channel over token groups, values per token over
channel groups, a full-precision residual window), not by the lab's code.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from gpt_inspector.core import hf
from gpt_inspector.core.kvlab import KVLab, make

PROMPT = "She eats an apple. He reads a book. They walk"
NEVER = torch.iinfo(torch.long).max

# per-layer extra blocks for the reference attention, set by each test: layer -> (1, H, T, T) bool
_BLOCKS: dict[int, torch.Tensor] = {}
# the reference fake quantization, set by each test: (bits, group, residual) or None
_QUANT: list = [None]


def _eager_of(module):
    return sys.modules[type(module).__module__].eager_attention_forward


def _evicting_attention(module, query, key, value, attention_mask, **kwargs):
    block = _BLOCKS.get(module.layer_idx)
    if block is not None:
        t = key.shape[2]
        neg = torch.finfo(query.dtype).min
        base = attention_mask[:, :, :, :t]
        attention_mask = base.expand(-1, block.shape[1], -1, -1).masked_fill(block[..., -query.shape[2] :, :t], neg)
    return _eager_of(module)(module, query, key, value, attention_mask, **kwargs)


def _ref_quant_keys(k: torch.Tensor, bits: int, group: int, n: int) -> torch.Tensor:
    """Keys (B, H, T, d): tokens [0, n) in groups of ``group``, each channel its own min and max."""
    out = k.clone()
    levels = 2**bits - 1
    for g0 in range(0, n, group):
        blk = k[:, :, g0 : g0 + group].float()  # (B, H, G, d)
        lo = blk.min(dim=2, keepdim=True).values
        hi = blk.max(dim=2, keepdim=True).values
        step = (hi - lo) / levels
        step[step == 0] = 1.0
        out[:, :, g0 : g0 + group] = ((blk - lo) / step).round().clamp(0, levels).mul(step).add(lo).to(k.dtype)
    return out


def _ref_quant_values(v: torch.Tensor, bits: int, group: int, n: int) -> torch.Tensor:
    """Values (B, H, T, d): tokens [0, n) one by one, channels in groups of ``group``."""
    out = v.clone()
    levels = 2**bits - 1
    d = v.shape[-1]
    for c0 in range(0, d, group):
        blk = v[:, :, :n, c0 : c0 + group].float()  # (B, H, n, G)
        lo = blk.min(dim=3, keepdim=True).values
        hi = blk.max(dim=3, keepdim=True).values
        step = (hi - lo) / levels
        step[step == 0] = 1.0
        out[:, :, :n, c0 : c0 + group] = ((blk - lo) / step).round().clamp(0, levels).mul(step).add(lo).to(v.dtype)
    return out


def _quant_attention(module, query, key, value, attention_mask, **kwargs):
    bits, group, residual = _QUANT[0]
    t = key.shape[2]
    if query.shape[2] < t:  # a decode step; the prompt's own forward reads full precision
        old = max(0, t - residual)
        key = _ref_quant_keys(key, bits, group, old - old % group)  # only whole groups of old tokens
        value = _ref_quant_values(value, bits, group, old)
    return _eager_of(module)(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("kvlab_evict_ref", _evicting_attention)
AttentionMaskInterface.register("kvlab_evict_ref", eager_mask)
AttentionInterface.register("kvlab_quant_ref", _quant_attention)
AttentionMaskInterface.register("kvlab_quant_ref", eager_mask)


@pytest.fixture(scope="module")
def reference_model(tiny_dir):
    cache = {}

    def get(family, impl):
        if (family, impl) not in cache:
            cache[family, impl] = AutoModelForCausalLM.from_pretrained(
                tiny_dir[family], attn_implementation=impl
            ).eval()
        return cache[family, impl]

    return get


def _policy_blocks(lab) -> dict[int, torch.Tensor]:
    """From the policy's eviction record alone: query i may not read entry j of KV head g once
    evicted_at[g, j] <= i; every query head of the group loses it."""
    lm, t = lab.lm, lab.run.cache_length
    group = lm.n_heads // lm.n_kv_heads
    blocks = {}
    for layer in range(lm.n_layers):
        ev = lab.policy.evicted_at[layer][:, :t].cpu()  # (Hkv, T), kept where the model runs
        q = torch.arange(t)[:, None]  # (T, 1)
        per_kv = ev[:, None, :] <= q[None]  # (Hkv, T, T)
        blocks[layer] = per_kv[[h // group for h in range(lm.n_heads)]][None]  # (1, H, T, T)
    return blocks


CASES = [
    ("gpt2", "streaming", {"budget": 10, "sinks": 2}),
    ("gpt2", "h2o", {"budget": 9}),
    ("gpt2", "tova", {"budget": 8}),
    ("llama", "h2o", {"budget": 9, "sinks": 1}),
    ("llama", "snapkv", {"budget": 9, "window": 3}),
    ("llama", "keynorm", {"budget": 8}),
    ("llama", "h2o", {"budget": 12, "layer_budgets": {1: [6, 10]}}),  # per-layer and per-head budgets
    ("gemma2", "streaming", {"budget": 7, "sinks": 1}),
    ("gemma2", "h2o", {"budget": 8}),
    ("gemma2", "tova", {"budget": 7}),
]


@pytest.mark.parametrize("family,name,opts", CASES)
def test_eviction_equals_hf_eager_with_per_head_4d_masks(family, name, opts, tiny_lm, reference_model):
    lm = tiny_lm(family)
    budget = opts.pop("budget")
    lab = KVLab(lm, PROMPT, make(name, budget, **opts), free_running=True)
    lab.run_steps(10)
    run = lab.run
    ev_total = sum(int((lab.policy.evicted_at[i] < NEVER).sum()) for i in range(lm.n_layers))
    assert ev_total > 0, "the budget must evict something or the test proves nothing"
    _BLOCKS.clear()
    _BLOCKS.update(_policy_blocks(lab))
    try:
        with torch.no_grad():
            ref = reference_model(family, "kvlab_evict_ref")(torch.tensor([run.processed_tokens])).logits[0]  # (T, V)
    finally:
        _BLOCKS.clear()
    for st in run.steps_done:
        np.testing.assert_allclose(st.logits.numpy(), ref[st.position].numpy(), atol=2e-5, rtol=0)
    # and the comparison can fail: without the masks the reference differs
    with torch.no_grad():
        plain = reference_model(family, "kvlab_evict_ref")(torch.tensor([run.processed_tokens])).logits[0]
    assert max(float((st.logits - plain[st.position]).abs().max()) for st in run.steps_done) > 1e-3


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
@pytest.mark.parametrize("bits,group,residual", [(4, 4, 3), (2, 8, 5), (2, 4, 0)])
def test_quantized_run_equals_generate_with_independent_fake_quant(
    family, bits, group, residual, tiny_lm, reference_model
):
    lm = tiny_lm(family)
    lab = KVLab(lm, PROMPT, make(f"int{bits}", group=group, residual=residual), free_running=True)
    lab.run_steps(12)
    ids = torch.tensor([lab.run.prompt_ids])
    _QUANT[0] = (bits, group, residual)
    with torch.no_grad():
        # a plain full-length cache in every layer, as the session keeps: the reference quantizes
        # by absolute position, and a sliding layer's own cache would hold only its window
        ref = reference_model(family, "kvlab_quant_ref")
        g = ref.generate(
            ids, **{hf.cache_kwarg(getattr(ref, "_model", ref)): DynamicCache()}, do_sample=False, max_new_tokens=12, output_logits=True, return_dict_in_generate=True,
            pad_token_id=lm.eos_token_ids[0])  # fmt: skip
    n = len(lab.run.steps_done)
    assert lab.run.tokens == g.sequences[0].tolist()[: len(lab.run.tokens)]
    for st, logits in zip(lab.run.steps_done, g.logits[:n]):
        np.testing.assert_allclose(st.logits.numpy(), logits[0].numpy(), atol=2e-5, rtol=0)
    # the quantization matters at this setting: the full-cache reference's logits differ
    worst = max(float((a.logits - b.logits).abs().max()) for a, b in zip(lab.run.steps_done, lab.reference.steps_done))
    assert worst > 1e-4


@pytest.mark.parametrize("name", ["fp8-e4m3", "fp8-e5m2"])
def test_fp8_is_an_elementwise_cast_round_trip(name, tiny_lm):
    lm = tiny_lm("llama")
    lab = KVLab(lm, PROMPT, make(name, residual=2))
    lab.run_steps(4)
    dt = torch.float8_e4m3fn if name == "fp8-e4m3" else torch.float8_e5m2
    t = lab.run.cache_length
    for layer in range(lm.n_layers):
        full = lab.run.cache.layers[layer].keys[0, :, :t].cpu()  # (Hkv, T, d) full precision, beside the records
        read = lab.run.keys(layer)
        old = t - 2  # the last forward read t entries; its residual window held the newest 2
        torch.testing.assert_close(read[:, :old], full[:, :old].to(dt).to(full.dtype), rtol=0, atol=0)
        torch.testing.assert_close(read[:, old:], full[:, old:], rtol=0, atol=0)


# transformers refuses a QuantizedCache on sliding-window models (Gemma 2); qwen2 has one KV head
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
@pytest.mark.parametrize("bits,group,residual", [(4, 4, 3), (2, 8, 5), (2, 4, 1)])
def test_transformers_scheme_equals_transformers_quantized_cache_with_quanto(family, bits, group, residual, tiny_lm,
                                                                             reference_model):  # fmt: skip
    """transformers' own QuantizedCache (quanto backend), not a copy of it: same tokens, same logits."""
    pytest.importorskip("optimum.quanto")
    lm = tiny_lm(family)
    lab = KVLab(
        lm, PROMPT, make(f"int{bits}", group=group, residual=residual, scheme="transformers"), free_running=True
    )
    lab.run_steps(12)
    ids = torch.tensor([lab.run.prompt_ids])
    with torch.no_grad():
        g = reference_model(family, "eager").generate(
            ids, do_sample=False, max_new_tokens=12, output_logits=True, return_dict_in_generate=True,
            cache_implementation="quantized", pad_token_id=lm.eos_token_ids[0],
            cache_config={"backend": "quanto", "nbits": bits, "q_group_size": group, "residual_length": residual,
                          "axis_key": 0, "axis_value": 0})  # fmt: skip
    n = len(lab.run.steps_done)
    assert lab.run.tokens == g.sequences[0].tolist()[: len(lab.run.tokens)]
    for st, logits in zip(lab.run.steps_done, g.logits[:n]):
        np.testing.assert_allclose(st.logits.numpy(), logits[0].numpy(), atol=2e-5, rtol=0)
    worst = max(float((a.logits - b.logits).abs().max()) for a, b in zip(lab.run.steps_done, lab.reference.steps_done))
    assert worst > 1e-4  # the quantization matters at this setting
    # and the KIVI scheme is a different cache: its logits differ from transformers'
    kivi = KVLab(lm, PROMPT, make(f"int{bits}", group=group, residual=residual), free_running=True)
    kivi.run_steps(4)
    assert max(float((a.logits - b[0]).abs().max()) for a, b in zip(kivi.run.steps_done, g.logits)) > 1e-5


def test_snapkv_keeps_the_top_pooled_votes_of_hf_eager_attention(tiny_lm, reference_model):
    """SnapKV's choice from HF's own attention probabilities (output_attentions), written out."""
    import torch.nn.functional as F

    lm = tiny_lm("llama")
    budget, window = 9, 3
    lab = KVLab(lm, PROMPT, make("snapkv", budget, window=window))
    lab.step()
    p = lab.run.prompt_length
    with torch.no_grad():
        att = reference_model("llama", "eager")(torch.tensor([lab.run.prompt_ids]), output_attentions=True).attentions
    group = lm.n_heads // lm.n_kv_heads
    for layer in range(lm.n_layers):
        votes = att[layer][0, :, p - window :, : p - window].double().sum(1)  # (H, P - w)
        votes = votes.reshape(lm.n_kv_heads, group, -1).sum(1)  # (Hkv, P - w)
        pooled = F.avg_pool1d(votes[:, None], 5, stride=1, padding=2, count_include_pad=False)[:, 0]
        for g in range(lm.n_kv_heads):
            top = set(torch.topk(pooled[g], budget - window).indices.tolist()) | set(range(p - window, p))
            kept = set((~torch.as_tensor(lab.evicted(layer)[g])).nonzero()[:, 0].tolist())
            assert kept == top, (layer, g)
