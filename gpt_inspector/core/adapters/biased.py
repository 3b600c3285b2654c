"""Families that add a per-head bias to the attention scores: BLOOM and MPT (ALiBi), doge.

The bias is recorded compactly as part of the scores (``attention.ScoreBias``): ALiBi as the
model's per-head slopes plus the key position each query row's bias is measured from, doge's
dynamic mask as one value per head and key. Each adapter checks, at every forward, that the
model's own bias tensor is exactly that compact form, so a change in transformers cannot make
the recorded scores differ silently from the ones the model used.
"""

from __future__ import annotations

import torch

from .. import capture, hf
from . import register
from ._common import attend, blocked_to_additive, patch


def _check_alibi(values: torch.Tensor, slopes: torch.Tensor, ref: int, family: str) -> None:
    """values (H, Tk) must be slopes[h] × (j − ref) exactly, as the recorded form derives it."""
    tk = values.shape[-1]
    want = slopes.float()[:, None] * (torch.arange(tk, device=values.device, dtype=torch.float32) - ref)[None, :]
    if not torch.equal(values.float(), want.to(values.dtype).float()):
        raise NotImplementedError(f"{family}'s ALiBi bias is not slope × (key position − {ref}) (padded input?)")


@register("bloom")
def bloom(model) -> None:
    bloom_mod = hf.family_module("bloom")
    _get_alibi_slopes, dropout_add = bloom_mod._get_alibi_slopes, bloom_mod.dropout_add

    # scores = β·alibi + (q·kᵀ)/√d (baddbmm), alibi[h, j] = slope_h × j over the key positions
    def forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):  # fmt: skip
        b, tq, _ = hidden_states.shape
        fused_qkv = self.query_key_value(hidden_states)  # (B, Tq, 3 D)
        query, key, value = self._reshape(fused_qkv)  # (B, H, Tq, d) each
        if layer_past is not None:
            key, value = layer_past.update(key, value, self.layer_idx)  # (B, H, Tk, d)
        tk = key.shape[-2]
        values = alibi.view(b, self.num_heads, 1, tk) * self.beta  # (B, H, 1, Tk)
        slopes = _get_alibi_slopes(self.num_heads, alibi.device) * self.beta  # (H,)
        _check_alibi(values[0, :, 0], slopes, 0, "BLOOM")
        bias = capture.AppliedBias("alibi", values, slopes=slopes, ref=torch.zeros(tq), batch=b)
        out, probs = attend(self.layer_idx, query, key, value, attention_mask, self.inv_norm_factor, score_bias=bias)
        context = out.permute(0, 2, 1, 3).reshape(b, tq, self.num_heads * self.head_dim)  # (B, Tq, D)
        if self.pretraining_tp > 1 and self.slow_but_exact:
            slices = self.hidden_size / self.pretraining_tp
            output = torch.zeros_like(context)
            for i in range(self.pretraining_tp):
                output = output + torch.nn.functional.linear(
                    context[:, :, int(i * slices) : int((i + 1) * slices)],
                    self.dense.weight[:, int(i * slices) : int((i + 1) * slices)],
                )
        else:
            output = self.dense(context)
        return dropout_add(output, residual, self.hidden_dropout, self.training), probs

    for block in model.transformer.h:
        patch(block.self_attention, "forward", forward)


@register("mpt")
def mpt(model) -> None:
    build_mpt_alibi_tensor = hf.family_module("mpt").build_mpt_alibi_tensor

    bias_max = model.config.attn_config.alibi_bias_max
    # MPT's alibi row is slope × (j − (Tk − 1)): measured from the forward's last key, not the query
    slopes = -build_mpt_alibi_tensor(model.config.n_heads, 2, bias_max)[:, 0, 0].float()  # (H,)

    # transformers 5.24 passes the cache as ``cache``, earlier releases as ``past_key_values``
    def forward(self, hidden_states, position_bias, cache=None, attention_mask=None, past_key_values=None, **kwargs):
        cache = hf.cache_arg(cache, past_key_values)
        b, tq = hidden_states.shape[:2]
        mixed_qkv = self.Wqkv(hidden_states)  # (B, Tq, 3 D)
        if self.clip_qkv:
            mixed_qkv = mixed_qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        query, key, value = mixed_qkv.chunk(3, dim=2)
        query = query.reshape(b, tq, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, Tq, d)
        key = key.reshape(b, tq, self.n_heads, self.head_dim).transpose(1, 2)
        value = value.reshape(b, tq, self.n_heads, self.head_dim).transpose(1, 2)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)  # (B, H, Tk, d)
        tk = key.shape[-2]
        bias = None
        if position_bias is not None:
            values = position_bias[:, max(0, position_bias.size(1) - tk) :, max(0, position_bias.size(2) - tk) :]
            s = slopes.to(values.device)
            _check_alibi(values[:, 0], s, tk - 1, "MPT")  # (H, Tk)
            bias = capture.AppliedBias("alibi", values[None], slopes=s, ref=torch.full((tq,), float(tk - 1)), batch=b)
        mask = blocked_to_additive(attention_mask, query.dtype)  # (B, 1, Tq, Tk)
        out, probs = attend(self.layer_idx, query, key, value, mask, self.softmax_scale, score_bias=bias)
        context = out.permute(0, 2, 1, 3).contiguous().view(b, tq, -1)  # (B, Tq, D)
        return self.out_proj(context), probs

    for block in model.transformer.blocks:
        patch(block.attn, "forward", forward)


@register("doge")
def doge(model) -> None:
    # doge passes its learned per-head, per-key bias (and a per-head top-k window) as the mask it
    # hands the attention interface; the capture needs the bias itself to tell the two apart.
    #
    # The top-k is torch.topk over the key axis of the forward at hand, so where biases tie (HF
    # initialises A to 0: every bias exp(0) = 1; bfloat16 rounds many alike) which tied key it keeps
    # depends on how many keys that forward has. generate runs the prompt, then one token at a time
    # against the model's own cache, whose sliding-window layers hold only the last window - 1 keys;
    # the session's cache keeps every position. So the top-k runs here over exactly the keys the
    # model's own cache would hand this forward (the rest lie outside the window, masked anyway):
    # the weights shown are generate's, while a full-sequence forward may keep other tied keys.
    windows = [hf.layer_config_value(model.config, "sliding_window", i) for i in range(len(model.model.layers))]

    def prepare_dynamic_mask(self, hidden_states, dt_states, keep_window_size=2048, attention_mask=None):
        self.__dict__[capture.KEY_BIAS_ATTR] = dt_states  # (B, Hkv, Tk)
        own, window = type(self).prepare_dynamic_mask, windows[self.layer_idx]
        tq, tk = hidden_states.shape[1], dt_states.shape[-1]
        reach = tk if window is None else min(tk, window - 1 + tq)  # the keys a sliding cache layer returns
        if reach == tk or not isinstance(attention_mask, torch.Tensor):
            return own(self, hidden_states, dt_states, keep_window_size, attention_mask)
        tail = own(self, hidden_states, dt_states[..., tk - reach :], keep_window_size,
                   attention_mask[..., :tk][..., tk - reach :])  # (B, Hkv, Tq, reach)  # fmt: skip
        # the keys before the window: masked, as the sliding mask masks them
        gone = tail.new_full((*tail.shape[:-1], tk - reach), torch.finfo(hidden_states.dtype).min)
        return torch.cat([gone, tail], dim=-1)  # (B, Hkv, Tq, Tk)

    for layer in model.model.layers:
        patch(layer.self_attn, "prepare_dynamic_mask", prepare_dynamic_mask)
