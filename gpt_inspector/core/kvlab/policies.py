"""KV cache policies, simulated exactly inside the inspector's attention function.

A policy is attached to a session's recorder (``attach``); ``capture.inspector_attention`` then
makes two calls per layer and forward:

- ``attend(layer, key, value, q0, n_heads)`` before attention: the K/V the policy's cache would
  hand attention (dequantized for quantization policies) and a per-head block of the entries it
  has evicted. The model's cache keeps every position (their positions are already encoded in
  the keys), so masking an evicted entry for every later query of its head equals dropping it.
- ``observe(...)`` after attention: scoring from what this forward attended, then eviction down
  to the budget. An entry evicted after the forward whose last query is position p - 1 is
  masked from query p on (``evicted_at``).

Conventions (the same for every eviction policy): the prompt's forward attends in full, as
H2O, SnapKV and TOVA's reference code and HF's SinkCache do; the cache is then cut to the budget
and after every later step again. A budget counts entries per KV head (what a cache stores);
query heads sharing a KV head (GQA) share its evictions, scores are summed over the group.

Quantization (KIVI): keys per channel over groups of ``group`` tokens, values per token over
groups of ``group`` channels, asymmetric min-max rounding to ``bits``; the newest ``residual``
entries stay in full precision, and a key group is quantized once all its tokens have left the
residual window. The prompt's forward attends in full precision (as KIVI and HF's quantized cache
do); from the next step on attention reads the dequantized entries. fp8 casts each element to
float8 (e4m3fn or e5m2) and back, no scale, with the same residual window.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .. import attention as eq
from ..errors import InspectorError

NEVER = torch.iinfo(torch.long).max  # evicted_at of an entry still held

EVICTION = ("streaming", "h2o", "snapkv", "tova", "keynorm", "custom")
QUANT = ("int8", "int4", "int2", "fp8-e4m3", "fp8-e5m2")
NAMES = EVICTION[:-1] + QUANT  # what the CLI offers (custom takes a Python function)

# a user scoring function: (layer, keys (Hkv, T, d), probs (H, Tq, T) of this forward) -> (Hkv, T), higher keeps
Scorer = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def _budget(v, what: str, limit: int) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise InspectorError(f"{what} must be a whole number of cache entries, got {v!r}")
    if v <= 0:
        raise InspectorError(f"{what} must be at least 1 cache entry, got {v}")
    if v > limit:
        raise InspectorError(f"{what} is {v} entries, more than the model's context of {limit}: use no budget for a full cache")
    return int(v)


class Policy:
    """Base: a policy's settings and, once ``bind``-ed to a model, its running state."""

    name = "full"
    kind = "eviction"

    def bind(self, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, context: int, itemsize: int) -> None:
        self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim = n_layers, n_heads, n_kv_heads, head_dim
        self.context, self.itemsize = context, itemsize
        self.recorder = None
        self.reset()

    def attach(self, recorder) -> None:
        """Make ``recorder``'s forwards run under this policy (and keep its K/V records in step)."""
        self.recorder = recorder
        recorder.kv_policy = self

    def reset(self) -> None:
        pass

    def describe(self) -> str:
        return self.name

    # -- capture's two calls ---------------------------------------------------------------------
    def attend(self, layer, key, value, q0, n_heads):
        return key, value, None

    def observe(self, layer, query, k, mask, scaling, softcap, probs) -> None:
        pass

    # -- readers ---------------------------------------------------------------------------------
    def evicted_rows(self, layer: int, p0: int, p1: int, length: int, n_heads: int) -> torch.Tensor | None:
        """(H, p1 - p0, length) bool: entries evicted when query rows p0..p1 ran, or None (nothing)."""
        return None

    def evicted(self, layer: int, length: int) -> torch.Tensor:
        """(Hkv, length) bool: entries the policy's cache no longer holds now."""
        return torch.zeros(self.n_kv_heads, length, dtype=torch.bool)

    def cache_bytes(self, layer: int, length: int) -> int:
        """Bytes this layer's policy cache holds for ``length`` positions."""
        return 2 * self.n_kv_heads * length * self.head_dim * self.itemsize

    def snapshot(self):
        return None

    def restore(self, snap) -> None:
        pass


# ---------------------------------------------------------------------- eviction


