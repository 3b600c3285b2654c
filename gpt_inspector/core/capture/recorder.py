"""What a forward records, per layer: the primitives every reader of a run derives its matrices from.

Kept per layer (CPU, in ``RowBuffer``s grown geometrically so a long run re-copies each position O(1) times):
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

import torch

from .. import attention as eq
from ..edits import CompiledEdits
from ..rowbuffer import RowBuffer
from .interventions import KEY_BIAS_ATTR
from .kernel import PLAIN_CAUSAL, AppliedBias

# The recorder of the forward pass running in *this* thread (the GUI worker, a script, a test).
_ACTIVE: contextvars.ContextVar[Recorder | RowRecorders | None] = contextvars.ContextVar(
    "gpt_inspector_recorder", default=None
)


def current_recorder() -> Recorder | RowRecorders | None:
    """The recorder of the forward running in this thread (None: a forward nobody records)."""
    return _ACTIVE.get()


# a rollback's name for it: which recorder was active before a forward, put back by make_active
active_recorder = current_recorder


def make_active(rec) -> None:
    """Put back the recorder ``active_recorder`` gave: a rollback's last word on which recorder is active."""
    _ACTIVE.set(rec)


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
        # the logit lens's hooks: the residual after each layer at the newest position (D,) float32,
        # and the cache length it belongs to
        self.residual: dict[int, torch.Tensor] = {}
        self.residual_length: int | None = None
        self.calls = [0] * n_layers
        self.length = 0
        # head outputs are kept from this position on (out[layer] row i is position out_from + i): a
        # session sets it to the prompt's last position, where the first step decides a token. Earlier
        # prompt rows feed no prediction shown; keeping them would cost as much as q (on GQA models that
        # alone is twice the KV cache)
        self.out_from = 0
        # out_from never goes below this on a crop (the session's prompt's last position)
        self.out_floor = 0
        self.edits = CompiledEdits()
        # layer -> [(head, None to zero it | (H_src, T_src, d) outputs to patch in from another run)]
        self.head_edits: dict[int, list[tuple[int, torch.Tensor | None]]] = {}
        # a KV cache policy under study (core.kvlab), or None: interventions.KVPolicy makes its two calls
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
        if self.k is not None and self.v is not None:  # mirror_kv
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
            assert bias.ref is not None  # an alibi record carries its reference positions
            ref = bias.ref.detach().float().reshape(1, 1, tq, 1)  # (1, 1, Tq, 1)
            self.bias_ref[layer].write(ref.expand(bias.batch, -1, -1, -1), q0)
        else:
            # one value per key: the rows of this forward's new keys (older keys' rows are already kept)
            assert bias.rows is not None  # a per-key record carries its rows
            self.bias_rows[layer].write(bias.rows[:, :, q0:, None].detach().float(), q0)  # (B, H, Tq, 1)

    def _record_mask(self, layer, mask, q0, tq, tk, bias=None) -> None:
        if mask.shape[1] > 1 or (mask.dtype != torch.bool and bias is not None and bias.form == "key"):
            self._record_head_mask(layer, mask, q0, tq, tk, bias)
            return
        if getattr(mask, PLAIN_CAUSAL, False) and mask.shape[-1] == tk:
            return  # built plain causal by inspector_mask: no row to keep
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
        from .attend import inspector_attention as attention  # attend.py imports this module: import when called

        outs, probs = [], []
        for r, rec in enumerate(self.rows):
            one = slice(r, r + 1)
            mask = attention_mask if attention_mask is None or attention_mask.shape[0] == 1 else attention_mask[one]
            token = _ACTIVE.set(rec)
            try:
                o, pr = attention(module, query[one], key[one], value[one], mask, *args, **kwargs)
            finally:
                _ACTIVE.reset(token)
            outs.append(o)  # (1, Tq, H, d)
            probs.append(pr)
        return torch.cat(outs), None if any(pr is None for pr in probs) else torch.cat(probs)


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
