"""kvpress's presses (NVIDIA kvpress 0.5.5) written again here, operation for operation, in its own
scoring interface: ``score(module, hidden_states, keys, values, attentions, kwargs) -> (B, Hkv, T)``,
higher kept, and a ``compression_ratio``. ``press_policy.from_press`` runs them (or any object with
that interface, kvpress's own classes included) in the lab, on kvpress's semantics.

They are copies of kvpress's rules, not of its code paths: nothing here imports kvpress or patches
the model. The operations are kept in kvpress's order and dtypes so that the scores, and so the kept
sets (``topk`` of the same numbers), are the same to the bit on the same inputs; the comparison
against kvpress itself is ``scripts/kvpress_compare.py`` (see the README's comparison table).

``module`` is the model's attention module (``q_proj``, ``head_dim``, ``config``, ``layer_idx`` and,
set by the adapter as kvpress sets it, ``rotary_emb``); ``kwargs`` carries ``position_embeddings``
(cos, sin) of the compressed positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def compute_n_kept(k_len: int, compression_ratio: float) -> int:
    """kvpress's count of entries kept per KV head: none at a ratio of 1, else at least one."""
    if compression_ratio >= 1.0:
        return 0
    return max(1, int(k_len * (1 - compression_ratio)))


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, Hkv, T, d) -> (B, Hkv * n_rep, T, d): each KV head once per query head reading it."""
    b, h, t, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def prerope_queries(module, hidden_states: torch.Tensor) -> torch.Tensor:
    """(B, H, T, d) the queries before RoPE, as kvpress's ``get_prerope_query_states`` takes them:
    a fused ``qkv_proj`` (Phi-3) or ``q_proj``, then a per-head ``q_norm`` where the module has one."""
    bsz, q_len, _ = hidden_states.shape
    num_heads, head_dim = module.config.num_attention_heads, module.head_dim
    if hasattr(module, "qkv_proj"):
        q = module.qkv_proj(hidden_states)[..., : num_heads * head_dim]
    elif hasattr(module, "q_proj"):
        q = module.q_proj(hidden_states)
    else:
        raise NotImplementedError(f"this press reads q_proj, which {type(module).__name__} has not")
    q = q.view(bsz, q_len, num_heads, head_dim).transpose(1, 2)  # (B, H, T, d)
    if hasattr(module, "q_norm"):  # Qwen3, Gemma 3: normalised per head before RoPE
        q = module.q_norm(q)
    return q


@dataclass
class ScorerPress:
    """The shape of kvpress's ``ScorerPress``: keep, per KV head, the ``topk`` of ``score``."""

    compression_ratio: float = 0.0

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class StreamingLLMPress(ScorerPress):
    """The first ``n_sink`` entries and the newest rest of the budget."""

    n_sink: int = 4

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        k_len = keys.shape[2]
        if k_len <= self.n_sink:
            raise ValueError(f"the context holds {k_len} tokens, not more than n_sink={self.n_sink}")
        n_pruned = k_len - int(k_len * (1 - self.compression_ratio))
        scores = torch.ones_like(keys[..., 0])  # (B, Hkv, T)
        scores[:, :, self.n_sink : self.n_sink + n_pruned] = 0
        return scores


def window_attention(module, hidden_states, keys, window_size: int, position_embeddings) -> torch.Tensor:
    """(B, H, w, T - w): the last ``window_size`` queries' attention over the entries before the window,
    recomputed from the hidden states (kvpress's ``SnapKVPress.compute_window_attention``)."""
    k_len = keys.shape[2]
    n_rep = module.config.num_attention_heads // module.config.num_key_value_heads
    q = prerope_queries(module, hidden_states[:, -window_size:])  # (B, H, w, d)
    cos, sin = position_embeddings
    cos, sin = cos[:, -window_size:], sin[:, -window_size:]
    q = (q * cos.unsqueeze(1)) + (_rotate_half(q) * sin.unsqueeze(1))
    k = _repeat_kv(keys, n_rep)
    w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(module.head_dim)  # (B, H, w, T)
    mask = torch.triu(torch.ones_like(w) * float("-inf"), diagonal=k_len - window_size + 1)
    w += mask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return w[..., :-window_size]


