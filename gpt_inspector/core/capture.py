"""Capture every attention quantity by *being* the model's attention function.

We register one function under ``ATTN_NAME`` in transformers' ``AttentionInterface`` and a mask
builder under the same name in ``AttentionMaskInterface``. The second registration matters:
without it ``create_causal_mask`` finds no builder for our name, hands us no mask, and the causal
mask silently disappears (logits drift by ~0.02 on GPT-2). Our builder is the eager one (an
additive float mask) except where sdpa's own builder would skip the mask (plain causal, nothing
padded, no window in reach): then it returns None and we ask sdpa for ``is_causal``, so a prefill
at T = 8,192 never builds a T x T mask and a decode step passes none.

Because our function computes the attention the model uses, what we record *is* what the model
computed. Mask edits are applied here too, so an edited model and its records can never disagree.

What is kept per layer (CPU, grown geometrically so a long run re-copies each position O(1) times):
- q and the attention output per query head and position (B, H, T, d);
- K and V: on the CPU they are read straight from the model's KV cache (zero copy, the real
  thing); on an accelerator, and wherever the cache holds something else than the K/V attention
  receives (a latent, untiled heads: ``core.kv_layout``), a CPU mirror is filled;
- the base mask only where it deviates from plain causal (sliding windows, padding), per head
  where the model masks each head differently (doge's dynamic top-k);
- an additive score bias where the model adds one, compactly: ALiBi as per-head slopes plus one
  reference position per query row, doge's dynamic mask as one value per head and key.
Score and probability matrices are derived on demand by ``core.attention``; nothing T x T is
stored per head.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import attention as eq
from .hf import AttentionInterface, AttentionMaskInterface, sdpa_mask
from .edits import HeadEdit, MaskEdit, _CompiledEdits, allowed_rows, compile_edits  # noqa: F401 (the names capture always offered)
from .rowbuffer import RowBuffer

ATTN_NAME = "gpt_inspector"

# The recorder of the forward pass running in *this* thread (the GUI worker, a script, a test).
_ACTIVE: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("gpt_inspector_recorder", default=None)


def active_recorder():
    """The recorder forwards write into now (None outside ``Recorder.active``)."""
    return _ACTIVE.get()


def make_active(rec) -> None:
    """Put back the recorder ``active_recorder`` gave: a rollback's last word on which recorder is active."""
    _ACTIVE.set(rec)

# sdpa's enable_gqa (torch >= 2.5) reads each KV head for its group of query heads in place;
# older torch gets K/V repeated to every query head, as transformers' own sdpa path does there
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)

