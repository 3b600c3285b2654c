"""The kernel paths: one attention call computed the way its arguments need, as fast as the model's own.

- sdpa with the model's mask (or ``is_causal``, so a prefill at T = 8,192 never builds a T x T mask),
  each KV head read in place for its query-head group (``enable_gqa``; packed rows in a decode step);
- a chunk of queries after a cache under plain causality (a recompute's chunks, a chat turn): padded
  to a square for ``is_causal`` after a short cache, else the cached keys and the chunk's own keys as
  two mask-free flash calls merged by their log-sum-exp;
- sdpa with one dense (B, H, Tq, Tk) mask, where blocked cells differ per head;
- the written-out equation, where the scores must be in hand: soft-caps, attention sinks (``s_aux``),
  an additive score bias, or an intervention that reads the probabilities. It follows the model's
  eager attention op for op, so what we record is what the model computed.

``Call`` is what the kernel is asked to compute; interventions (``interventions.py``) change it first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import attention as eq
from ..hf import sdpa_mask

# sdpa's enable_gqa (torch >= 2.5) reads each KV head for its group of query heads in place;
# older torch gets K/V repeated to every query head, as transformers' own sdpa path does there
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)

# sdpa's CPU flash kernel called directly: it hands back each row's log-sum-exp, which sdpa does not
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

# set by inspector_mask on a mask that is plain lower-right causal over its own keys: the kernel then
# runs its mask-free causal paths. An attribute, not a None mask, because the model sees the mask too
# (doge builds its dynamic mask from it)
PLAIN_CAUSAL = "gpt_inspector_plain_causal"


@dataclass
class AppliedBias:
    """An additive score bias a model adds (passed by an adapter, or found on a doge layer).

    ``values``: what the model adds to the scaled scores, broadcastable to (B, H, Tq, Tk) (None
    where the model's mask already carries it, as doge's does). The compact record: ``form``
    "alibi" with ``slopes`` (H,) and ``ref`` (Tq,) (the key position each new query row's bias
    is measured from), or "key" with ``rows`` (B, H, Tk), one value per head and key.
    """

    form: str
    values: torch.Tensor | None = None
    slopes: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    batch: int = 1


@dataclass(slots=True)
class Call:
    """One attention call: the cache is already updated, so key and value hold every cached position."""

    query: torch.Tensor  # (B, H, Tq, d)
    key: torch.Tensor  # (B, Hkv, Tk, d)
    value: torch.Tensor  # (B, Hkv, Tk, d_v)
    model_mask: torch.Tensor | None  # the model's own mask as it came (the records inspect this tensor)
    scaling: float
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # (H,) one sink logit per head (gpt_oss's s_aux)
    bias: AppliedBias | None = None
    # what interventions ask for
    mask: torch.Tensor | None = field(init=False)  # (B, 1 or H, Tq, Tk) additive; None: plain causal
    block: torch.Tensor | None = None  # (H, Tq, Tk) bool: cells to block, in one dense mask
    needs_probs: bool = False  # the probabilities in hand (a policy scores from them)
    # what the kernel leaves for the interventions after it
    probs: torch.Tensor | None = None  # (B, H, Tq, Tk) where the scores were in hand
    kv_used: tuple | None = None  # (K, V, sdpa kwargs) as the kernel read them, for rows computed again

    def __post_init__(self):
        m = self.model_mask
        # a plain causal mask over exactly these keys says nothing the causal paths do not
        plain = m is None or (getattr(m, PLAIN_CAUSAL, False) and m.shape[-1] == self.tk)
        self.mask = None if plain else m[:, :, :, : self.tk]

    @property
    def n_heads(self) -> int:
        return self.query.shape[1]

    @property
    def tq(self) -> int:
        return self.query.shape[2]

    @property
    def tk(self) -> int:
        return self.key.shape[2]

    @property
    def q0(self) -> int:
        """The position of the first query: the new queries are the last tq positions of the cache."""
        return self.key.shape[2] - self.query.shape[2]

    @property
    def written_out(self) -> bool:
        """Whether the scores must be in hand (sdpa never shows them)."""
        return self.softcap is not None or self.sinks is not None or self.bias is not None or self.needs_probs

    def block_cells(self, block: torch.Tensor | None) -> None:
        """Block these (H, Tq, Tk) cells too (None: none)."""
        if block is not None:
            self.block = block if self.block is None else self.block | block


def attend(call: Call) -> torch.Tensor:
    """(B, H, Tq, d_v): the attention output by the path the call needs; ``call.probs`` where it had them."""
    written_out = call.written_out
    dense = _finish_mask(call, written_out)
    if written_out:
        return _written_out(call)
    if dense:
        return _sdpa_dense(call)
    return _sdpa(call)


def again(call: Call, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Query rows ``rows`` (n,) computed again by the sdpa call that ran, with their own mask (B, H, n, Tk)."""
    assert call.kv_used is not None, "again() after a kernel that ran"
    k, v, kw = call.kv_used
    q_rows = call.query.index_select(2, rows)  # (B, H, n, d)
    return F.scaled_dot_product_attention(q_rows, k, v, attn_mask=mask, scale=call.scaling, **kw)  # (B, H, n, d_v)


