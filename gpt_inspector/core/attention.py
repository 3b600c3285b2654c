"""The attention equation, written once, batched over heads.

    raw           = q · kᵀ
    scores        = raw × scaling, then tanh(x / cap) × cap where the model soft-caps
    masked_scores = scores, −inf where the query may not attend to the key
    probs         = softmax(masked_scores) along the keys; where the model has an attention sink
                    (gpt_oss) its logit joins each row's softmax and its share is dropped, so a
                    row sums to 1 − sink mass

Every reader of a run (sessions, beams, traces, views, figures, the CLI) derives its matrices
here, and the capture path computes its written-out (soft-capped) attention with ``scores``, so
there is one place for this arithmetic to be right. ``mathcheck`` keeps its own float64 copy on
purpose: it is the independent check.
"""

from __future__ import annotations

import math

import torch


from .stages import KINDS, STAGE_TITLES, STAGES, check_stage  # noqa: F401  (the vocabulary, re-exported)


def kv_group(n_heads: int, n_kv_heads: int) -> int:
    """Query heads per KV head (1 for multi-head attention)."""
    return n_heads // n_kv_heads


def kv_head_of(head: int, n_heads: int, n_kv_heads: int) -> int:
    """The KV head that query head ``head`` reads (grouped-query attention: consecutive groups)."""
    return head // kv_group(n_heads, n_kv_heads)


def expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(..., Hkv, T, d) -> (..., H, T, d): query head h reads KV head h // (H / Hkv)."""
    n_rep = n_heads // x.shape[-3]
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=-3)


def scores(q: torch.Tensor, k: torch.Tensor, scaling: float, softcap: float | None) -> torch.Tensor:
    """q (..., n, d), k (..., T, d) -> (..., n, T): scaled, soft-capped, unmasked scores."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scaling  # (..., n, T)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    return s


def equation(
    q: torch.Tensor,
    k: torch.Tensor,
    scaling: float,
    softcap: float | None,
    allowed: torch.Tensor,
    kind: str,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """One stage of the attention equation in float32.

    q: (..., n, d) queries; k: (..., T, d) keys, already mapped to the query heads; allowed:
    (..., n, T) bool; sink: (...) one sink logit per leading index (per head), or None.
    Returns (..., n, T) float32.
    """
    q, k = q.float(), k.float()
    if kind == "raw":
        return torch.matmul(q, k.transpose(-1, -2))  # (..., n, T)
    s = scores(q, k, scaling, softcap)  # (..., n, T)
    if kind == "scores":
        return s
    masked = s.masked_fill(~allowed, -math.inf)  # (..., n, T)
    if kind == "masked_scores":
        return masked
    if kind == "probs":
        if sink is None:
            return torch.softmax(masked, dim=-1)
        col = sink.float()[..., None, None].expand(*masked.shape[:-1], 1)  # (..., n, 1)
        return torch.softmax(torch.cat([masked, col], dim=-1), dim=-1)[..., :-1]  # (..., n, T)
    return check_stage(kind)
