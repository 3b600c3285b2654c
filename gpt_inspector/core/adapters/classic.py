"""Families that compute plain softmax attention in their own modules (no score bias)."""

from __future__ import annotations

import math

import torch

from .. import hf
from . import register
from ._common import allowed_to_additive, attend, patch


def _upcast(query, key, value):
    # GPT-J, GPT-Neo and CodeGen compute scores in float32 whatever the model's dtype
    return query.to(torch.float32), key.to(torch.float32), value.to(torch.float32)


def _scaled_attn(self, query, key, value, attention_mask=None):
    """GPT-J's and CodeGen's attention core: float32 scores divided by their scale_attn."""
    q, k, v = _upcast(query, key, value)
    out, probs = attend(self.layer_idx, q, k, v, attention_mask, 1.0 / self.scale_attn)  # (B, H, Tq, d)
    return out.to(value.dtype), probs


# CodeGen adds the mask before dividing by sqrt(d): a masked score stays far below any allowed one,
# so the same core as GPT-J's gives its numbers
@register("gptj")
@register("codegen")
def gptj(model) -> None:
    for block in model.transformer.h:
        patch(block.attn, "_attn", _scaled_attn)


@register("gpt_neo")
def gpt_neo(model) -> None:
    # no scaling; "local" layers cut keys further back than window_size with their own causal buffer
    def _attn(self, query, key, value, attention_mask=None):
        q, k, v = _upcast(query, key, value)
        tq, tk = q.shape[-2], k.shape[-2]
        own = self.bias[:, :, tk - tq : tk, :tk]  # (1, 1, Tq, Tk) bool: allowed
        low = torch.finfo(torch.float32).min
        base = allowed_to_additive(attention_mask, torch.float32)  # (B, 1, Tq, Tk) or None
        base = torch.zeros((), dtype=torch.float32, device=q.device) if base is None else base
        mask = torch.where(own, base, low)  # (B, 1, Tq, Tk)
        out, probs = attend(self.layer_id, q, k, v, mask, 1.0)  # (B, H, Tq, d)
        return out.to(value.dtype), probs

    for block in model.transformer.h:
        patch(block.attn.attention, "_attn", _attn)


@register("gpt_neox_japanese")
def gpt_neox_japanese(model) -> None:
    def _attn(self, query, key, value, attention_mask=None):
        return attend(self.layer_idx, query, key, value, attention_mask, 1.0 / self.norm_factor)  # (B, H, Tq, d), probs

    for layer in model.gpt_neox_japanese.layers:
        patch(layer.attention, "_attn", _attn)


@register("xglm")
def xglm(model) -> None:
    # XGLM scales the query before q·kᵀ, so attention sees the scaled query and scaling 1; the cache
    # comes as ``cache`` from transformers 5.24, as ``past_key_values`` before
    def forward(self, hidden_states, key_value_states=None, cache=None, attention_mask=None, past_key_values=None,
                **kwargs):  # fmt: skip
        cache = hf.cache_arg(cache, past_key_values)
        if key_value_states is not None:
            raise NotImplementedError("gpt-inspector's XGLM adapter handles self-attention only")
        bsz, tgt_len, _ = hidden_states.size()
        query = (self.q_proj(hidden_states) * self.scaling).view(bsz, tgt_len, self.num_heads, self.head_dim)
        query = query.transpose(1, 2)  # (B, H, Tq, d)
        key = self.k_proj(hidden_states).view(bsz, tgt_len, -1, self.head_dim).transpose(1, 2)  # (B, H, Tq, d)
        value = self.v_proj(hidden_states).view(bsz, tgt_len, -1, self.head_dim).transpose(1, 2)
        if cache is not None:
            if isinstance(cache, hf.EncoderDecoderCache):
                cache = cache.self_attention_cache
            key, value = cache.update(key, value, self.layer_idx)  # (B, H, Tk, d)
        out, probs = attend(self.layer_idx, query, key, value, attention_mask, 1.0)  # (B, H, Tq, d)
        out = out.transpose(1, 2).reshape(bsz, tgt_len, self.embed_dim)  # (B, Tq, D)
        return self.out_proj(out), probs

    for layer in model.model.layers:
        patch(layer.self_attn, "forward", forward)


def _falcon_limit(config) -> str | None:
    if getattr(config, "alibi", False):
        return ("Falcon with ALiBi: transformers' eager attention adds the ALiBi bias twice (once to the "
                "scores, once in the mask) while its sdpa path adds it once, so the model has no single output")  # fmt: skip
    return None


@register("falcon", limit=_falcon_limit)
def falcon(model) -> None:
    apply_rotary_pos_emb = hf.family_module("falcon").apply_rotary_pos_emb

    def forward(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None, use_cache=False,
                output_attentions=False, position_embeddings=None, **kwargs):  # fmt: skip
        if alibi is not None:
            raise NotImplementedError("gpt-inspector's Falcon adapter handles rotary Falcon only")
        fused_qkv = self.query_key_value(hidden_states)  # (B, Tq, (H + 2 Hkv) d)
        num_kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
        query, key, value = self._split_heads(fused_qkv)
        b, tq = query.shape[:2]
        query = query.transpose(1, 2).reshape(b, self.num_heads, tq, self.head_dim)  # (B, H, Tq, d)
        key = key.transpose(1, 2).reshape(b, num_kv_heads, tq, self.head_dim)  # (B, Hkv, Tq, d)
        value = value.transpose(1, 2).reshape(b, num_kv_heads, tq, self.head_dim)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if layer_past is not None:
            key, value = layer_past.update(key, value, self.layer_idx)  # (B, Hkv, Tk, d)
        out, probs = attend(self.layer_idx, query, key, value, attention_mask, 1.0 / math.sqrt(self.head_dim))
        out = out.permute(0, 2, 1, 3).reshape(b, tq, self.num_heads * self.head_dim)  # (B, Tq, H d)
        return self.dense(out), probs

    for block in model.transformer.h:
        patch(block.self_attention, "forward", forward)
