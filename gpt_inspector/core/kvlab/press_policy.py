"""A press as a lab policy: ``from_press(press)`` runs any object with kvpress's scoring interface
(``score(module, hidden_states, keys, values, attentions, kwargs) -> (B, Hkv, T)`` and a
``compression_ratio``; kvpress's ``AdaKVPress`` and ``PerLayerCompressionPress`` wrappers, or
``presses``' copies of them, choose across heads or per layer) on kvpress's semantics:

- the first ``context`` prompt tokens (default: the whole prompt) are the context: after the prompt's
  forward reaches its last context position, each layer scores the context's entries exactly as
  kvpress's forward hook would (the context's hidden states, keys, values, attention weights if
  ``attentions``, its position embeddings) and keeps ``topk`` of the scores per KV head;
- the question (the prompt's later tokens) and every generated token attend to the kept context
  and are themselves never evicted (kvpress compresses at prefill only); with ``every=N`` the
  press scores the whole held cache again after every N-th decode step and cuts each head back to
  the share ``compression_ratio`` leaves of the entries held (the eviction while decoding that
  kvpress's ``DecodingPress`` does, per head).

Nothing is patched: the model's cache keeps every entry (its positions are already encoded) and
the policy masks what the press dropped, from the query after the one that triggered it on, which
is the same attention as a cache without those entries. The hidden states a press reads come from a
forward pre-hook on each attention module that keeps them only for this policy's own forwards.
"""

from __future__ import annotations

import weakref

import torch

from .. import attention as eq
from ..capture.recorder import RowRecorders, current_recorder
from ..errors import InspectorError
from .policy import NEVER, Policy, _to_length
from .presses import kept, scoring_press

__all__ = ["PressPolicy", "from_press"]


def _attention_modules(model) -> dict[int, torch.nn.Module]:
    """layer -> the model's attention module (the one that carries ``layer_idx`` and projects queries)."""
    out: dict[int, torch.nn.Module] = {}
    for m in model.modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int) and type(m).__name__.endswith("Attention") and idx not in out:
            out[idx] = m
    return out


def _rotary(model) -> torch.nn.Module | None:
    """The model's shared rotary embedding (kvpress hands it to every attention module)."""
    for name, m in model.named_modules():
        if name.endswith("rotary_emb") and ".layers." not in name:
            return m
    return None