def _finish_mask(call: Call, dense: bool) -> bool:
    """The mask the kernel applies (blocked cells filled in, causality where sdpa cannot infer it);
    whether it is one dense mask (``dense``: it is already, the scores being in hand)."""
    q = call.query
    if call.block is not None:
        dense = True
        base = call.mask if call.mask is not None else causal_additive(call.tq, call.tk, q.dtype, q.device)
        call.mask = base.masked_fill(call.block.to(q.device), torch.finfo(q.dtype).min)  # (B, H, Tq, Tk)
    if call.mask is None and call.tq > 1 and dense:  # causality in the one dense mask
        call.mask = causal_additive(call.tq, call.tk, q.dtype, q.device)  # (1, 1, Tq, Tk)
    return dense


def _sdpa(call: Call) -> torch.Tensor:
    """sdpa over the KV heads as they are; a None mask with tq == tk is plain causal (``is_causal``)."""
    q, mask = call.query, call.mask  # (B, H, Tq, d)
    b, h, tq, d = q.shape
    k, v = call.key, call.value  # (B, Hkv, Tk, d)
    hkv = k.shape[1]
    if hkv != h and not _SDPA_GQA:
        k, v = eq.expand_kv(k, h), eq.expand_kv(v, h)  # (B, H, Tk, d)
    kw = {"enable_gqa": True} if k.shape[1] != h else {}  # the argument exists from torch 2.5 on
    call.kv_used = (k, v, kw)
    if hkv != h and tq == 1 and (mask is None or mask.shape[1] in (1, h)):
        # one new query per head (a decode step): each KV head's group of query heads becomes its rows,
        # so K/V are read once per KV head (transformers' pack_gqa; 2.5x faster at T = 8,192)
        packed_q = q.reshape(b, hkv, h // hkv, d)  # (B, Hkv, H/Hkv, d)
        packed_mask = mask if mask is None or mask.shape[1] == 1 else mask.reshape(b, hkv, h // hkv, -1)
        out = F.scaled_dot_product_attention(packed_q, call.key, call.value, attn_mask=packed_mask, scale=call.scaling)
        return out.reshape(b, h, 1, call.value.shape[-1])  # (B, H, 1, d_v)
    if mask is None and 1 < tq < call.tk:
        return _causal_after_cache(call, k, v, kw)  # (B, H, Tq, d_v)
    causal = mask is None and tq > 1
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=call.scaling, is_causal=causal, **kw)
    return out  # (B, H, Tq, d_v)


def _causal_after_cache(call: Call, k: torch.Tensor, v: torch.Tensor, kw: dict) -> torch.Tensor:
    """(B, H, Tq, d_v): Tq queries after q0 cached keys, plain causal, without a (Tq, Tk) mask.

    sdpa's ``is_causal`` aligns the triangle top-left, so this call would need an explicit mask, and
    with one the CPU kernel adds it to every block and skips none above the diagonal (1.3-1.7x the
    time of the same rows in a plain prefill). Instead, a short cache: q0 zero query rows in front
    make the triangle square and top-left (``is_causal``), the rows dropped after, for q0^2 / 2 extra
    products (the masked-off products of the masked call add zeros). A longer cache: every query sees all
    q0 cached keys (no mask) and its own chunk's keys top-left causal; softmax over the union is the
    two halves weighted by their log-sum-exps, equal to the masked call to float rounding.
    """
    q, q0, tq = call.query, call.q0, call.tq  # (B, H, Tq, d)
    if 4 * q0 <= tq:  # the padding adds at most 1/24 of the rows' work; the split's merge costs more
        padded = torch.cat([q.new_zeros((*q.shape[:2], q0, q.shape[3])), q], dim=2)  # (B, H, Tk, d)
        out = F.scaled_dot_product_attention(padded, k, v, scale=call.scaling, is_causal=True, **kw)  # (B, H, Tk, d_v)
        return out[:, :, q0:]  # (B, H, Tq, d_v)
    if not _flash_splits(q, k, v):
        mask = causal_additive(tq, call.tk, q.dtype, q.device)  # (1, 1, Tq, Tk)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=call.scaling, **kw)
    assert _CPU_FLASH is not None  # _flash_splits checked it
    s = call.scaling
    o_old, lse_old = _CPU_FLASH(q, k[:, :, :q0], v[:, :, :q0], 0.0, False, scale=s)  # (B, H, Tq, d_v), (B, H, Tq)
    o_new, lse_new = _CPU_FLASH(q, k[:, :, q0:], v[:, :, q0:], 0.0, True, scale=s)  # (B, H, Tq, d_v), (B, H, Tq)
    wide = torch.promote_types(q.dtype, torch.float32)  # half precision merges in float32
    share = torch.sigmoid(lse_old.to(wide) - lse_new.to(wide)).unsqueeze(-1)  # (B, H, Tq, 1): the cache's softmax mass
    return torch.lerp(o_new.to(wide), o_old.to(wide), share).to(q.dtype)  # (B, H, Tq, d_v)


def _flash_splits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the split runs: the CPU flash kernel, one head size for q, K and V, and KV-head groups it reads."""
    if _CPU_FLASH is None or q.device.type != "cpu" or not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        return False
    return k.shape[1] == q.shape[1] or _flash_reads_groups()


@functools.cache
def _flash_reads_groups() -> bool:
    """Whether this torch's CPU flash kernel maps query-head groups to KV heads itself (checked once, tiny)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 3, 4, generator=g) for h in (4, 2, 2))  # (1, H or Hkv, 3, 4)
    try:
        out = _CPU_FLASH(q, k, v, 0.0, True, scale=0.5)[0]  # type: ignore[misc]  # (1, 4, 3, 4)
    except RuntimeError:
        return False
    ref = F.scaled_dot_product_attention(q, eq.expand_kv(k, 4), eq.expand_kv(v, 4), is_causal=True, scale=0.5)
    return bool(torch.allclose(out, ref, atol=1e-6))


def _sdpa_dense(call: Call) -> torch.Tensor:
    """sdpa with one (B, H, Tq, Tk) mask: blocked cells differ per head, so K/V go per query head."""
    k = eq.expand_kv(call.key, call.n_heads)  # (B, H, Tk, d)
    v = eq.expand_kv(call.value, call.n_heads)  # (B, H, Tk, d_v)
    call.kv_used = (k, v, {})
    return F.scaled_dot_product_attention(call.query, k, v, attn_mask=call.mask, scale=call.scaling)  # (B, H, Tq, d_v)


def _written_out(call: Call) -> torch.Tensor:
    """The equation with the scores in hand, in the order the model's eager attention computes it."""
    k = eq.expand_kv(call.key, call.n_heads)  # (B, H, Tk, d)
    v = eq.expand_kv(call.value, call.n_heads)  # (B, H, Tk, d_v)
    call.kv_used = (k, v, {})
    added = None if call.bias is None else call.bias.values  # broadcastable to (B, H, Tq, Tk)
    scores = eq.scores(call.query, k, call.scaling, call.softcap, added)  # (B, H, Tq, Tk)
    if call.mask is not None:
        scores = scores + call.mask
    if call.sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)  # (B, H, Tq, Tk)
    else:
        probs = _softmax_with_sink(scores, call.sinks).to(v.dtype)  # (B, H, Tq, Tk)
    call.probs = probs
    return torch.matmul(probs, v)  # (B, H, Tq, d_v)