class Recorder:
    """Per-layer records of one model's forward passes (one batch row per beam)."""

    def __init__(self, n_layers: int, mirror_kv: bool):
        self.n_layers = n_layers
        self.mirror_kv = mirror_kv
        self.q = [RowBuffer() for _ in range(n_layers)]
        self.out = [RowBuffer() for _ in range(n_layers)]
        self.k = [RowBuffer() for _ in range(n_layers)] if mirror_kv else None
        self.v = [RowBuffer() for _ in range(n_layers)] if mirror_kv else None
        self.scaling: list[float | None] = [None] * n_layers
        self.softcap: list[float | None] = [None] * n_layers
        # attention sinks (gpt_oss): one extra logit per head that takes probability mass and gives no value
        self.sinks: list[torch.Tensor | None] = [None] * n_layers  # (H,) float32 on the CPU
        # position -> bool (T,) of keys the model's own mask allowed, only where not plain causal;
        # (B, H, T), one per batch row (beam), where the model masks each head differently
        self.mask_rows: list[dict[int, torch.Tensor]] = [dict() for _ in range(n_layers)]
        # additive score biases: (form, slopes (H,) or None) per layer, or None;
        # alibi's reference position per query row (B, 1, T, 1), a key bias per head and key (B, H, T, 1)
        self.bias_form: list[tuple[str, torch.Tensor | None] | None] = [None] * n_layers
        self.bias_ref = [RowBuffer() for _ in range(n_layers)]
        self.bias_rows = [RowBuffer() for _ in range(n_layers)]
        self.calls = [0] * n_layers
        self.length = 0
        # head outputs are kept from this position on (out[layer] row i is position out_from + i): a
        # session sets it to the prompt's last position, where the first step decides a token. Earlier
        # prompt rows feed no prediction shown; keeping them would cost as much as q (on GQA models that
        # alone is twice the KV cache)
        self.out_from = 0
        # out_from never goes below this on a crop (the session's prompt's last position)
        self.out_floor = 0
        self.edits = _CompiledEdits()
        # layer -> [(head, None to zero it | (H_src, T_src, d) outputs to patch in from another run)]
        self.head_edits: dict[int, list[tuple[int, torch.Tensor | None]]] = {}
        # a KV cache policy under study (core.kvlab), or None: see inspector_attention for its two calls
        self.kv_policy = None
        self._checked_masks: dict[int, tuple[bool, torch.Tensor]] = {}

    # -- bookkeeping used by the session -------------------------------------------------------
    def crop(self, length: int) -> None:
        self.length = min(self.length, length)
        if length < self.out_from:  # the rows kept before were cut: the next forward writes from here
            self.out_from = max(length, self.out_floor)
        for rows in self.mask_rows:
            for p in [p for p in rows if p >= length]:
                del rows[p]

    def reorder(self, index: torch.Tensor) -> None:
        for bufs in (self.q, self.out, self.k or [], self.v or [], self.bias_ref, self.bias_rows):
            for b in bufs:
                b.reorder(index)
        for rows in self.mask_rows:  # per-row masks (doge's top-k) follow their beams
            for p, row in rows.items():
                if row.dim() == 3:
                    rows[p] = row.index_select(0, index.cpu())

    def keep_outputs_from(self, position: int) -> None:
        """Let go of the head outputs before ``position`` (they can be recomputed: see Session)."""
        drop = position - self.out_from
        if drop <= 0:
            return
        n = max(0, self.length - position)
        with torch.inference_mode():  # the buffers were made under it, by the forwards that wrote them
            for b in self.out:
                if b.t is not None:
                    b.t[:, :, :n] = b.t[:, :, drop : drop + n].clone()  # (B, H, n, d) to the front
        self.out_from = position

    def _by_position(self) -> list[tuple[RowBuffer, int]]:
        """Every buffer kept along positions, with the position of its row 0."""
        bufs = [(b, 0) for group in (self.q, self.k or [], self.v or [], self.bias_ref, self.bias_rows) for b in group]
        return bufs + [(b, self.out_from) for b in self.out]

    def save_from(self, start: int) -> dict:
        """Copies of everything a forward from ``start`` overwrites, for ``restore`` to put back exactly."""
        end = self.length
        rows = []
        for b, first in self._by_position():
            lo, hi = max(start - first, 0), end - first
            rows.append(None if b.t is None or hi <= lo else b.t[:, :, lo:hi].clone())
        return {
            "start": start, "length": end, "out_from": self.out_from, "calls": list(self.calls), "sinks": list(self.sinks),
            "scaling": list(self.scaling), "softcap": list(self.softcap), "bias_form": list(self.bias_form),
            "rows": rows, "mask_rows": [{p: r for p, r in kept.items() if p >= start} for kept in self.mask_rows],
        }  # fmt: skip

    def restore(self, saved: dict) -> None:
        start = saved["start"]
        self.crop(start)
        self.out_from = saved["out_from"]  # the saved rows' offsets count from it
        for (b, first), rows in zip(self._by_position(), saved["rows"]):
            if rows is not None:
                b.write(rows, max(start - first, 0))
        for rows, kept in zip(self.mask_rows, saved["mask_rows"]):
            rows.update(kept)
        self.length, self.calls = saved["length"], list(saved["calls"])
        self.sinks, self.scaling, self.softcap = list(saved["sinks"]), list(saved["scaling"]), list(saved["softcap"])
        self.bias_form = list(saved["bias_form"])

    def nbytes(self) -> int:
        return sum(b.nbytes(max(0, self.length - first)) for b, first in self._by_position())

    def score_bias(self, layer: int, length: int, row: int = 0) -> eq.ScoreBias | None:
        """Layer ``layer``'s additive score bias over positions 0..length of batch row ``row``, or None."""
        form = self.bias_form[layer]
        if form is None:
            return None
        kind, slopes = form
        if kind == "alibi":
            ref = self.bias_ref[layer].view(length)[row, 0, :, 0]  # (T,)
            return eq.ScoreBias(kind, slopes=slopes, ref=ref)
        return eq.ScoreBias(kind, rows=self.bias_rows[layer].view(length)[row, :, :, 0])  # (H, T)

    @contextlib.contextmanager
    def active(self):
        # the previous value, not set()'s token: Ctrl+C right after set() would lose the token and leave
        # this recorder active, so that every later forward (another model's load probe) wrote into it
        prev = _ACTIVE.get()
        try:
            _ACTIVE.set(self)
            self._checked_masks.clear()
            yield self
        finally:
            _ACTIVE.set(prev)
            self._checked_masks.clear()

    # -- called from inside the model's forward -------------------------------------------------
    def _record(self, layer, query, key, value, attention_mask, out, scaling, softcap, sinks=None, bias=None) -> None:
        tq, tk = query.shape[2], key.shape[2]
        q0 = tk - tq  # the new queries are the last tq positions of the cache
        self.calls[layer] += 1
        self.scaling[layer] = float(scaling)
        self.softcap[layer] = softcap
        if sinks is not None:
            self.sinks[layer] = sinks.detach().float().cpu().clone()  # (H,)
        self.q[layer].write(query.detach(), q0)
        lo = max(q0, self.out_from)  # the first position whose head output is kept
        if lo < tk:
            self.out[layer].write(out[:, :, lo - q0 :].detach(), lo - self.out_from)  # (B, H, tk - lo, d)
        if self.mirror_kv:
            self.k[layer].write(key[:, :, q0:].detach(), q0)
            self.v[layer].write(value[:, :, q0:].detach(), q0)
        if bias is not None:
            self._record_bias(layer, bias, q0, tq)
        if attention_mask is not None:
            self._record_mask(layer, attention_mask, q0, tq, tk, bias)
        self.length = tk  # every attention layer sees the same keys (hybrids: not every layer attends)

    def _record_bias(self, layer, bias: AppliedBias, q0: int, tq: int) -> None:
        slopes = None if bias.slopes is None else bias.slopes.detach().float().cpu().clone()  # (H,)
        self.bias_form[layer] = (bias.form, slopes)
        if bias.form == "alibi":
            ref = bias.ref.detach().float().reshape(1, 1, tq, 1)  # (1, 1, Tq, 1)
            self.bias_ref[layer].write(ref.expand(bias.batch, -1, -1, -1), q0)
        else:
            # one value per key: the rows of this forward's new keys (older keys' rows are already kept)
            self.bias_rows[layer].write(bias.rows[:, :, q0:, None].detach().float(), q0)  # (B, H, Tq, 1)

    def _record_mask(self, layer, mask, q0, tq, tk, bias=None) -> None:
        if mask.shape[1] > 1 or (mask.dtype != torch.bool and bias is not None and bias.form == "key"):
            self._record_head_mask(layer, mask, q0, tq, tk, bias)
            return
        # the same mask tensor is shared by every layer of a forward: inspect it once. The entry keeps
        # the tensor alive, so a mask an adapter builds per layer cannot reuse a checked one's id
        key = id(mask)
        plain = self._checked_masks.get(key, (None,))[0]
        allowed = None
        if plain is None:
            _check_mask_is_a_mask(mask[0, :, :, :tk])
            allowed = _allowed(mask[0, 0, :, :tk]).cpu()  # (Tq, Tk)
            pos = torch.arange(tk)
            causal = pos[None, :] <= (q0 + torch.arange(tq))[:, None]
            plain = bool(torch.equal(allowed, causal))
            self._checked_masks[key] = (plain, mask)
        if not plain:
            if allowed is None:
                allowed = _allowed(mask[0, 0, :, :tk]).cpu()
            for r in range(tq):
                self.mask_rows[layer][q0 + r] = allowed[r].clone()

    def _record_head_mask(self, layer, mask, q0, tq, tk, bias) -> None:
        """A mask per head (doge's dynamic top-k), real-valued where it carries the model's key bias.

        Kept only if the real values are exactly the recorded key bias: anything else would be
        lost from the derived scores and must not pass silently.
        """
        m = mask[:, :, :, :tk]  # (B, Hm, Tq, Tk)
        allowed = _allowed(m)  # (B, Hm, Tq, Tk)
        if m.dtype != torch.bool:
            vals = bias.rows[:, :, None, :tk].to(m.dtype).expand_as(m) if bias is not None else torch.zeros_like(m)
            if not bool(torch.equal(torch.where(allowed, m, 0), torch.where(allowed, vals, 0))):
                _check_mask_is_a_mask(m[0])  # names what is wrong (a bias we do not know, or per-head masks)
                raise NotImplementedError("the model's real-valued attention mask is not its recorded score bias")
        allowed = allowed.cpu()
        causal = torch.arange(tk)[None, :] <= (q0 + torch.arange(tq))[:, None]  # (Tq, Tk)
        if bool((allowed == causal).all()):
            return
        for r in range(tq):
            self.mask_rows[layer][q0 + r] = allowed[:, :, r].clone()  # (B, Hm, Tk)