class PressPolicy(Policy):
    """See the module's docstring. ``press``: the press; ``context``: how many prompt tokens are compressed
    (None: all); ``attentions``: hand the press the context's attention weights (as kvpress does under
    eager attention; None, as under sdpa, makes SnapKV and TOVA recompute their window themselves);
    ``every``: also compress while decoding, after every N-th step."""

    kind = "eviction"
    reads_query = True  # capture's KVPolicy passes the forward's query with the call (attend)

    def __init__(self, press, *, context: int | None = None, attentions: bool = False, every: int | None = None,
                 name: str | None = None):  # fmt: skip
        try:
            scoring_press(press)  # refused now if nothing in it scores
        except TypeError as e:
            raise InspectorError(str(e)) from None
        for what, v in (("context", context), ("every", every)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise InspectorError(f"{what} must be a whole number >= 1, got {v!r}")
        self.press, self.compressed, self.attentions, self.every = press, context, bool(attentions), every
        self.name = name or type(press).__name__
        self._modules: dict[int, torch.nn.Module] = {}
        self._rotary: torch.nn.Module | None = None
        self._hidden: dict[int, tuple[torch.Tensor, dict]] = {}  # layer -> (hidden states (1, T, D), kwargs)
        self.budget = None

    def describe(self) -> str:
        return f"{self.name} ratio {float(self.press.compression_ratio):g}"

    # -- the model: its attention modules, their inputs ------------------------------------------
    def bind_model(self, model) -> None:
        """Find ``model``'s attention modules and keep their inputs for this policy's forwards."""
        self._modules, self._rotary = _attention_modules(model), _rotary(model)
        if len(self._modules) != self.n_layers:
            raise InspectorError(f"{self.name}: found {len(self._modules)} attention modules with a layer index, "
                                 f"the model has {self.n_layers} layers")  # fmt: skip
        init = getattr(self.press, "post_init_from_model", None)
        if callable(init):
            init(model)
        me = weakref.ref(self)

        def keep_input(module, args, kwargs):
            policy = me()
            if policy is not None:
                policy._keep(module, args, kwargs)

        handles = [m.register_forward_pre_hook(keep_input, with_kwargs=True) for m in self._modules.values()]

        def remove() -> None:
            for h in handles:
                h.remove()

        weakref.finalize(self, remove)  # the hooks go with the policy

    def _keep(self, module, args, kwargs) -> None:
        active, rec = current_recorder(), self.recorder
        if rec is None:
            return
        row = None
        if active is rec:
            row = 0
        elif isinstance(active, RowRecorders) and rec in active.rows:
            row = active.rows.index(rec)
        if row is None:
            return
        hs = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        kwargs = dict(kwargs)
        pos = kwargs.get("position_embeddings")
        if pos is not None and hs.shape[0] > 1:  # (cos, sin) per batch row: this run's
            kwargs["position_embeddings"] = tuple(p[row : row + 1] if p.shape[0] == hs.shape[0] else p for p in pos)
        self._hidden[module.layer_idx] = (hs[row : row + 1], kwargs)

    # -- state ----------------------------------------------------------------------------------
    def reset(self) -> None:
        self._ev = [torch.empty(self.n_kv_heads, 0, dtype=torch.long, device=self.device) for _ in range(self.n_layers)]
        self._held_from: list[int] = [0] * self.n_layers  # first entry a decode-time compression may drop

    def snapshot(self):
        return [ev.clone() for ev in self._ev]

    def restore(self, snap) -> None:
        self._ev = [ev.clone() for ev in snap]

    def evicted_rows(self, layer, p0, p1, length, n_heads):
        block = self._block(_to_length(self._ev[layer], length), p0, p1 - p0, n_heads)
        return None if block is None else block.cpu()

    def evicted(self, layer, length):
        return (_to_length(self._ev[layer], length) < NEVER).cpu()

    def cache_bytes(self, layer, length):
        return self._held_bytes(layer, length, self.evicted(layer, length))

    @staticmethod
    def _block(ev: torch.Tensor, p0: int, n: int, n_heads: int) -> torch.Tensor | None:
        if not bool((ev < NEVER).any()):
            return None
        pos = torch.arange(p0, p0 + n, device=ev.device)  # (n,)
        return eq.expand_kv(ev[:, None, :] <= pos[None, :, None], n_heads)  # (H, n, T)

    # -- capture's call -------------------------------------------------------------------------
    def attend(self, layer, key, value, q0, n_heads, query=None, scaling=None, softcap=None):
        tk, tq = key.shape[2], key.shape[2] - q0
        ev = self._ev[layer] = _to_length(self._ev[layer][:, :q0], tk)  # (Hkv, Tk); a recompute starts over
        if q0 == 0:
            c = tk if self.compressed is None else self.compressed
            if c > tk:
                raise InspectorError(f"{self.name}: the context is {c} tokens, the prompt's forward only {tk}")
            self._compress(layer, key, value, query, scaling, softcap, 0, c, ev)
            self._held_from[layer] = tk
        elif self.every is not None and tq == 1 and (tk - self._held_from[layer]) % self.every == 0:
            self._compress(layer, key, value, query, scaling, softcap, q0, tk, ev)
        return key, value, self._block(ev, q0, tq, n_heads)

    def _compress(self, layer, key, value, query, scaling, softcap, q0, c, ev) -> None:
        """Score entries 0..c from what the queries q0..c of this forward show (the prompt's forward: its
        context rows) and mark those the press drops evicted from query c on (ev: (Hkv, Tk), in place).
        While decoding (q0 > 0) an entry already evicted scores lowest and the press keeps, per KV head,
        its ``compression_ratio``'s share of all c positions."""
        got = self._hidden.get(layer)
        if got is None:
            raise InspectorError(f"{self.name}: layer {layer}'s attention input was not seen (the forward ran "
                                 "outside this policy's run)")  # fmt: skip
        hs, kw = got
        n = c - q0  # the query rows the press sees
        if hs.shape[1] < n:
            raise InspectorError(f"{self.name}: layer {layer}'s kept attention input has {hs.shape[1]} rows, "
                                 f"the press needs {n}")  # fmt: skip
        module = self._modules[layer]
        keys, values = key[:, :, :c], value[:, :, :c]  # (1, Hkv, c, d)
        attn = None
        if self.attentions:
            q = query[:, :, :n]  # (1, H, n, d) positions q0..c-1
            s = eq.scores(q[0].float(), eq.expand_kv(keys, query.shape[1])[0].float(), scaling, softcap)  # (H, n, c)
            s = s + torch.triu(torch.full_like(s[0], float("-inf")), q0 + 1)  # causal
            attn = torch.softmax(s, dim=-1).to(query.dtype)[None]  # (1, H, n, c) as eager hands it over
        kwargs = dict(kw)
        kwargs.pop("past_key_values", None)
        kwargs.pop("past_key_value", None)
        kwargs["hidden_states"] = hs = hs[:, :n]
        if kw.get("position_embeddings") is not None:
            kwargs["position_embeddings"] = tuple(p[:, :n] for p in kw["position_embeddings"])
        if kw.get("cache_position") is not None:
            kwargs["cache_position"] = kw["cache_position"][:n]
        scorer = scoring_press(self.press)
        added = self._rotary is not None and not hasattr(module, "rotary_emb")
        if added:  # kvpress hands every attention module the model's rotary embedding (ExpectedAttention reads it)
            object.__setattr__(module, "rotary_emb", self._rotary)
        try:
            with torch.no_grad():
                scores = scorer.score(module, hs, keys, values, attn, kwargs)  # (1, Hkv, c)
        except (InspectorError, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001  (a user's press may raise anything: one clear line)
            raise InspectorError(f"{self.name}.score raised {type(e).__name__}: {e}") from None
        finally:
            if added:
                object.__delattr__(module, "rotary_emb")
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (1, self.n_kv_heads, c):
            got_shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise InspectorError(f"{self.name}.score returned {got_shape}; "
                                 f"expected (1, kv_heads, entries) = {(1, self.n_kv_heads, c)}")  # fmt: skip
        held = ev[:, :c] == NEVER  # (Hkv, c)
        if q0:
            scores = scores.masked_fill(~held[None], float("-inf"))
        keep = kept(self.press, layer, scores)[0]  # (Hkv, c)
        ev[:, :c][~keep & held] = c


def from_press(press, *, context: int | None = None, attentions: bool = False, every: int | None = None,
               name: str | None = None) -> PressPolicy:  # fmt: skip
    """A lab policy running ``press`` (see ``PressPolicy``)."""
    return PressPolicy(press, context=context, attentions=attentions, every=every, name=name)
