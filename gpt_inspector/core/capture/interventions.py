"""Interventions: what changes an attention call besides the model's own arguments.

Each is a small class with two hooks around the kernel. ``before`` may change the call (its keys and
values, its mask, its score bias, cells to block) and say what the kernel must hand back (the
probabilities: ``call.needs_probs``); ``after`` may read what the kernel left on the call and change
the output. An intervention is built for a call only where it applies (``of`` returns None
elsewhere), so a plain forward runs none and keeps the sdpa path exactly.

Order matters where one reads what another decided: the key bias and a KV policy put the scores in
hand or the blocked cells in one mask before mask edits choose how to apply themselves; head edits
come last, over the output the records keep.
"""

from __future__ import annotations

import torch

from .. import attention as eq
from . import kernel
from .kernel import AppliedBias, Call

# the attribute a model adapter sets on an attention module whose model passes its key bias inside
# the mask (doge): (B, H_kv, Tk), read once by the next call
KEY_BIAS_ATTR = "gpt_inspector_key_bias"


class Intervention:
    """The protocol: ``before(call)`` ahead of the kernel, ``after(call, out) -> out`` once it ran.

    out: (B, H, Tq, d_v). Either hook may be left as it is here (nothing changed).
    """

    def before(self, call: Call) -> None:
        pass

    def after(self, call: Call, out: torch.Tensor) -> torch.Tensor:
        return out


class SparseIndices(Intervention):
    """deepseek_v32's sparse attention: the keys its indexer selected are the mask, recorded as such."""

    def __init__(self, indices: torch.Tensor):
        self.indices = indices  # (B, Tq, k) key positions per query, shared by the heads

    @classmethod
    def of(cls, kwargs: dict) -> SparseIndices | None:
        indices = kwargs.pop("indices", None)
        return None if indices is None else cls(indices)

    def before(self, call: Call) -> None:
        call.model_mask = _with_selected_keys(call.model_mask, self.indices, call.query, call.tk)  # (B, 1, Tq, Tk)
        call.mask = call.model_mask[:, :, :, : call.tk]


class KeyBias(Intervention):
    """doge's learned key bias, passed inside its mask: the scores in hand, the bias recorded compactly."""

    def __init__(self, key_bias: torch.Tensor):
        self.key_bias = key_bias  # (B, Hkv, Tk), already inside the mask

    @classmethod
    def of(cls, module) -> KeyBias | None:
        key_bias = module.__dict__.pop(KEY_BIAS_ATTR, None)  # read once: the next call sets its own
        return None if key_bias is None else cls(key_bias)

    def before(self, call: Call) -> None:
        rows = eq.expand_kv(self.key_bias[:, :, None], call.n_heads)[:, :, 0]  # (B, H, Tk)
        call.bias = AppliedBias("key", rows=rows, batch=call.query.shape[0])


class KVPolicy(Intervention):
    """A KV cache policy under study (``core.kvlab``): it serves the K/V attention reads and masks what
    it evicted, then scores from what this forward attended."""

    def __init__(self, policy, layer: int):
        self.policy, self.layer = policy, layer

    @classmethod
    def of(cls, rec, layer: int) -> KVPolicy | None:
        return None if rec.kv_policy is None else cls(rec.kv_policy, layer)

    def before(self, call: Call) -> None:
        # the policy's cache as attention reads it (dequantized K/V) and the entries it no longer holds,
        # masked for these queries: (B, Hkv, Tk, d) twice and (H, Tq, Tk) bool or None. A policy that
        # holds everything leaves the call as it was, so an unlimited budget equals the plain run exactly
        args = (self.layer, call.key, call.value, call.q0, call.n_heads)
        if getattr(self.policy, "reads_query", False):  # a press scores from the forward's own queries
            call.key, call.value, evicted = self.policy.attend(*args, query=call.query, scaling=call.scaling,
                                                               softcap=call.softcap)  # fmt: skip
        else:
            call.key, call.value, evicted = self.policy.attend(*args)
        call.block_cells(evicted)
        # a policy that reads the attention weights (H2O, TOVA) takes them from this forward once it has
        # evicted something: the written-out equation instead of sdpa and then a second pass for them
        call.needs_probs = evicted is not None and call.tq == 1 and getattr(self.policy, "reads_probs", False)

    def after(self, call: Call, out: torch.Tensor) -> torch.Tensor:
        # read with keys per query head and the causal mask that is_causal stood for (probs: None where sdpa ran)
        assert call.kv_used is not None  # after(): the kernel ran
        k = call.kv_used[0]
        k_seen = k if k.shape[1] == call.n_heads else eq.expand_kv(call.key, call.n_heads)  # (B, H, Tk, d)
        q = call.query
        m_seen = call.mask
        if m_seen is None and call.tq > 1:
            m_seen = kernel.causal_additive(call.tq, call.tk, q.dtype, q.device)  # (1, 1, Tq, Tk)
        self.policy.observe(self.layer, q, k_seen, m_seen, call.scaling, call.softcap, call.probs)
        return out