class Unpairable(Exception):
    """A model's attention took per-batch-row arguments that ``RowRecorders`` cannot split."""


class RowRecorders:
    """One recorder per batch row: runs of one model stepped together by one forward (the KV lab's
    reference and policy run), each row's attention computed and recorded exactly as its run's own."""

    def __init__(self, recorders: list[Recorder]):
        self.rows = list(recorders)

    @contextlib.contextmanager
    def active(self):
        prev = _ACTIVE.get()  # not set()'s token: see Recorder.active
        try:
            _ACTIVE.set(self)
            yield self
        finally:
            _ACTIVE.set(prev)
            for rec in self.rows:  # the mask checks keep masks alive: as a forward of its own, none outlive it
                rec._checked_masks.clear()

    def crop(self, length: int) -> None:
        for rec in self.rows:
            rec.crop(length)

    def attend(self, module, query, key, value, attention_mask, *args, score_bias=None, **kwargs):
        """``inspector_attention`` per row under that row's recorder; outputs joined along the batch."""
        if score_bias is not None or kwargs.get("indices") is not None or KEY_BIAS_ATTR in module.__dict__:
            raise Unpairable("the model's attention takes a score bias or key selection per batch row")
        outs, probs = [], []
        for r, rec in enumerate(self.rows):
            one = slice(r, r + 1)
            mask = attention_mask if attention_mask is None or attention_mask.shape[0] == 1 else attention_mask[one]
            token = _ACTIVE.set(rec)
            try:
                o, pr = inspector_attention(module, query[one], key[one], value[one], mask, *args, **kwargs)
            finally:
                _ACTIVE.reset(token)
            outs.append(o)  # (1, Tq, H, d)
            probs.append(pr)
        return torch.cat(outs), None if any(pr is None for pr in probs) else torch.cat(probs)


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