def _softmax_with_sink(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """gpt_oss's eager softmax, op for op: the sink joins each row as a last logit, then is dropped."""
    b, h, tq, _ = scores.shape
    sink = sinks.reshape(1, -1, 1, 1).expand(b, h, tq, 1).to(scores.dtype)  # (B, H, Tq, 1)
    combined = torch.cat([scores, sink], dim=-1)  # (B, H, Tq, Tk + 1)
    # transformers subtracts the row max before the softmax (overflow guard); the rounding follows it
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]  # (B, H, Tq, Tk)


def causal_additive(tq: int, tk: int, dtype, device, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The lower-right causal mask of tq queries over tk keys, additive; ``rows``: only those query offsets."""
    q_pos = torch.arange(tk - tq, tk, device=device)  # (Tq,)
    if rows is not None:
        q_pos = q_pos[rows]  # (n,)
    allowed = torch.arange(tk, device=device)[None, :] <= q_pos[:, None]  # (n, Tk)
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[None, None]  # (1, 1, n, Tk)


def inspector_mask(*args, dtype: torch.dtype = torch.float32, allow_is_causal_skip: bool = True, **kwargs):
    """transformers' eager mask (0 allowed, dtype-min blocked), or None where sdpa's would be skipped.

    sdpa's builder returns None only when the mask is plain causal over the keys at hand (or, for
    a bidirectional mask, all-allowed), which the sdpa path reproduces with ``is_causal`` or with
    no mask for one query; anything else (padding, a window that bites, custom overlays) comes back
    materialised and converted exactly as ``eager_mask`` converts it.
    """
    kwargs["allow_is_causal_skip"] = allow_is_causal_skip  # by keyword: sdpa_mask's order is not ours
    mask = sdpa_mask(*args, **kwargs)  # (B, 1, Tq, Tk) bool or None
    if mask is None:
        return None
    additive = torch.where(mask, torch.zeros((), device=mask.device, dtype=dtype), torch.finfo(dtype).min)
    if _lower_right_causal(mask):
        setattr(additive, PLAIN_CAUSAL, True)  # queries after a cache, nothing padded, no window in reach
    return additive


def _lower_right_causal(mask: torch.Tensor) -> bool:
    """Whether a (B, 1, Tq, Tk) bool mask is plain causal with the queries the last Tq positions, in every row."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        return False
    tq, tk = mask.shape[-2:]
    causal = torch.ones(tq, tk, dtype=torch.bool, device=mask.device).tril(tk - tq)  # (Tq, Tk)
    return torch.equal(mask, causal.expand_as(mask))