class MaskEdits(Intervention):
    """The user's blocked query→key cells. Where the scores are in hand, or a KV policy reads the mask
    back, they join the one dense mask; on the sdpa path only the rows they touch are computed again,
    each with its own mask per head, so a recompute at long T never builds (H, Tq, Tk)."""

    def __init__(self, edits, layer: int, dense: bool):
        self.edits, self.layer, self.dense = edits, layer, dense
        self.rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (offsets (n,), blocked (H, n, Tk))

    @classmethod
    def of(cls, rec, layer: int) -> MaskEdits | None:
        # a policy's evictions are blocked cells too: with one, the edits join them in one mask
        return cls(rec.edits, layer, dense=rec.kv_policy is not None) if layer in rec.edits.heads else None

    def before(self, call: Call) -> None:
        if self.dense or call.written_out:
            call.block_cells(self.edits.block_for(self.layer, call.n_heads, call.q0, call.tq, call.tk))  # (H, Tq, Tk)
        else:
            self.rows = self.edits.rows_for(self.layer, call.n_heads, call.q0, call.tq, call.tk)

    def after(self, call: Call, out: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return out
        q = call.query
        offsets, block = self.rows[0].to(q.device), self.rows[1].to(q.device)  # (n,), (H, n, Tk)
        if call.mask is not None:
            base = call.mask.index_select(2, offsets)  # (B, 1 or H, n, Tk)
        else:
            base = kernel.causal_additive(call.tq, call.tk, q.dtype, q.device, offsets)  # (1, 1, n, Tk)
        new = kernel.again(call, offsets, base.masked_fill(block, torch.finfo(q.dtype).min))  # (B, H, n, d_v)
        # only the (head, row) pairs an edit touches: the others keep the first pass's numbers exactly
        h_idx, r_idx = block.any(-1).nonzero(as_tuple=True)  # (m,), (m,)
        out[:, h_idx, offsets[r_idx]] = new[:, h_idx, r_idx]  # (B, m, d_v)
        return out


class HeadEdits(Intervention):
    """Knock out or patch head outputs before the output projection (and the records) see them."""

    def __init__(self, edits: list[tuple[int, torch.Tensor | None]]):
        self.edits = edits  # [(head, None to zero it | (H_src, T_src, d) outputs from another run)]

    @classmethod
    def of(cls, rec, layer: int) -> HeadEdits | None:
        edits = rec.head_edits.get(layer)
        return None if edits is None else cls(edits)

    def after(self, call: Call, out: torch.Tensor) -> torch.Tensor:
        """out: (B, H, Tq, d) for positions q0..q0+Tq. A patch writes the other run's output of the same
        head at the same positions, where that run has them."""
        out = out.clone()
        q0, tq = call.q0, call.tq
        for h, src in self.edits:
            if src is None:
                out[:, h] = 0
            else:
                n = max(0, min(tq, src.shape[1] - q0))  # positions the other run reached
                if n:
                    out[:, h, :n] = src[h, q0 : q0 + n].to(out.device, out.dtype)  # (n, d)
        return out


def interventions_for(module, rec, layer: int | None, kwargs: dict) -> list[Intervention]:
    """The interventions one call runs, in order; ``rec``: the active recorder (None: a bare call)."""
    found: list[Intervention] = [i for i in (SparseIndices.of(kwargs), KeyBias.of(module)) if i is not None]
    # a plain step asks the recorder once: every attention call of every forward comes through here
    if rec is not None and layer is not None and (rec.kv_policy is not None or rec.edits.heads or rec.head_edits):
        more = (KVPolicy.of(rec, layer), MaskEdits.of(rec, layer), HeadEdits.of(rec, layer))
        found += [i for i in more if i is not None]
    return found


def _with_selected_keys(mask: torch.Tensor | None, indices: torch.Tensor, query: torch.Tensor, tk: int) -> torch.Tensor:
    """The model's mask with every key its sparse indexer did not select masked out.

    indices: (B, Tq, k) key positions per query (shared by the heads). The same ops as the
    model's own eager path (deepseek_v32), so the probabilities are the model's to the bit.
    """
    b, tq, _ = indices.shape
    dropped = indices.new_ones((b, tq, tk), dtype=torch.bool).scatter(-1, indices.long(), False)  # (B, Tq, Tk)
    dropped = dropped.unsqueeze(1)  # (B, 1, Tq, Tk)
    if mask is None:
        mask = kernel.causal_additive(tq, tk, query.dtype, query.device)  # (1, 1, Tq, Tk)
    if mask.dtype == torch.bool:
        return mask & ~dropped
    return mask.masked_fill(dropped, torch.finfo(query.dtype).min)  # (B, 1, Tq, Tk)