def scratch_forward(lm, ids, like: Recorder | None = None) -> Recorder:
    """Run ``ids`` once, without a cache, into a fresh Recorder; nothing of any session is touched.

    ``like``: apply that recorder's mask edits and head edits too (None: the model as it is).
    """
    rec = Recorder(lm.n_layers, mirror_kv=False)
    if like is not None:
        rec.edits, rec.head_edits = like.edits, like.head_edits
    x = torch.tensor([list(ids)], dtype=torch.long, device=lm.device)  # (1, T)
    with torch.inference_mode(), rec.active():
        lm.model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False, logits_to_keep=1)
    return rec


def _check_mask_is_a_mask(mask: torch.Tensor) -> None:
    """We keep the model's mask as allowed / not allowed; refuse real values we cannot account for.

    mask: (Hm, Tq, Tk). A real-valued bias no adapter recorded (doge without its adapter, ALiBi
    passed as a mask) would be lost from every derived score, so it must not pass silently; masks
    that differ per head are recorded per head by ``_record_head_mask``, which calls this only to
    name what it found.
    """
    if mask.dtype != torch.bool:
        low = torch.finfo(mask.dtype).min / 2
        if bool(((mask != 0) & (mask > low)).any()):
            raise NotImplementedError("the model adds a real-valued bias to the attention scores, not only a mask")
    if mask.shape[0] > 1 and not bool((_allowed(mask) == _allowed(mask[:1])).all()):
        raise NotImplementedError("the model masks each attention head differently")


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


