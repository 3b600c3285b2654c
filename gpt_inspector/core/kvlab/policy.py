"""The KV cache policy: one ``Intervention`` that runs any eviction scorer, simulated exactly inside the
inspector's attention function (the same hooks serve ``quant``'s quantizations).

A policy is attached to a session's recorder (``attach``); capture's ``KVPolicy`` intervention then
makes two calls per layer and forward:

- ``attend(layer, key, value, q0, n_heads)`` before attention: the K/V the policy's cache would
  hand attention (dequantized for quantization policies) and a per-head block of the entries it
  has evicted. The model's cache keeps every position (their positions are already encoded in
  the keys), so masking an evicted entry for every later query of its head equals dropping it.
- ``observe(...)`` after attention: scoring from what this forward attended, then eviction down
  to the budget. An entry evicted after the forward whose last query is position p - 1 is
  masked from query p on (``evicted_at``).

Where an eviction is decided: ``Eviction.observe`` asks the scorer (``scorers``) for a score per
entry, and ``Eviction._evict`` keeps, per KV head, the protected entries (sinks, recent window)
and the best-scoring rest up to the budget. On a decode step ``observe`` defers both to
``_flush``, which does the same for all layers of the forward in one batched pass.

Conventions (the same for every scorer): the prompt's forward attends in full, as H2O, SnapKV and
TOVA's reference code and HF's SinkCache do; the cache is then cut to the budget and after every
later step again. A budget counts entries per KV head (what a cache stores); query heads sharing
a KV head (GQA) share its evictions, scores are summed over the group.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F

from .. import attention as eq
from ..errors import InspectorError
from . import registry, serving
from .registry import EVICTION, NAMES, QUANT
from .scorers import ScoreFunction, Scorer, Seen, checked

__all__ = ["EVICTION", "NAMES", "NEVER", "QUANT", "Eviction", "Policy", "make"]

NEVER = torch.iinfo(torch.long).max  # evicted_at of an entry still held


def _to_length(ev: torch.Tensor, n: int) -> torch.Tensor:
    """(Hkv, n): a layer's evicted_at cut to ``n`` entries, or grown by held (NEVER) ones."""
    if ev.shape[1] < n:
        return torch.cat([ev, ev.new_full((ev.shape[0], n - ev.shape[1]), NEVER)], 1)
    return ev[:, :n]


def _budget(v, what: str, limit: int) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise InspectorError(f"{what} must be a whole number of cache entries, got {v!r}")
    if v <= 0:
        raise InspectorError(f"{what} must be at least 1 cache entry, got {v}")
    if v > limit:
        raise InspectorError(
            f"{what} is {v} entries, more than the model's context of {limit}: use no budget for a full cache"
        )
    return int(v)