class Eviction(Policy):
    """Keep ``sinks`` first entries and ``recent`` newest ones, then the best-scoring rest.

    ``budget``: entries per KV head (None: unlimited); ``layer_budgets``: ``{layer: n}`` or
    ``{layer: [n per KV head]}`` overriding it.
    """

    def __init__(self, name: str, budget: int | None, *, sinks: int | None = None, recent: int | None = None,
                 layer_budgets: Mapping | None = None, window: int = 8, kernel: int = 5,
                 scorer: Scorer | None = None):  # fmt: skip
        if name not in EVICTION:
            raise InspectorError(f"unknown eviction policy {name!r}; use one of {', '.join(EVICTION)}")
        if name == "custom" and not callable(scorer):
            raise InspectorError("the custom policy needs a scoring function: scorer(layer, keys, probs) -> (Hkv, T)")
        self.name, self.budget, self.sinks, self.recent = name, budget, sinks, recent
        self.layer_budgets = dict(layer_budgets or {})
        self.window, self.kernel, self.scorer = window, kernel, scorer

    def describe(self) -> str:
        return f"{self.name} budget {'unlimited' if self.budget is None else self.budget}"

    def bind(self, n_layers, n_heads, n_kv_heads, head_dim, context, itemsize) -> None:
        for what, v in (("sinks", self.sinks), ("recent", self.recent), ("window", self.window), ("kernel", self.kernel)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0):
                raise InspectorError(f"{what} must be a whole number >= 0, got {v!r}")
        base = _budget(self.budget, "budget", context)
        self.budgets: list[torch.Tensor | None] = [None] * n_layers  # per layer (Hkv,) long, None: unlimited
        for layer in range(n_layers):
            b = self.layer_budgets.get(layer, base)
            if isinstance(b, Sequence) and not isinstance(b, str):
                if len(b) != n_kv_heads:
                    raise InspectorError(f"layer {layer} budgets: {len(b)} given, the model has {n_kv_heads} KV heads")
                per = [_budget(x, f"layer {layer} budget", context) for x in b]
                self.budgets[layer] = None if any(x is None for x in per) else torch.tensor(per)
            else:
                b = _budget(b, f"layer {layer} budget", context)
                self.budgets[layer] = None if b is None else torch.full((n_kv_heads,), b)
        bad = [layer for layer in self.layer_budgets if not (isinstance(layer, int) and 0 <= layer < n_layers)]
        if bad:
            raise InspectorError(f"layer budgets name layers {bad}; the model has layers 0..{n_layers - 1}")
        if self.sinks is None:  # StreamingLLM's 4 attention sinks (fewer under a tiny budget); none elsewhere
            low = min((int(b.min()) for b in self.budgets if b is not None), default=5)
            self.sinks = min(4, low - 1) if self.name == "streaming" else 0
        for layer, b in enumerate(self.budgets):
            if b is None:
                continue
            low = int(b.min())
            protected = self.sinks if self.name == "streaming" else self._protected(low)
            if low <= protected:
                raise InspectorError(f"layer {layer}: a budget of {low} leaves no room beyond the {protected} "
                                     "protected entries (sinks + recent window); raise the budget")  # fmt: skip
        super().bind(n_layers, n_heads, n_kv_heads, head_dim, context, itemsize)

    def _recent(self, budget: int) -> int:
        if self.recent is not None:
            return self.recent
        if self.name == "streaming":
            return budget - self.sinks  # StreamingLLM: what the sinks leave is the window
        if self.name == "h2o":
            return budget // 2  # H2O: half heavy hitters, half recent
        if self.name == "snapkv":
            return self.window
        return 0

    def _protected(self, budget: int) -> int:
        return self.sinks + self._recent(budget) if self.name != "streaming" else budget

    def reset(self) -> None:
        self.evicted_at = [torch.empty(self.n_kv_heads, 0, dtype=torch.long) for _ in range(self.n_layers)]
        self.scores = [torch.empty(self.n_kv_heads, 0, dtype=torch.float64) for _ in range(self.n_layers)]

    def snapshot(self):
        return [t.clone() for t in self.evicted_at], [t.clone() for t in self.scores]

    def restore(self, snap) -> None:
        self.evicted_at, self.scores = [t.clone() for t in snap[0]], [t.clone() for t in snap[1]]

    def _grow(self, layer: int, tk: int) -> torch.Tensor:
        ev = self.evicted_at[layer]
        if ev.shape[1] < tk:
            ev = torch.cat([ev, torch.full((ev.shape[0], tk - ev.shape[1]), NEVER, dtype=torch.long)], 1)
            self.evicted_at[layer] = ev
        else:
            ev = self.evicted_at[layer] = ev[:, :tk]  # a shorter forward (a recompute) starts over from there
        return ev

    def attend(self, layer, key, value, q0, n_heads):
        tk = key.shape[2]
        ev = self._grow(layer, tk)  # (Hkv, Tk)
        return key, value, self._block(ev, q0, tk - q0, n_heads)

    @staticmethod
    def _block(ev: torch.Tensor, p0: int, n: int, n_heads: int) -> torch.Tensor | None:
        if not bool((ev < NEVER).any()):
            return None
        pos = torch.arange(p0, p0 + n)  # (n,)
        block = ev[:, None, :] <= pos[None, :, None]  # (Hkv, n, T)
        return eq.expand_kv(block, n_heads)  # (H, n, T)

    def evicted_rows(self, layer, p0, p1, length, n_heads):
        ev = self.evicted_at[layer][:, :length]
        if ev.shape[1] < length:
            ev = torch.cat([ev, torch.full((ev.shape[0], length - ev.shape[1]), NEVER, dtype=torch.long)], 1)
        return self._block(ev, p0, p1 - p0, n_heads)

    def evicted(self, layer, length):
        ev = self.evicted_at[layer]
        out = torch.zeros(self.n_kv_heads, length, dtype=torch.bool)
        n = min(length, ev.shape[1])
        out[:, :n] = ev[:, :n] < NEVER
        return out

    def cache_bytes(self, layer, length):
        held = int((~self.evicted(layer, length)).sum())
        return 2 * held * self.head_dim * self.itemsize

    # -- scoring and eviction, after the layer's attention ---------------------------------------
    def observe(self, layer, query, k, mask, scaling, softcap, probs) -> None:
        budget = self.budgets[layer]
        tq, tk = query.shape[2], k.shape[2]
        q0 = tk - tq
        if self.name == "snapkv" and q0 > 0:
            return  # SnapKV compresses the prompt once; generated entries are all kept
        need_probs = self.name in ("h2o", "snapkv", "tova", "custom")
        if budget is None and self.name != "h2o":
            return  # unlimited: nothing is ever evicted, no score needed
        rows = {"h2o": range(tq), "custom": range(tq), "tova": range(tq - 1, tq),
                "snapkv": range(max(0, tq - self.window), tq)}.get(self.name)  # fmt: skip
        p = None
        if need_probs:
            p = self._probs(query, k, mask, scaling, softcap, probs, rows)  # (H, n, Tk) float32
        score = self._score(layer, k, p, tk)  # (Hkv, Tk) float64
        if budget is not None:
            self._evict(layer, score, budget, tk)

    def _probs(self, query, k, mask, scaling, softcap, probs, rows) -> torch.Tensor:
        r0, r1 = rows.start, rows.stop
        if probs is not None:
            return probs[0, :, r0:r1].float()
        s = eq.scores(query[0, :, r0:r1].float(), k[0].float(), scaling, softcap)  # (H, n, Tk)
        if mask is not None:
            s = s + mask[0, :, r0:r1].float()  # (H or 1, n, Tk) additive, the mask attention used
        return torch.softmax(s, dim=-1)

    def _group_sum(self, x: torch.Tensor) -> torch.Tensor:
        # (H, ...) -> (Hkv, ...): the query heads that read one KV head
        return x.reshape(self.n_kv_heads, -1, *x.shape[1:]).sum(1)

    def _score(self, layer, k, p, tk) -> torch.Tensor:
        name = self.name
        if name == "h2o":
            acc = self.scores[layer]
            if acc.shape[1] < tk:
                acc = torch.cat([acc, torch.zeros(acc.shape[0], tk - acc.shape[1], dtype=torch.float64)], 1)
            acc = acc[:, :tk] + self._group_sum(p.sum(1)).double()  # accumulated attention, (Hkv, Tk)
            self.scores[layer] = acc
            return acc
        if name == "tova":
            return self._group_sum(p[:, -1]).double()  # the newest query's attention, (Hkv, Tk)
        if name == "snapkv":
            s = self._group_sum(p.sum(1)).double()  # (Hkv, Tk) observation-window votes
            kern = max(1, self.kernel)
            return F.avg_pool1d(s[:, None], kern, stride=1, padding=kern // 2, count_include_pad=False)[:, 0, :tk]
        if name == "keynorm":
            g = self.n_heads // self.n_kv_heads
            return -k[0, ::g].double().norm(dim=-1)  # low key norm = kept, (Hkv, Tk)
        if name == "custom":
            return self._custom(layer, k, p, tk)
        return torch.zeros(self.n_kv_heads, tk, dtype=torch.float64)  # streaming: position alone decides

    def _custom(self, layer, k, p, tk) -> torch.Tensor:
        g = self.n_heads // self.n_kv_heads
        try:
            out = self.scorer(layer, k[0, ::g].detach().clone(), p.detach().clone())
        except Exception as e:
            raise InspectorError(f"the scoring function raised {type(e).__name__}: {e}") from None
        if not isinstance(out, torch.Tensor):
            out = torch.as_tensor(np.asarray(out))
        if tuple(out.shape) != (self.n_kv_heads, tk):
            raise InspectorError(f"the scoring function returned shape {tuple(out.shape)}; "
                                 f"expected (kv_heads, positions) = ({self.n_kv_heads}, {tk})")  # fmt: skip
        out = out.detach().to("cpu", torch.float64)
        if not bool(torch.isfinite(out).all()):
            raise InspectorError("the scoring function returned NaN or infinite scores")
        return out

    def _evict(self, layer, score, budget, tk) -> None:
        """Cut every KV head over its budget down to it, all heads at once (no per-head loop)."""
        ev = self.evicted_at[layer]  # (Hkv, Tk)
        held = ev == NEVER  # (Hkv, Tk)
        over = held.sum(1) > budget  # (Hkv,)
        if not bool(over.any()):
            return
        pos = torch.arange(tk)
        recent = torch.tensor([min(self._recent(int(b)), tk) for b in budget])  # (Hkv,)
        protect = (pos[None, :] < self.sinks) | (pos[None, :] >= tk - recent[:, None])  # (Hkv, Tk)
        protect &= held
        room = budget - protect.sum(1)  # (Hkv,)
        cand = held & ~protect
        s = score.masked_fill(~cand, -math.inf)  # (Hkv, Tk)
        # rank of each entry by score, best first; ties go to the older entry (stable), so runs reproduce
        order = torch.sort(-s, dim=1, stable=True).indices  # (Hkv, Tk)
        rank = torch.empty_like(order).scatter_(1, order, pos.expand_as(order).contiguous())
        keep = protect | (cand & (rank < room[:, None]))
        ev[held & ~keep & over[:, None]] = tk  # masked from the next query position on


# ---------------------------------------------------------------------- quantization


def quantize_groups(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Asymmetric min-max fake quantization of ``x`` with one scale and zero per slice along ``dim``.

    x is float; returns the dequantized values in float32: round((x - min) / s) * s + min with
    s = (max - min) / (2^bits - 1).
    """
    x = x.float()
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    levels = 2**bits - 1
    scale = (hi - lo) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round((x - lo) / scale), 0, levels)
    return q * scale + lo


class Quantization(Policy):
    """KIVI-style int quantization (``int8``/``int4``/``int2``) or an fp8 cast, with a residual window."""

    kind = "quantization"

    def __init__(self, name: str, *, group: int | None = None, residual: int = 16):
        if name not in QUANT:
            raise InspectorError(f"unknown quantization {name!r}; use one of {', '.join(QUANT)}")
        self.name, self.group, self.residual = name, group, residual
        self.bits = {"int8": 8, "int4": 4, "int2": 2}.get(name, 8)
        self.fp8 = {"fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}.get(name)

    def describe(self) -> str:
        extra = "" if self.fp8 is not None else f" group {self.group}"
        return f"{self.name}{extra} residual {self.residual}"

    def bind(self, n_layers, n_heads, n_kv_heads, head_dim, context, itemsize) -> None:
        if self.group is None:
            self.group = min(32, head_dim)  # KIVI's default, or one group per head on small heads
        for what, v in (("group", self.group), ("residual", self.residual)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < (1 if what == "group" else 0):
                raise InspectorError(f"{what} must be a whole number >= {1 if what == 'group' else 0}, got {v!r}")
        if self.fp8 is None and head_dim % self.group:
            raise InspectorError(f"group {self.group} does not divide the head size {head_dim} (values are grouped along it)")
        super().bind(n_layers, n_heads, n_kv_heads, head_dim, context, itemsize)

    def boundaries(self, length: int) -> tuple[int, int]:
        """(keys, values) quantized at the front of a cache of ``length`` entries."""
        old = max(0, length - self.residual)
        if self.fp8 is not None:
            return old, old
        return old // self.group * self.group, old  # keys wait for a whole group of tokens

    def reset(self) -> None:
        self.deq_k = [None] * self.n_layers  # per layer (B, Hkv, Qk, d): dequantized once, fixed after
        self.deq_v = [None] * self.n_layers
        self.written = [(0, 0)] * self.n_layers  # rows of the recorder's K and V already holding dequantized values
        self.quantized = [(0, 0)] * self.n_layers  # boundaries the last forward used

    def snapshot(self):
        return list(self.deq_k), list(self.deq_v), list(self.written), list(self.quantized)

    def restore(self, snap) -> None:
        self.deq_k, self.deq_v, self.written, self.quantized = (list(x) for x in snap)

    def _deq_keys(self, k: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return k.to(self.fp8).to(k.dtype)
        b, h, n, d = k.shape  # n is a whole number of groups
        g = k.reshape(b, h, n // self.group, self.group, d)  # tokens grouped, per channel
        return quantize_groups(g, self.bits, 3).reshape(b, h, n, d).to(k.dtype)

    def _deq_values(self, v: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return v.to(self.fp8).to(v.dtype)
        b, h, n, d = v.shape
        g = v.reshape(b, h, n, d // self.group, self.group)  # channels grouped, per token
        return quantize_groups(g, self.bits, 4).reshape(b, h, n, d).to(v.dtype)

    @staticmethod
    def _extend(cached, full: torch.Tensor, upto: int, fn) -> torch.Tensor:
        if cached is not None and cached.shape[0] != full.shape[0]:
            cached = None  # another batch: start over
        have = 0 if cached is None else cached.shape[2]
        if have > upto:  # a shorter cache than last time (rolled back): keep what still applies
            cached, have = cached[:, :, :upto], upto
        if upto > have:
            new = fn(full[:, :, have:upto])
            cached = new if cached is None or have == 0 else torch.cat([cached, new], 2)
        return full[:, :, :0] if cached is None else cached

    def attend(self, layer, key, value, q0, n_heads):
        tk = key.shape[2]
        if q0 == 0:
            self.quantized[layer] = (0, 0)
            return key, value, None  # the prompt's own forward attends in full precision
        qk, qv = self.boundaries(tk)
        dk = self.deq_k[layer] = self._extend(self.deq_k[layer], key, qk, self._deq_keys)
        dv = self.deq_v[layer] = self._extend(self.deq_v[layer], value, qv, self._deq_values)
        key = torch.cat([dk, key[:, :, qk:]], 2)  # (B, Hkv, Tk, d)
        value = torch.cat([dv, value[:, :, qv:]], 2)
        self.quantized[layer] = (qk, qv)
        rec = self.recorder
        if rec is not None and rec.mirror_kv:
            # capture records rows q0.. of what attention read; older rows that were quantized since
            # are rewritten here, so the records always hold the cache as the last forward read it
            done = list(self.written[layer])
            for i, (buf, x, upto) in enumerate(((rec.k[layer], key, qk), (rec.v[layer], value, qv))):
                lo, hi = done[i], min(upto, q0)
                if hi > lo:
                    buf.write(x[:, :, lo:hi].detach(), lo)
                    done[i] = hi
            self.written[layer] = tuple(done)
        return key, value, None

    def cache_bytes(self, layer, length):
        qk, qv = self.boundaries(length)
        hd, item = self.n_kv_heads * self.head_dim, self.itemsize
        full = (length - qk + length - qv) * hd * item
        if self.fp8 is not None:
            return full + (qk + qv) * hd
        packed = math.ceil((qk + qv) * hd * self.bits / 8)
        groups = (qk // self.group) * hd + qv * (hd // self.group)  # one scale and one zero each
        return full + packed + 2 * groups * item


def make(name: str, budget: int | None = None, **options) -> Policy:
    """A policy by name: an eviction policy with ``budget`` entries per KV head, or a quantization.

    Options: eviction ``sinks``, ``recent``, ``layer_budgets``, ``window`` and ``kernel`` (SnapKV),
    ``scorer`` (custom); quantization ``group`` and ``residual``.
    """
    if not isinstance(name, str):
        raise InspectorError(f"policy must be a name, got {name!r}")
    if name in QUANT:
        if budget is not None:
            raise InspectorError(f"{name} is a quantization; it takes no budget (its knobs are group and residual)")
        return Quantization(name, **options)
    if name in EVICTION:
        return Eviction(name, budget, **options)
    raise InspectorError(f"unknown policy {name!r}; use one of {', '.join(NAMES)} (or custom with a scorer)")
