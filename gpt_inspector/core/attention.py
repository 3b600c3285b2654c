"""The attention equation, written once, batched over heads.

    raw           = q · kᵀ
    scores        = raw × scaling, then tanh(x / cap) × cap where the model soft-caps; where the
                    model adds a per-head bias (ALiBi, doge's dynamic mask) it joins here, after
                    the scaling as BLOOM, MPT and doge add it: raw × scaling + bias
    masked_scores = scores, −inf where the query may not attend to the key
    probs         = softmax(masked_scores) along the keys; where the model has an attention sink
                    (gpt_oss) its logit joins each row's softmax and its share is dropped, so a
                    row sums to 1 − sink mass

Every reader of a run (sessions, beams, traces, views, figures, the CLI) derives its matrices
here, and the capture path computes its written-out (soft-capped) attention with ``scores``, so
there is one place for this arithmetic to be right. ``mathcheck`` keeps its own float64 copy on
purpose: it is the independent check.

The kind vocabulary (which of these four a caller asks for) lives here too. Figures and the CLI's
argument parsing read it without loading the engine, so torch is imported inside the functions
that compute, not at the top (a module-level import would load it for ``--help``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import InspectorError

if TYPE_CHECKING:
    import torch

KINDS = ("raw", "scores", "masked_scores", "probs")
KIND_TITLES = {"raw": "raw QKᵀ", "scores": "scaled", "masked_scores": "masked", "probs": "softmax"}
# the name a user types on the command line with what it means: "scores (scaled)"; the window's
# buttons and menus show these, so a kind seen there maps to ``--kind`` at once
KIND_LABELS = {k: t if t.split()[0] == k else f"{k} ({t})" for k, t in KIND_TITLES.items()}
# the kinds that hide what the mask removes; the pre-mask ones show every value
MASKING_KINDS = ("masked_scores", "probs")


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise InspectorError(f"unknown kind {kind!r}; use one of {', '.join(KINDS)}")
    return kind


def kv_head_of(head: int, n_heads: int, n_kv_heads: int) -> int:
    """The KV head that query head ``head`` reads (grouped-query attention: consecutive groups)."""
    return head // (n_heads // n_kv_heads)


def expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(..., Hkv, T, d) -> (..., H, T, d): query head h reads KV head h // (H / Hkv)."""
    n_rep = n_heads // x.shape[-3]
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=-3)


@dataclass(frozen=True)
class ScoreBias:
    """A per-head additive bias on the attention scores, kept compactly (never T x T per head).

    form ``"alibi"``: bias[h, i, j] = slopes[h] × (j − ref[i]), where ``ref[i]`` is the key
    position query row i's bias is measured from (0 for BLOOM and Falcon, which add slope × j;
    the last key of that row's forward for MPT). form ``"key"``: bias[h, i, j] = rows[h, j], one
    learned value per head and key (doge's dynamic mask). Every family we adapt adds it to the
    scaled scores (Falcon-ALiBi, which adds it before the scaling, is refused; see adapters).
    """

    form: str
    slopes: torch.Tensor | None = None  # (H,) float32, alibi
    ref: torch.Tensor | None = None  # (T,) float32 per query position, alibi
    rows: torch.Tensor | None = None  # (H, T) float32 per key, key

    def cloned(self) -> ScoreBias:
        """A copy that no later write to the records it views can change."""
        c = {n: None if getattr(self, n) is None else getattr(self, n).clone() for n in ("slopes", "ref", "rows")}
        return ScoreBias(self.form, **c)

    def block(self, p0: int, p1: int, t: int, heads: torch.Tensor | None = None) -> torch.Tensor:
        """The bias for query rows p0..p1 against keys 0..t: (h, n, t) float32."""
        import torch

        if self.form == "alibi":
            assert self.slopes is not None and self.ref is not None  # an alibi bias is built with both
            slopes = self.slopes if heads is None else self.slopes[heads]  # (h,)
            dist = torch.arange(t, dtype=torch.float32)[None, :] - self.ref[p0:p1, None].float()  # (n, t)
            return slopes.float()[:, None, None] * dist  # (h, n, t)
        assert self.rows is not None  # the only other form, key, is built with its per-key rows
        rows = self.rows[:, :t] if heads is None else self.rows[heads, :t]  # (h, t)
        return rows.float()[:, None, :].expand(-1, p1 - p0, -1)  # (h, n, t)


def scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scaling: float,
    softcap: float | None,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (..., n, d), k (..., T, d) -> (..., n, T): scaled, biased, soft-capped, unmasked scores.

    ``bias`` (broadcastable to (..., n, T)) is the model's additive score bias, added to the
    scaled scores before any soft-cap. ``out``: a contiguous float32 (..., n, T) tensor the scores
    are written into (a caller's reused buffer), or None for a new one.
    """
    import torch

    # in place on the product, which nobody else holds: the same operations in the same order (so
    # the same numbers) without a fresh (..., n, T) buffer per operation
    s = torch.matmul(q, k.transpose(-1, -2), out=out).mul_(scaling)  # (..., n, T)
    if bias is not None:
        s = s.add_(bias) if s.shape == torch.broadcast_shapes(s.shape, bias.shape) else s + bias
    if softcap is not None:
        s = s.div_(softcap).tanh_().mul_(softcap)
    return s


def equation(
    q: torch.Tensor,
    k: torch.Tensor,
    scaling: float,
    softcap: float | None,
    allowed: torch.Tensor,
    kind: str,
    sink: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    masked_from: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One stage of the attention equation in float32.

    q: (..., n, d) queries; k: (..., T, d) keys, already mapped to the query heads; allowed:
    (..., n, T) bool; sink: (...) one sink logit per leading index (per head), or None; bias:
    (..., n, T) the model's additive score bias (``ScoreBias.block``), or None; masked_from: the
    first key column ``allowed`` covers (it is then (..., n, T - masked_from)), every key before
    it being allowed; out: a contiguous float32 (..., n, T) buffer to compute in (a long
    stream of rows reuses one instead of faulting in fresh pages for each), or None. Returns
    (..., n, T) float32: ``out`` where given (with a sink, a new tensor).
    """
    import torch

    q, k = q.float(), k.float()
    if kind == "raw":
        return torch.matmul(q, k.transpose(-1, -2), out=out)  # (..., n, T)
    s = scores(q, k, scaling, softcap, None if bias is None else bias.float(), out)  # (..., n, T)
    if kind == "scores":
        return s
    masked = s  # in place: s is this call's own
    masked[..., masked_from:].masked_fill_(~allowed, -math.inf)  # (..., n, T - masked_from)
    if kind == "masked_scores":
        return masked
    if kind == "probs":
        if sink is None:
            # in place where the buffer is the caller's: the kernel reads each row before it writes
            # it, so the numbers are those of a fresh output (tests compare them bit for bit)
            return torch.softmax(masked, dim=-1) if out is None else torch.softmax(masked, dim=-1, out=masked)
        col = sink.float()[..., None, None].expand(*masked.shape[:-1], 1)  # (..., n, 1)
        return torch.softmax(torch.cat([masked, col], dim=-1), dim=-1)[..., :-1]  # (..., n, T)
    check_kind(kind)  # raises: every known kind returned above
    raise AssertionError(f"kind {kind!r} is known but equation() does not compute it")


FEW_ROWS = 8  # rows of one KV head's queries up to which causal_bin_mass takes the keys as the product's rows


def causal_bin_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    scaling: float,
    softcap: float | None,
    p0: int,
    size: int,
    key_block: int,
    cells: int = 0,
    work: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each query row's ``probs`` summed into key bins, under the plain causal mask, key block by key block.

    q: (g, n, d) query rows p0..p0+n of g heads that read the same keys; k: (>= p0 + n, d) those
    keys. Returns (g, n, ceil((p0 + n) / size)) float32: row i's probability mass in keys
    b·size .. (b+1)·size of every bin b (``equation(..., "probs")`` summed over each bin's keys).

    The same softmax as ``equation``'s, split along the keys (flash attention's online softmax):
    each block of at most about ``key_block`` keys is scored (``scores``), masked and soft-maxed in
    a buffer that stays in the core's cache, its bins summed, and the blocks' row maxima and sums
    put the pieces on one denominator. At long T the whole row's product and softmax went through
    memory several times; in the cache each pass is nearly free and the product itself a third
    faster (``benchmarks/bench_overview.py``). The numbers agree with a whole-row softmax to
    float32 rounding. ``key_block``, ``cells``: at least this many keys and rows x keys per block
    (``tiles`` sizes them to the cache). ``work``: a flat float32 buffer the blocks are computed in
    (grown when short).
    """
    import torch

    g, n, d = q.shape
    p1 = p0 + n
    rows = q.float().reshape(g * n, d)  # (g*n, d): head by head, each head's n rows
    if g * n <= FEW_ROWS:
        # a step's newest row: the keys are read once, as the rows of the product (the other way
        # round the product of a few rows read them at a third of the memory's speed)
        s = scores(k[:p1].float(), rows, scaling, softcap)  # (p1, g*n): the scores, keys down
        if n > 1:
            hidden = torch.arange(p0 + 1, p1)[:, None] > torch.arange(p0, p1)  # (keys past p0, n)
            s.view(p1, g, n)[p0 + 1 :].masked_fill_(hidden[:, None, :], -math.inf)
        return key_bin_sums(torch.softmax(s, dim=0).T, size).view(g, n, -1)  # (g, n, key bins)
    # about ``cells`` per block whatever the rows (a short run of rows gets longer blocks: the
    # calls per block cost as much as a small block's arithmetic); each holds whole bins, or lies
    # in one bin but its last; the last starts at or before p0, so that every row has an allowed
    # key in every block (no row of -inf)
    key_block = max(key_block, cells // (g * n))
    kb = key_block // size * size if size <= key_block else (key_block if size % key_block == 0 else size)
    starts = list(range(0, p0 + 1, kb))
    ends = [*starts[1:], p1]
    need = g * n * (ends[-1] - starts[-1])
    if work is None or work.numel() < need:
        work = torch.empty(need, dtype=torch.float32)
    maxes = torch.empty(len(starts), g * n)  # (blocks, g*n): each block's row maxima
    peaks = torch.empty(len(starts), g * n)  # (blocks, g*n): each block's largest probability, 1 / its row sum
    parts = []
    for i, (j, je) in enumerate(zip(starts, ends)):
        s = scores(rows, k[j:je].float(), scaling, softcap, None, work[: g * n * (je - j)].view(g * n, je - j))
        if je > p0 + 1:  # keys past a row's own position, in the last block only
            c = max(j, p0 + 1)
            hidden = torch.arange(c, je)[None, :] > torch.arange(p0, p1)[:, None]  # (n, je - c)
            s.view(g, n, je - j)[:, :, c - j :].masked_fill_(hidden, -math.inf)
        torch.amax(s, -1, out=maxes[i])
        torch.softmax(s, -1, out=s)
        torch.amax(s, -1, out=peaks[i])  # the row maximum's exp(0) / sum
        parts.append(key_bin_sums(s, size, j))  # (g*n, bins the block touches)
    top = maxes.amax(0)  # (g*n,)
    weight = (maxes - top).exp_().div_(peaks)  # (blocks, g*n): each block's row sum, on one scale
    weight.div_(weight.sum(0))
    mass = rows.new_zeros(g * n, -(-p1 // size))  # (g*n, key bins)
    for i, (j, part) in enumerate(zip(starts, parts)):
        b0 = j // size
        mass[:, b0 : b0 + part.shape[1]].addcmul_(part, weight[i][:, None])
    return mass.view(g, n, -1)


def key_bin_sums(cells: torch.Tensor, size: int, start: int = 0) -> torch.Tensor:
    """(..., n, w) cells of keys start..start+w -> (..., n, bins): their sums over the bins of
    ``size`` keys they touch (bin b holds keys b·size .. (b+1)·size; the first and last may be short)."""
    import torch

    w = cells.shape[-1]
    head = min(w, (-start) % size)  # keys before the first bin boundary past start
    parts = [] if head == 0 else [cells[..., :head].sum(-1, keepdim=True)]  # (..., n, 1)
    rest = cells[..., head:]
    full = rest.shape[-1] // size
    if full:
        parts.append(rest[..., : full * size].unflatten(-1, (full, size)).sum(-1))  # (..., n, full)
    if rest.shape[-1] > full * size:
        parts.append(rest[..., full * size :].sum(-1, keepdim=True))  # (..., n, 1)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