# arguments some families pass to their attention function that change its result and that we do
# not reproduce (relative position biases, sparse key selections, sinks in another layout than s_aux)
_CHANGES_THE_RESULT = ("position_bias", "block_indices", "sinks")


# the attribute a model adapter sets on an attention module whose model passes its key bias inside
# the mask (doge): (B, H_kv, Tk), read once by the next call
KEY_BIAS_ATTR = "gpt_inspector_key_bias"


def inspector_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                        score_bias: AppliedBias | None = None, **kwargs):  # fmt: skip
    """The model's attention, computed here so that what we record is what it used.

    The cache is already updated, so key and value hold every cached position. We record q and
    the attention output; scores and probabilities are derived on demand from q and K with the
    same equation (``derive``), so nothing T x T is kept. The output comes from PyTorch's fused
    ``scaled_dot_product_attention`` with the model's mask plus our edits, which is as fast as the
    model's own sdpa path; soft-capped models, models with attention sinks (``s_aux``, gpt_oss)
    and models with an additive score bias (``score_bias`` from an adapter: ALiBi; doge's key
    bias) need the scores in hand and take the written-out equation instead, in the order the
    model's eager attention computes it.
    """
    if isinstance(_ACTIVE.get(), RowRecorders):
        return _ACTIVE.get().attend(module, query, key, value, attention_mask, scaling, dropout, softcap,
                                    score_bias=score_bias, **kwargs)  # fmt: skip
    if kwargs.get("indices") is not None:
        # deepseek_v32's sparse attention: the keys its indexer selected are the mask, recorded as such
        attention_mask = _with_selected_keys(attention_mask, kwargs.pop("indices"), query, key.shape[2])
    for name in _CHANGES_THE_RESULT:
        if kwargs.get(name) is not None:
            # computing without it would be silently wrong; the load's probe turns this into a refusal
            raise NotImplementedError(f"gpt-inspector's attention cannot apply the model's {name!r} argument")
    b, n_heads, tq, d = query.shape  # (B, H, Tq, d)
    tk = key.shape[2]  # key, value: (B, Hkv, Tk, d)
    if scaling is None:
        scaling = d**-0.5
    rec = _ACTIVE.get()
    layer = getattr(module, "layer_idx", None)
    policy = rec.kv_policy if rec is not None and layer is not None else None
    policy_block = None
    if policy is not None:
        # the policy's cache as attention reads it (dequantized K/V) and the entries it no longer
        # holds, masked for these queries: (B, Hkv, Tk, d) twice and (H, Tq, Tk) bool or None
        key, value, policy_block = policy.attend(layer, key, value, tk - tq, n_heads)
    mask = None if attention_mask is None else attention_mask[:, :, :, :tk]  # (B, 1 or H, Tq, Tk) additive
    key_bias = module.__dict__.pop(KEY_BIAS_ATTR, None)  # (B, Hkv, Tk): already inside the mask
    if key_bias is not None:
        score_bias = AppliedBias("key", rows=eq.expand_kv(key_bias[:, :, None], n_heads)[:, :, 0], batch=b)
    sinks = kwargs.get("s_aux")  # (H,) one sink logit per head, or None
    written_out = softcap is not None or sinks is not None or score_bias is not None
    dense = written_out  # one (B, H, Tq, Tk) mask with every block in it
    edited = None  # the sdpa path: (offsets (n,), blocked (H, n, Tk)) of the rows our edits touch
    if rec is not None and layer is not None:
        # the scores in hand, or a KV policy's evictions (which it also reads back): one dense block.
        # A policy that holds everything takes the fast path, so it equals the plain run exactly
        if written_out or policy is not None:
            block = rec.edits.block_for(layer, n_heads, tk - tq, tq, tk)  # (H, Tq, Tk) or None
            if policy_block is not None:
                block = policy_block if block is None else block | policy_block
            if block is not None:
                dense = True
                base = mask if mask is not None else _causal_additive(tq, tk, query.dtype, query.device)
                mask = base.masked_fill(block.to(query.device), torch.finfo(query.dtype).min)  # (B, H, Tq, Tk)
        else:
            edited = rec.edits.rows_for(layer, n_heads, tk - tq, tq, tk)
    if mask is None and tq > 1 and (tq != tk or dense):  # a model that left causality to us
        mask = _causal_additive(tq, tk, query.dtype, query.device)  # (1, 1, Tq, Tk)
    # a policy that reads the attention weights (H2O, TOVA) takes them from this forward once it has
    # evicted something: the written-out equation instead of sdpa and then a second pass for them
    # (it holds everything until then, so an unlimited budget stays on the plain run's path exactly)
    if policy_block is not None and tq == 1 and getattr(policy, "reads_probs", False):
        written_out = True
    if dense and not written_out:
        k = eq.expand_kv(key, n_heads)  # (B, H, Tk, d)
        v = eq.expand_kv(value, n_heads)  # (B, H, Tk, d)
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)  # (B, H, Tq, d)
        probs = None
    elif not written_out:
        # None with tq == tk: plain causal, which sdpa's is_causal computes without a T x T mask;
        # enable_gqa reads each KV head for its query-head group in place (no repeat of K/V)
        gqa = key.shape[1] != n_heads
        k, v = key, value  # (B, Hkv, Tk, d)
        hkv = key.shape[1]
        if gqa and tq == 1 and (mask is None or mask.shape[1] in (1, n_heads)):
            # one new query per head (a decode step): each KV head's group of query heads becomes its
            # rows, so K/V are read once per KV head (transformers' pack_gqa; 2.5x faster at T = 8,192)
            packed_q = query.reshape(b, hkv, n_heads // hkv, d)  # (B, Hkv, H/Hkv, d)
            packed_mask = mask if mask is None or mask.shape[1] == 1 else mask.reshape(b, hkv, n_heads // hkv, -1)
            out = F.scaled_dot_product_attention(packed_q, k, v, attn_mask=packed_mask, scale=scaling)  # (B, Hkv, H/Hkv, d)
            out = out.reshape(b, n_heads, 1, value.shape[-1])  # (B, H, 1, d_v)
            gqa_kw = {"enable_gqa": True} if _SDPA_GQA else {}
            if not _SDPA_GQA:
                k, v, gqa_kw = eq.expand_kv(key, n_heads), eq.expand_kv(value, n_heads), {}  # (B, H, Tk, d)
        else:
            if gqa and not _SDPA_GQA:
                k, v, gqa = eq.expand_kv(key, n_heads), eq.expand_kv(value, n_heads), False  # (B, H, Tk, d)
            gqa_kw = {"enable_gqa": True} if gqa else {}  # the argument exists from torch 2.5 on
            out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling,
                                                 is_causal=mask is None and tq > 1, **gqa_kw)  # (B, H, Tq, d)  # fmt: skip
        if edited is not None:  # the edited rows again, each with its own mask per head
            offsets, block = edited[0].to(query.device), edited[1].to(query.device)  # (n,), (H, n, Tk)
            if mask is not None:
                base = mask.index_select(2, offsets)  # (B, 1 or H, n, Tk)
            else:
                base = _causal_additive(tq, tk, query.dtype, query.device, offsets)  # (1, 1, n, Tk)
            rows = base.masked_fill(block, torch.finfo(query.dtype).min)  # (B, H, n, Tk)
            q_rows = query.index_select(2, offsets)  # (B, H, n, d)
            new = F.scaled_dot_product_attention(q_rows, k, v, attn_mask=rows, scale=scaling, **gqa_kw)  # (B, H, n, d)
            # only the (head, row) pairs an edit touches: the others keep the first pass's numbers exactly
            h_idx, r_idx = block.any(-1).nonzero(as_tuple=True)  # (m,), (m,)
            out[:, h_idx, offsets[r_idx]] = new[:, h_idx, r_idx]  # (B, m, d)
        probs = None
    else:
        k = eq.expand_kv(key, n_heads)  # (B, H, Tk, d)
        v = eq.expand_kv(value, n_heads)  # (B, H, Tk, d)
        added = None if score_bias is None else score_bias.values  # broadcastable to (B, H, Tq, Tk)
        scores = eq.scores(query, k, scaling, softcap, added)  # (B, H, Tq, Tk)
        if mask is not None:
            scores = scores + mask
        if sinks is None:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)  # (B, H, Tq, Tk)
        else:
            probs = _softmax_with_sink(scores, sinks).to(value.dtype)  # (B, H, Tq, Tk)
        out = torch.matmul(probs, v)  # (B, H, Tq, d)
    if policy is not None:
        # the policy scores and evicts from what this forward attended (probs: None where sdpa ran),
        # read with keys per query head and the causal mask that is_causal stood for
        k_seen = k if k.shape[1] == n_heads else eq.expand_kv(key, n_heads)  # (B, H, Tk, d)
        m_seen = mask if mask is not None or tq == 1 else _causal_additive(tq, tk, query.dtype, query.device)
        policy.observe(layer, query, k_seen, m_seen, scaling, softcap, probs)
    if rec is not None and layer is not None:
        if layer in rec.head_edits:
            out = _edit_heads(out, rec.head_edits[layer], tk - tq)
        rec._record(layer, query, key, value, attention_mask, out, scaling, softcap, sinks, score_bias)
    return out.transpose(1, 2).contiguous(), probs