@dataclass
class SnapKVPress(ScorerPress):
    """The last ``window_size`` queries vote (mean over them), pooled over ``kernel_size`` neighbours with the
    padding counted, averaged over a KV head's query heads; the window itself is always kept."""

    window_size: int = 64
    kernel_size: int = 5

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        bsz, hkv, k_len, _ = keys.shape
        groups = module.config.num_attention_heads // hkv
        if hidden_states.shape[1] <= self.window_size:
            raise ValueError(f"the context holds {hidden_states.shape[1]} tokens, not more than the window "
                             f"of {self.window_size}")  # fmt: skip
        if attentions is not None:
            w = attentions[..., -self.window_size :, : -self.window_size]
        else:
            w = window_attention(module, hidden_states, keys, self.window_size, kwargs["position_embeddings"])
        scores = w.mean(dim=-2)  # (B, H, T - w)
        scores = F.avg_pool1d(scores, kernel_size=self.kernel_size, padding=self.kernel_size // 2, stride=1)
        scores = scores.view(bsz, hkv, groups, k_len - self.window_size).mean(2)  # (B, Hkv, T - w)
        return F.pad(scores, (0, self.window_size), value=scores.max().item() + 1)


@dataclass
class KnormPress(ScorerPress):
    """The lowest key norms kept (a low norm goes with high attention), in at least float32."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        dtype = torch.promote_types(keys.dtype, torch.float32)
        return -torch.linalg.vector_norm(keys, dim=-1, dtype=dtype)


@dataclass
class TOVAPress(ScorerPress):
    """The last context query's attention, averaged over all query heads (one ranking for the layer, the
    same for every KV head); the last entry always kept."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        if attentions is not None:
            w = attentions[..., -1:, :-1]
        else:
            w = window_attention(module, hidden_states, keys, 1, kwargs["position_embeddings"])
        scores = w.mean(1)  # (B, 1, T - 1)
        scores = scores.repeat(1, keys.shape[1], 1)  # (B, Hkv, T - 1)
        return F.pad(scores, (0, 1), value=scores.max().item() + 1)


@dataclass
class ObservedAttentionPress(ScorerPress):
    """The attention an entry received from every context query, divided by how many queries could see it,
    averaged over a KV head's query heads (needs the attention weights: eager)."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        if attentions is None:
            raise ValueError(
                "ObservedAttentionPress reads the attention weights: build the policy with attentions=True"
            )
        scores = attentions.sum(2)  # (B, H, T)
        bsz, hkv, n, _ = keys.shape
        scores = scores / torch.arange(n, 0, -1).to(attentions.device, attentions.dtype)
        return scores.view(bsz, hkv, -1, n).mean(2)


@dataclass
class ExpectedAttentionPress(ScorerPress):
    """The attention future queries are expected to pay: the context queries' mean and covariance (past the
    sinks), rotated by RoPE averaged over the next ``n_future_positions``, times the value norm."""

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def query_statistics(self, module, hidden_states):
        q_len = hidden_states.shape[1]
        h = hidden_states[:, self.n_sink :]
        q = prerope_queries(module, h)  # (B, H, T', d)
        mu = q.mean(dim=2, keepdim=True)
        cov = None
        if self.use_covariance:
            c = q - mu
            cov = torch.einsum("bnsi,bnsj->bnij", c, c) / h.shape[1]  # (B, H, d, d)
        return self.average_rope(module, mu.squeeze(2), cov, q_len)

    def average_rope(self, module, mu, cov, q_len: int):
        pos = torch.arange(q_len, q_len + self.n_future_positions).unsqueeze(0).to(mu.device)
        d = module.head_dim
        cos, sin = module.rotary_emb(mu, pos)
        cos, sin = cos[0], sin[0]  # (n, d)
        eye = torch.eye(d, device=cos.device, dtype=cos.dtype)
        p = torch.zeros((d, d), device=cos.device, dtype=cos.dtype)
        p[d // 2 :, : d // 2], p[: d // 2, d // 2 :] = torch.eye(d // 2), -torch.eye(d // 2)
        r = (cos.unsqueeze(1) * eye + sin.unsqueeze(1) * p).mean(dim=0).to(mu.device)  # (d, d)
        mu = torch.matmul(mu, r.T)
        if cov is not None:
            cov = torch.matmul(r, torch.matmul(cov, r.T))
        return mu, cov

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        if keys.size(2) <= self.n_sink:
            raise ValueError(f"the context holds {keys.size(2)} tokens, not more than n_sink={self.n_sink}")
        keys, values = keys[:, :, self.n_sink :], values[:, :, self.n_sink :]
        mean_q, cov_q = self.query_statistics(module, hidden_states)
        bsz, hkv, n, d = keys.shape
        groups = module.config.num_attention_heads // hkv
        k = _repeat_kv(keys, groups).transpose(2, 3)  # (B, H, d, T')
        scores = torch.matmul(mean_q.unsqueeze(2), k).squeeze(2) / math.sqrt(d)  # (B, H, T')
        if self.use_covariance:
            scores += torch.einsum("bhin, bhij, bhjn->bhn", k, cov_q, k) / d / 2
        scores = F.softmax(scores, dim=-1)
        scores = scores.view(bsz, hkv, groups, n).mean(dim=2)
        if self.use_vnorm:
            scores = (scores + self.epsilon) * values.norm(dim=-1)
        return F.pad(scores, (self.n_sink, 0), value=scores.max().item() + 1)


@dataclass
class KeyDiffPress(ScorerPress):
    """The keys least like the mean normalised key kept (the most distinctive)."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        anchor = F.normalize(keys, p=2, dim=-1).mean(dim=2, keepdim=True)
        return -F.cosine_similarity(keys, anchor, dim=-1)