class Policy:
    """Base: a policy's settings and, once ``bind``-ed to a model, its running state."""

    name = "full"
    kind = "eviction"
    # the model's cache layout (core.kv_layout.KVLayout), set by the lab. A policy's cache is built on
    # the model's own: a sliding-window layer holds no entry older than its window, a latent cache
    # holds latent rows, a layer that reads another layer's cache holds nothing
    layout = None

    def bind(self, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, context: int, itemsize: int,
             device: str | torch.device = "cpu") -> None:  # fmt: skip
        self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim = n_layers, n_heads, n_kv_heads, head_dim
        # the policy's state lives where the model's keys do: attention on a GPU reads its masks there
        self.context, self.itemsize, self.device = context, itemsize, torch.device(device)
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
        """(Hkv, length) bool on the CPU: entries the policy's cache no longer holds now."""
        return torch.zeros(self.n_kv_heads, length, dtype=torch.bool)

    def cache_bytes(self, layer: int, length: int) -> int:
        """Bytes this layer's policy cache holds for ``length`` positions."""
        return self._held_bytes(layer, length, None)

    def paged_bytes(self, layer: int, length: int, page: int | None = None) -> int | None:
        """Bytes a paged cache of ``page``-position pages (default: the policy's own page) allocates for
        what this layer's policy cache holds; None where pages mean nothing (a quantized store)."""
        return None if self.kind == "quantization" else self._held_bytes(layer, length, None, page or 1)

    def full_bytes(self, layer: int, length: int, page: int = 1) -> int:
        """Bytes of the full cache (nothing evicted, full precision), in pages of ``page`` positions."""
        return self._held_bytes(layer, length, None, page)

    def _held_bytes(self, layer: int, length: int, evicted: torch.Tensor | None, page: int = 1) -> int:
        """Bytes of the entries not ``evicted`` ((Hkv, length) bool; None: none is) among those the
        model's own cache holds for ``layer`` after ``length`` positions; with ``page`` > 1, of the
        pages of that many positions holding them (``serving.paged_entries``)."""
        held = (
            torch.ones(self.n_kv_heads, length, dtype=torch.bool) if evicted is None else ~evicted.cpu()
        )  # (Hkv, length)
        lk = None if self.layout is None else self.layout.layers[layer]
        if lk is None:  # no layout known: a per-head cache of every position; or a layer without attention
            if self.layout is not None:
                return 0
            return 2 * serving.paged_entries(held, 0, page) * self.head_dim * self.itemsize
        lo = length - lk.held(length)
        if lk.reads is not None and lk.reads != layer:
            return 0  # it reads another layer's cache (KV sharing)
        if lk.reads is None:  # a latent or untiled heads: a row goes only once every KV head evicted it
            rows = serving.paged_entries(held.any(0, keepdim=True), lo, page)
            return rows * lk.cache_numbers * self.itemsize
        n = serving.paged_entries(held, lo, page)
        return n * (lk.cache_numbers // self.n_kv_heads) * self.itemsize  # per KV head: its K and V

    def settings(self) -> dict:
        """The serving settings (``Eviction``'s schedule, page and share), as the JSON outputs record them."""
        return {}

    def snapshot(self):
        """The policy's state now (taken after each step), for ``restore`` to put back exactly after a
        step back or a failed step; it includes any record rows the next forward may rewrite."""
        return None

    def restore(self, snap) -> None:
        """Put the state ``snapshot`` took back; the session's cache and records are already cropped."""
        pass

    # -- records a quantizing policy rewrites (rows of what attention read that it quantized since) --
    def _save_records(self, lows: list[tuple[int, int]]) -> list | None:
        """Copies of the K and V record rows from ``lows[layer]`` = (keys' row, values' row) on."""
        rec = self.recorder
        if rec is None or not rec.mirror_kv:
            return None
        out = []
        for layer, los in enumerate(lows):
            rows = []
            for buf, lo in zip((rec.k[layer], rec.v[layer]), los):
                t = buf.t
                rows.append(None if t is None or lo >= rec.length else (lo, t[:, :, lo : rec.length].clone()))
            out.append(rows)
        return out

    def _restore_records(self, saved: list | None) -> None:
        rec = self.recorder
        if saved is None or rec is None or not rec.mirror_kv:
            return
        with torch.inference_mode():  # the record buffers are inference tensors
            for layer, rows in enumerate(saved):
                for buf, got in zip((rec.k[layer], rec.v[layer]), rows):
                    if got is not None:
                        buf.write(got[1], got[0])


# ---------------------------------------------------------------------- eviction


class Eviction(Policy):
    """Keep ``sinks`` first entries and ``recent`` newest ones, then the rest its scorer rates best.

    ``name``: a registered scorer's name (``registry``) or a ``Scorer``; ``budget``: entries per KV
    head (None: unlimited); ``layer_budgets``: ``{layer: n}`` or ``{layer: [n per KV head]}``
    overriding it. ``window`` and ``kernel`` go to a scorer that takes them (SnapKV), ``scorer`` (a
    function) to ``custom``. Serving constraints (``serving``): ``schedule`` (``step``, ``prefill``,
    ``append`` or every N steps), ``page`` (evict whole pages of that many positions; bytes counted
    in pages), ``share`` (``head``, or ``layer``: AdaKV, a layer's heads share its budget).
    """

    def __init__(self, name: str | Scorer, budget: int | None, *, sinks: int | None = None, recent: int | None = None,
                 layer_budgets: Mapping | None = None, window: int = 8, kernel: int = 5,
                 scorer: ScoreFunction | None = None, schedule: str | int = "step", page: int | None = None,
                 share: str = "head"):  # fmt: skip
        if isinstance(name, Scorer):
            rule = name
        else:
            cls = registry.scorer_class(name)
            given = {"window": window, "kernel": kernel, "scorer": scorer}
            rule = cls(**{k: given[k] for k in cls.options})
        self.scorer = rule
        self.name, self.budget, self.sinks, self.recent = rule.name or type(rule).__name__, budget, sinks, recent
        self.layer_budgets = dict(layer_budgets or {})
        self.window, self.kernel = window, kernel
        self.serving = serving.Serving.checked(schedule, page, share)
        self.schedule, self.page, self.share = self.serving.schedule, self.serving.page, self.serving.share
        self._prompt_length: int | None = None  # set by the prompt's forward: decode steps count from it

    @property
    def reads_probs(self) -> bool:
        """Whether each decode step's scoring reads the attention weights (see capture's ``KVPolicy``)."""
        return self.scorer.needs_attention and not self.scorer.prompt_only

    def describe(self) -> str:
        return self.serving.describe(self.name, self.budget)

    def settings(self) -> dict:
        return self.serving.settings()

    def paged_bytes(self, layer, length, page=None):
        return self._held_bytes(layer, length, self.evicted(layer, length), page or self.page)

    def bind(self, n_layers, n_heads, n_kv_heads, head_dim, context, itemsize, device="cpu") -> None:
        for what, v in (
            ("sinks", self.sinks),
            ("recent", self.recent),
            ("window", self.window),
            ("kernel", self.kernel),
        ):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0):
                raise InspectorError(f"{what} must be a whole number >= 0, got {v!r}")
        base = _budget(self.budget, "budget", context)
        self._recent_cache: dict[int, torch.Tensor] = {}
        self._uniform: dict[int, bool] = {}  # layer -> one budget for all its KV heads
        self.budgets: list[torch.Tensor | None] = [None] * n_layers  # per layer (Hkv,) long, None: unlimited
        for layer in range(n_layers):
            b = self.layer_budgets.get(layer, base)
            per = list(b) if isinstance(b, Sequence) and not isinstance(b, str) else [b] * n_kv_heads
            if len(per) != n_kv_heads:
                raise InspectorError(f"layer {layer} budgets: {len(per)} given, the model has {n_kv_heads} KV heads")
            per = [_budget(x, f"layer {layer} budget", context) for x in per]
            self.budgets[layer] = None if any(x is None for x in per) else torch.tensor(per, device=device)
        bad = [layer for layer in self.layer_budgets if not (isinstance(layer, int) and 0 <= layer < n_layers)]
        if bad:
            raise InspectorError(f"layer budgets name layers {bad}; the model has layers 0..{n_layers - 1}")
        if self.sinks is None:
            self.sinks = self.scorer.default_sinks(
                min((int(b.min()) for b in self.budgets if b is not None), default=5)
            )
        for layer, b in enumerate(self.budgets):
            if b is None or self.schedule == "append":  # append-only never evicts: any budget is room enough
                continue
            low = int(b.min())
            if self.page > 1:
                self.serving.check_pages(layer, low, self._sinks, self._recent(low), self.scorer.recent_is_the_rest)
                continue
            # a recent window that is whatever the sinks leave needs no room of its own
            protected = self.sinks + (0 if self.scorer.recent_is_the_rest else self._recent(low))
            if low <= protected:
                raise InspectorError(f"layer {layer}: a budget of {low} leaves no room beyond the {protected} "
                                     "protected entries (sinks + recent window); raise the budget")  # fmt: skip
        super().bind(n_layers, n_heads, n_kv_heads, head_dim, context, itemsize, device)

    def _recent(self, budget: int) -> int:
        return self.recent if self.recent is not None else self.scorer.default_recent(budget, self._sinks)

    @property
    def _sinks(self) -> int:
        assert self.sinks is not None  # bind() settles it before anything is scored
        return self.sinks

    def _recent_rows(self, layer: int, budget: torch.Tensor) -> torch.Tensor:
        """(Hkv,) the recent window of each KV head of ``layer`` (budgets are fixed once bound)."""
        if layer not in self._recent_cache:
            self._recent_cache[layer] = torch.tensor([self._recent(int(b)) for b in budget], device=budget.device)
            self._uniform[layer] = bool((budget == budget[0]).all())
        return self._recent_cache[layer]

    def reset(self) -> None:
        self._evicted_at = [
            torch.empty(self.n_kv_heads, 0, dtype=torch.long, device=self.device) for _ in range(self.n_layers)
        ]
        # per layer (Hkv, T) float64: the sum so far of an accumulating scorer (H2O); empty for the others
        self.scores = [
            torch.empty(self.n_kv_heads, 0, dtype=torch.float64, device=self.device) for _ in range(self.n_layers)
        ]
        # a decode step's scoring and eviction, deferred to one batched pass over its layers (``_flush``):
        # per layer it is a dozen tiny tensor operations, whose fixed cost is most of their time
        self._pending: dict[int, tuple[int, torch.Tensor | None]] = {}  # layer -> (Tk, what scores it)
        # what the next decode forward's attend reads, made by that flush: (Tk, {layer: (grown evicted_at, block)})
        self._next: tuple[int, dict] | None = None
        self._prompt_length = None

    def _due(self, tq: int, tk: int) -> bool:
        """Whether this forward evicts, by the schedule (the prompt's forward sets where steps count from)."""
        if tq == tk:
            self._prompt_length = tk
        return self.serving.due(tk - (self._prompt_length or tk))

    @property
    def evicted_at(self) -> list[torch.Tensor]:
        """Per layer (Hkv, T) long: the cache length after whose forward each entry was evicted (NEVER: held)."""
        self._flush()
        return self._evicted_at

    def snapshot(self):
        # evicted_at needs no copy: an entry evicted after the forward that left the cache at n keys
        # holds n, so the state at n is the first n columns with every later eviction undone. Only an
        # accumulating scorer's sums cannot be rebuilt (float sums do not subtract back): those of the
        # entries still held are kept (at most the budget per KV head, so a step costs O(budget), not
        # O(T)); an evicted entry's score never decides anything again. A layer without a budget
        # evicts nothing: its scores are kept whole
        lengths = [ev.shape[1] for ev in self.evicted_at]  # (the property flushes a deferred eviction)
        if not self.scorer.accumulates:
            return lengths, None
        held = [self.scores[i].clone() if b is None else self.scores[i][self._held(i)].clone()
                for i, b in enumerate(self.budgets)]  # fmt: skip
        return lengths, held

    def _held(self, layer: int) -> torch.Tensor:
        return _to_length(self._evicted_at[layer], self.scores[layer].shape[1]) == NEVER  # (Hkv, n)

    def restore(self, snap) -> None:
        lengths, held = snap
        self._pending, self._next = {}, None  # a deferred eviction belongs to the forward being undone
        for layer, n in enumerate(lengths):
            ev = self._evicted_at[layer][:, :n].clone()  # (Hkv, n)
            ev[ev > n] = NEVER
            self._evicted_at[layer] = ev
        if held is None:
            return
        for layer, kept in enumerate(held):
            if self.budgets[layer] is None:
                self.scores[layer] = kept.clone()
                continue
            self.scores[layer] = kept.new_zeros(self.n_kv_heads, lengths[layer])
            self.scores[layer][self._held(layer)] = kept

    def attend(self, layer, key, value, q0, n_heads):
        tk = key.shape[2]
        if self._pending and (layer in self._pending or next(iter(self._pending.values()))[0] != tk):
            self._flush()  # a new forward: the last one's evictions first
        ready = self._next[1].get(layer) if self._next is not None and self._next[0] == tk == q0 + 1 else None
        if ready is not None and n_heads == self.n_heads:
            self._evicted_at[layer] = ready[0]
            return key, value, ready[1]
        # (Hkv, Tk); a shorter forward (a recompute) starts over from there
        ev = self._evicted_at[layer] = _to_length(self._evicted_at[layer], tk)
        return key, value, self._block(ev, q0, tk - q0, n_heads)

    @staticmethod
    def _block(ev: torch.Tensor, p0: int, n: int, n_heads: int) -> torch.Tensor | None:
        if not bool((ev < NEVER).any()):
            return None
        pos = torch.arange(p0, p0 + n, device=ev.device)  # (n,)
        block = ev[:, None, :] <= pos[None, :, None]  # (Hkv, n, T)
        return eq.expand_kv(block, n_heads)  # (H, n, T)

    def evicted_rows(self, layer, p0, p1, length, n_heads):
        ev = _to_length(self.evicted_at[layer], length)  # (the property flushes a deferred eviction)
        block = self._block(ev, p0, p1 - p0, n_heads)
        return None if block is None else block.cpu()  # for the readers, beside the CPU records

    def evicted(self, layer, length):
        return (_to_length(self.evicted_at[layer], length) < NEVER).cpu()

    def cache_bytes(self, layer, length):
        return self._held_bytes(layer, length, self.evicted(layer, length))

    # -- scoring and eviction, after the layer's attention ---------------------------------------
    def observe(self, layer, query, k, mask, scaling, softcap, probs) -> None:
        budget, rule = self.budgets[layer], self.scorer
        tq, tk = query.shape[2], k.shape[2]
        if rule.prompt_only and tk > tq or self.schedule == "append":
            return  # the prompt was compressed once (generated entries are all kept); or nothing is ever evicted
        if budget is None and not rule.accumulates:
            return  # unlimited: nothing is ever evicted, no score needed
        due = self._due(tq, tk)
        if not due and not rule.accumulates:
            return  # not this step (its schedule): nothing to score
        # the attention rows the scorer reads, (H, n, Tk) float32
        p = self._probs(query, k, mask, scaling, softcap, probs, rule.rows(tq)) if rule.needs_attention else None
        if tq == 1 and budget is not None and rule.batched and self._uniform_budget(layer):
            # a decode step under one budget per head: scored and evicted with the forward's other layers. A
            # scorer of keys scores now (the forward's keys are not kept); one of attention rows in that pass
            what = self._scored(layer, k, p, tk) if rule.reads_keys else p  # (Hkv, Tk), (H, 1, Tk) or None
            self._pending[layer] = (tk, what)
            return
        self._flush()
        self._next = None
        score = self._scored(layer, k, p, tk)  # (Hkv, Tk) float64
        if rule.accumulates:
            acc = self.scores[layer]  # the sum so far, (Hkv, Tk - 1) or longer after a step back
            score = self.scores[layer] = F.pad(acc[:, :tk], (0, max(0, tk - acc.shape[1]))) + score
        if budget is not None and due:
            self._evict(layer, score, budget, tk)

    def _uniform_budget(self, layer: int) -> bool:
        budget = self.budgets[layer]
        assert budget is not None  # asked only for a layer under a budget (observe)
        self._recent_rows(layer, budget)
        return self._uniform[layer]

    def _scored(self, layer: int, k: torch.Tensor, p: torch.Tensor | None, tk: int) -> torch.Tensor:
        """(Hkv, Tk) float64: what the scorer makes of this forward of ``layer`` (before any accumulation)."""
        rule = self.scorer
        keys = k[0, :: self.n_heads // self.n_kv_heads] if rule.reads_keys else None  # (Hkv, Tk, d)
        return self._ask(Seen(layer, keys, p, (self.n_kv_heads, tk), self.device))

    def _ask(self, seen: Seen) -> torch.Tensor:
        return self.scorer.score(seen) if self.scorer.trusted else checked(self.scorer, seen)

    def _flush(self) -> None:
        """Score and evict the deferred decode step, every layer of it in one pass (see ``observe``).

        The same operations as ``observe`` and ``_evict``'s steady state, batched over layers; then
        what the next decode forward's ``attend`` reads (each layer's evictions grown by the new
        position, and the block for its query), so that it costs no operation per layer either.
        """
        if not self._pending:
            return
        pend, self._pending = self._pending, {}
        layers, tk = list(pend), next(iter(pend.values()))[0]
        n, hkv = len(layers), self.n_kv_heads
        ev = torch.stack([self._evicted_at[layer][:, :tk] for layer in layers])  # (n, Hkv, Tk)
        rule = self.scorer
        # None only where the scorer reads neither keys nor attention, and then nothing is stacked
        got = cast("list[torch.Tensor]", [pend[layer][1] for layer in layers])
        if rule.reads_keys:
            score = torch.stack(got)  # (n, Hkv, Tk): scored as each layer ran
        else:
            rows = torch.stack(got) if rule.needs_attention else None  # (n, H, 1, Tk): this forward's attention rows
            score = self._ask(Seen(layers, None, rows, (n, hkv, tk), self.device))  # (n, Hkv, Tk)
        if rule.accumulates:
            sums = [self.scores[layer] for layer in layers]
            if all(a.shape[1] == tk - 1 for a in sums):
                acc = torch.cat([torch.stack(sums), score.new_zeros(n, hkv, 1)], 2)  # (n, Hkv, Tk)
            else:
                acc = torch.stack([F.pad(a[:, :tk], (0, max(0, tk - a.shape[1]))) for a in sums])
            score = acc + score
            for i, layer in enumerate(layers):
                self.scores[layer] = score[i]
        for i, layer in enumerate(layers):
            self._evicted_at[layer] = ev[i]
        if not self._due(1, tk):
            self._next = None  # nothing evicted: the next forward's attend builds its blocks
            return
        # a deferred layer is under a budget (observe defers only those)
        budget = torch.stack(cast("list[torch.Tensor]", [self.budgets[layer] for layer in layers]))  # (n, Hkv)
        held = ev == NEVER  # (n, Hkv, Tk)
        excess = held.sum(2) - budget  # (n, Hkv)
        most = int(excess.max())
        if most > 1 or self.page > 1 or self.share == "layer":  # not the steady state: each layer ranks its own
            for i, layer in enumerate(layers):
                self._evict(layer, score[i], self.budgets[layer], tk)
        elif most == 1:
            recent = torch.stack([self._recent_cache[layer] for layer in layers]).clamp(max=tk)  # (n, Hkv)
            self._drop_one(ev, score, held, excess, recent, tk)
        grown = torch.cat([ev, ev.new_full((n, hkv, 1), NEVER)], 2)  # (n, Hkv, Tk + 1)
        some = (ev < NEVER).flatten(1).any(1).tolist()
        blocks = eq.expand_kv(grown[:, :, None, :] <= tk, self.n_heads)  # (n, H, 1, Tk + 1): query Tk's block
        self._next = (tk + 1, {layer: (grown[i], blocks[i] if some[i] else None) for i, layer in enumerate(layers)})

    def _probs(self, query, k, mask, scaling, softcap, probs, rows) -> torch.Tensor:
        r0, r1 = rows.start, rows.stop
        if probs is not None:
            return probs[0, :, r0:r1].float()
        s = eq.scores(query[0, :, r0:r1].float(), k[0].float(), scaling, softcap)  # (H, n, Tk)
        if mask is not None:
            s = s + mask[0, :, r0:r1].float()  # (H or 1, n, Tk) additive, the mask attention used
        return torch.softmax(s, dim=-1)

    def _drop_one(self, ev, score, held, excess, recent, tk: int) -> None:
        """The steady state, each head at most one over its budget: it drops its lowest-scoring
        candidate (held, past the sinks, before its recent window), the newest among equals, as the
        ranking in ``_evict`` would. ev, score, held: (..., Hkv, Tk); excess, recent: (..., Hkv)."""
        pos = torch.arange(tk, device=ev.device)
        cand = held & (pos >= self._sinks) & (pos < tk - recent[..., None])  # (..., Hkv, Tk)
        j = tk - 1 - score.masked_fill(~cand, math.inf).flip(-1).argmin(-1)  # (..., Hkv), newest first
        over = (excess > 0).nonzero(as_tuple=True)
        ev[over + (j[over],)] = tk  # masked from the next query position on

    def _evict(self, layer, score, budget, tk) -> None:
        """Cut every KV head over its budget down to it, all heads at once (no per-head loop)."""
        if self.page > 1 or self.share == "layer":
            self.serving.evict(self._evicted_at[layer], score, budget, tk, self._sinks,
                               [self._recent(int(b)) for b in budget], self.scorer.recent_is_the_rest)  # fmt: skip
            return
        ev = self.evicted_at[layer]  # (Hkv, Tk)
        held = ev == NEVER  # (Hkv, Tk)
        excess = held.sum(1) - budget  # (Hkv,)
        most = int(excess.max())
        if most <= 0:
            return
        over = excess > 0  # (Hkv,)
        recent = self._recent_rows(layer, budget).clamp(max=tk)  # (Hkv,)
        if most == 1:
            self._drop_one(ev, score, held, excess, recent, tk)
            return
        pos = torch.arange(tk, device=ev.device)
        protect = (pos < self._sinks) | (pos >= tk - recent[:, None])  # (Hkv, Tk)
        protect &= held
        cand = held & ~protect
        room = budget - protect.sum(1)  # (Hkv,)
        s = score.masked_fill(~cand, -math.inf)  # (Hkv, Tk)
        # rank of each entry by score, best first; ties go to the older entry (stable), so runs reproduce
        order = torch.sort(-s, dim=1, stable=True).indices  # (Hkv, Tk)
        rank = torch.empty_like(order).scatter_(1, order, pos.expand_as(order).contiguous())
        keep = protect | (cand & (rank < room[:, None]))
        ev[held & ~keep & over[:, None]] = tk  # masked from the next query position on


def make(name: str | Scorer, budget: int | None = None, **options) -> Policy:
    """A policy by name (``registry``): an eviction policy with ``budget`` entries per KV head, or a
    quantization; or the eviction policy running a ``Scorer`` of one's own.

    Options: eviction ``sinks``, ``recent``, ``layer_budgets``, ``window`` and ``kernel`` (SnapKV),
    ``scorer`` (custom); quantization ``group``, ``residual`` and ``scheme`` (kivi or transformers).
    """
    if isinstance(name, Scorer):
        return Eviction(name, budget, **options)
    if not isinstance(name, str):
        raise InspectorError(f"policy must be a name, got {name!r}")
    if registry.takes_budget(name):  # (an unknown name is refused here)
        return Eviction(name, budget, **options)
    from .quant import SCHEMES, Quantization, TransformersQuantization

    if budget is not None:
        raise InspectorError(f"{name} is a quantization; it takes no budget (its knobs are group and residual)")
    scheme = options.pop("scheme", "kivi")
    if scheme not in SCHEMES:
        raise InspectorError(f"unknown quantization scheme {scheme!r}; use {' or '.join(SCHEMES)}")
    return (TransformersQuantization if scheme == "transformers" else Quantization)(name, **options)