def _with_selected_keys(mask: torch.Tensor | None, indices: torch.Tensor, query: torch.Tensor, tk: int) -> torch.Tensor:
    """The model's mask with every key its sparse indexer did not select masked out.

    indices: (B, Tq, k) key positions per query (shared by the heads). The same ops as the
    model's own eager path (deepseek_v32), so the probabilities are the model's to the bit.
    """
    b, tq, _ = indices.shape
    dropped = indices.new_ones((b, tq, tk), dtype=torch.bool).scatter(-1, indices.long(), False).unsqueeze(1)  # (B, 1, Tq, Tk)
    if mask is None:
        mask = _causal_additive(tq, tk, query.dtype, query.device)  # (1, 1, Tq, Tk)
    if mask.dtype == torch.bool:
        return mask & ~dropped
    return mask.masked_fill(dropped, torch.finfo(query.dtype).min)  # (B, 1, Tq, Tk)


def _edit_heads(out: torch.Tensor, edits, q0: int) -> torch.Tensor:
    """Knock out or patch head outputs before the output projection sees them.

    out: (B, H, Tq, d) for positions q0..q0+Tq. A patch writes the other run's output of the
    same head at the same positions, where that run has them.
    """
    out = out.clone()
    tq = out.shape[2]
    for h, src in edits:
        if src is None:
            out[:, h] = 0
        else:
            n = max(0, min(tq, src.shape[1] - q0))  # positions the other run reached
            if n:
                out[:, h, :n] = src[h, q0 : q0 + n].to(out.device, out.dtype)  # (n, d)
    return out