@dataclass
class RandomPress(ScorerPress):
    """Uniform random scores; with a ``seed``, the same draw as kvpress's on the same device."""

    seed: int | None = None

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        gen = None
        if self.seed is not None:
            gen = torch.Generator(device=keys.device)
            gen.manual_seed(self.seed)
        return torch.rand(*keys.shape[:-1], generator=gen, device=keys.device, dtype=keys.dtype)


@dataclass
class QFilterPress(ScorerPress):
    """Learned filters, one per layer and KV head ((L, Hkv, d)): the keys least aligned with the filter kept.
    kvpress downloads them per model from the Hub; here the user hands them over (``q_filters``)."""

    q_filters: torch.Tensor | None = field(default=None)

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.q_filters is None:
            raise ValueError("QFilterPress needs its filters: QFilterPress(ratio, q_filters=(layers, kv_heads, d))")
        f = self.q_filters[module.layer_idx][None, :, None].to(keys.device)  # (1, Hkv, 1, d)
        return -(f * keys).sum(dim=-1)


@dataclass
class AdaKVPress:
    """AdaKV: one budget for a layer's KV heads together. Each head keeps its ``alpha_safeguard`` share of
    the per-head budget; the rest goes to the best scores of the layer, whichever head they are in."""

    press: ScorerPress
    alpha_safeguard: float = 0.20

    @property
    def compression_ratio(self) -> float:
        return self.press.compression_ratio


@dataclass
class PerLayerCompressionPress:
    """``press`` with its own compression ratio on each layer."""

    press: ScorerPress
    compression_ratios: list[float] = field(default_factory=list)

    @property
    def compression_ratio(self) -> float:
        return sum(self.compression_ratios) / len(self.compression_ratios)


def kept(press, layer: int, scores: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, T) bool: the entries ``press`` keeps of scores (B, Hkv, T), as kvpress chooses them:
    ``topk`` per head (``ScorerPress.compress``), or across a layer's heads (``AdaKVPress.compress``).
    ``press`` may be kvpress's own object: its wrappers are read by their fields."""
    ratio = float(press.compression_ratio)
    keep = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if hasattr(press, "compression_ratios"):  # per layer
        ratio = float(press.compression_ratios[layer])
        press = press.press
    if ratio == 0:
        return ~keep
    bsz, hkv, k_len = scores.shape
    n_kept = compute_n_kept(k_len, ratio)
    if hasattr(press, "alpha_safeguard"):  # AdaKV: a safeguard per head, then the bottom of the layer
        alpha = float(press.alpha_safeguard)
        n_safe = int(n_kept * alpha)
        if alpha > 0:
            n_safe = max(1, n_safe) if n_kept > 0 else 0
        scores = scores.clone()
        top = torch.topk(scores, n_safe, dim=-1).indices
        scores.scatter_(-1, top, torch.finfo(scores.dtype).max)
        n_pruned = hkv * (k_len - n_kept)
        idx = torch.topk(-scores.reshape(bsz, -1), n_pruned, dim=1).indices.flatten()
        keep[:] = True
        keep[torch.arange(bsz).repeat_interleave(n_pruned), idx // k_len, idx % k_len] = False
        return keep
    idx = scores.topk(n_kept, dim=-1).indices  # (B, Hkv, n_kept)
    return keep.scatter_(-1, idx, True)


def scoring_press(press):
    """The press whose ``score`` a wrapper (AdaKV, per layer, or kvpress's own) calls."""
    while not hasattr(press, "score") and hasattr(press, "press"):
        press = press.press
    if not callable(getattr(press, "score", None)):
        raise TypeError(f"{type(press).__name__} has no score(module, hidden_states, keys, values, attentions, kwargs)")
    return press