def _softmax_with_sink(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """gpt_oss's eager softmax, op for op: the sink joins each row as a last logit, then is dropped."""
    b, h, tq, _ = scores.shape
    sink = sinks.reshape(1, -1, 1, 1).expand(b, h, tq, 1).to(scores.dtype)  # (B, H, Tq, 1)
    combined = torch.cat([scores, sink], dim=-1)  # (B, H, Tq, Tk + 1)
    # transformers subtracts the row max before the softmax (overflow guard); the rounding follows it
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]  # (B, H, Tq, Tk)


def _causal_additive(tq: int, tk: int, dtype, device, rows: torch.Tensor | None = None) -> torch.Tensor:
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
    a bidirectional mask, all-allowed), which ``inspector_attention`` reproduces with ``is_causal``
    or with no mask for one query; anything else (padding, a window that bites, custom overlays)
    comes back materialised and converted exactly as ``eager_mask`` converts it.
    """
    mask = sdpa_mask(*args, allow_is_causal_skip=allow_is_causal_skip, **kwargs)  # (B, 1, Tq, Tk) bool or None
    if mask is None:
        return None
    return torch.where(mask, torch.zeros((), device=mask.device, dtype=dtype), torch.finfo(dtype).min)


AttentionInterface.register(ATTN_NAME, inspector_attention)
AttentionMaskInterface.register(ATTN_NAME, inspector_mask)

