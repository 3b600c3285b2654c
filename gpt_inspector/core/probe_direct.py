"""The probe's truncated forward, and its layer-0 search over the vocabulary.

Layer 0's K‖V for candidate token t at position p, f_p(t), depends on nothing but t and p. The
reference search (``search_reference``) runs the whole vocabulary through layer 0 at every probed
position: one vocabulary pass per position, most of it the Q/K/V projection of every token.

The shared search (``search_shared``) projects the vocabulary once and ranks every token at every
position from that, in one of two ways:
* Rotary and position-free layers: the vocabulary runs through layer 0 at position 0, and position
  p is reached through the model's own map from 0 to p where that map is, per KV head and per K or
  V block, an orthogonal matrix plus a shift, f_p(t) = f_0(t) M_p + c_p (each pair of a key rotated,
  values untouched, biases before the rotation, partial rotary; ALiBi: the identity). The map is
  fitted from a sample of tokens the model runs at p and used only where it reproduces them and is
  orthogonal, both to 1e-4; then ||f_p(t) - τ|| = ||f_0(t) - (τ - c_p) M_pᵀ||.
* GPT-2's learned positions, added before a LayerNorm: the norm and projection written out
  (``_LearnedPositions``), used only where they reproduce the model's own K‖V on a sample.

That distance only ranks. Every candidate ranked within a margin of the second best runs through
layer 0 at p, as in the reference search, and the winner and runner-up are picked from those exact
distances. The margin is kept at ten times the largest disagreement between ranked and exact
distances among the verified candidates, so an unverified candidate cannot beat the runner-up:
its exact distance is at least its ranked one minus that disagreement.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch

from . import hf
from .capture import Recorder
from .errors import InspectorError
from .models import LoadedModel

# the fitted position map must reproduce its sample and be orthogonal to this (relative): float32
# rounding leaves ~1e-6, any real position effect (GPT-2's learned positions) ~1e-1
_MAP_TOL = 1e-4
# first verification margin, in relative distance; grown to 10x the ranking's observed error
_MARGIN = 1e-3
# sample tokens beyond the block size that fix each position's map
_FIT_EXTRA = 32
# positions ranked together (GPT-2): one read of the projected vocabulary serves them all
_POSITIONS = 32


class _Stop(Exception):
    """Raised from inside the model once the probed layer's K/V are in hand."""


class _KVGrabber(Recorder):
    """A recorder that keeps only the last position's K/V of one layer, then stops the forward.

    Our attention function calls ``_record`` after the cache update, so ``key`` already includes
    whatever prefix the cache held and its last row is the new position's key.
    """

    def __init__(self, n_layers: int, stop_layer: int):
        super().__init__(n_layers, mirror_kv=False)
        self.stop_layer = stop_layer
        self.kv: torch.Tensor | None = None

    def _record(self, layer, query, key, value, attention_mask, out, scaling, softcap, sinks=None, bias=None) -> None:
        if layer != self.stop_layer:
            return
        b = key.shape[0]
        k = key[:, :, -1].reshape(b, -1)  # (B, Hkv*d)
        v = value[:, :, -1].reshape(b, -1)  # (B, Hkv*d)
        self.kv = torch.cat([k, v], dim=1).float()  # (B, 2*Hkv*d)
        raise _Stop


def run_to_layer(
    lm: LoadedModel, layer: int, ids: torch.Tensor, cache: hf.DynamicCache, position_ids=None, edits=None
) -> torch.Tensor:
    """K‖V of ``layer`` at the last input position, per batch row: (B, 2*Hkv*d) float32."""
    grab = _KVGrabber(lm.n_layers, layer)
    if edits is not None:
        grab.edits = edits  # lower layers must attend exactly as they did when the cache was filled
    kwargs = {} if position_ids is None else {"position_ids": position_ids}
    with contextlib.suppress(_Stop), torch.inference_mode(), grab.active():
        hf.call(lm.model, cache, input_ids=ids, use_cache=True, **kwargs)
    if grab.kv is None:
        raise InspectorError(f"layer {layer} of {lm.name} never reached the attention function; cannot probe it")
    return grab.kv


class Best:
    """Running best and runner-up candidate per position while chunks stream in."""

    def __init__(self, n: int):
        self.d = torch.full((n, 2), math.inf, dtype=torch.float64)  # (N, 2)
        self.i = torch.zeros((n, 2), dtype=torch.long)  # (N, 2)

    def update(self, rows: torch.Tensor, dist: torch.Tensor, cand: torch.Tensor) -> None:
        # rows: (G,) position indices into this table; dist: (G, C); cand: (C,) token ids
        k = min(2, dist.shape[1])
        d, j = torch.topk(dist.double().cpu(), k, dim=1, largest=False)  # (G, k)
        ids = cand.cpu()[j]  # (G, k)
        all_d = torch.cat([self.d[rows], d], dim=1)  # (G, 2+k)
        all_i = torch.cat([self.i[rows], ids], dim=1)
        order = torch.argsort(all_d, dim=1, stable=True)[:, :2]
        self.d[rows] = torch.gather(all_d, 1, order)
        self.i[rows] = torch.gather(all_i, 1, order)


def distance(cand: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Relative L2 distance; cand (..., C, F), target (..., 1, F) -> (..., C)."""
    norm = target.norm(dim=-1).clamp_min(1e-12)  # (..., 1)
    return (cand - target).norm(dim=-1) / norm


def layer0_at(lm: LoadedModel, ids: torch.Tensor, p: int) -> torch.Tensor:
    """Layer-0 K‖V of each token in ``ids`` (C,) at position p, one token per row: (C, F)."""
    cfg: Any = lm.model.config  # the model's PretrainedConfig (nn.Module types attributes Tensor | Module)
    pids = torch.full((len(ids), 1), p, dtype=torch.long, device=lm.device)  # (C, 1)
    return run_to_layer(lm, 0, ids[:, None], hf.DynamicCache(config=cfg), pids)


def search_reference(lm: LoadedModel, target: torch.Tensor, n: int, rows: int, tick: Callable[[], None]) -> Best:
    """Layer 0: every (candidate, position) pair is an independent one-token sequence; target (T, F)."""
    best = Best(n)
    c = max(1, min(lm.vocab_size, rows))
    g = max(1, rows // c)  # positions per forward when the whole vocabulary fits in one chunk
    cfg: Any = lm.model.config
    for p0 in range(0, n, g):
        pos = torch.arange(p0, min(n, p0 + g), device=lm.device)  # (G,)
        for c0 in range(0, lm.vocab_size, c):
            cand = torch.arange(c0, min(lm.vocab_size, c0 + c), device=lm.device)  # (C,)
            ids = cand.repeat(len(pos))[:, None]  # (G*C, 1)
            pids = pos.repeat_interleave(len(cand))[:, None]  # (G*C, 1)
            out = run_to_layer(lm, 0, ids, hf.DynamicCache(config=cfg), pids)  # (G*C, F)
            dist = distance(out.view(len(pos), len(cand), -1), target[pos][:, None])  # (G, C)
            best.update(pos.cpu(), dist, cand)
            tick()
    return best


class _PositionMap:
    """Layer 0 at position p as a map of layer 0 at position 0, per block of ``width`` columns."""

    def __init__(self, lm: LoadedModel, width: int, f0_sample: torch.Tensor, sample: torch.Tensor):
        self.lm, self.width, self.sample = lm, width, sample
        ones = torch.ones(len(sample), 1, dtype=torch.float64, device=f0_sample.device)
        self.blocks = [torch.cat([b.double(), ones], 1) for b in f0_sample.split(width, dim=1)]  # per block (m, w+1)
        self.f0: torch.Tensor | None = None

    def fit(self, p: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per block (M (w, w), c (w,)) with f_p = f_0 M + c, or None where no orthogonal map fits."""
        fp = layer0_at(self.lm, self.sample, p).double()  # (m, F)
        out = []
        eye = torch.eye(self.width, dtype=torch.float64, device=fp.device)
        for a, y in zip(self.blocks, fp.split(self.width, dim=1)):
            x = torch.linalg.lstsq(a, y).solution  # (w+1, w)
            m, c = x[:-1], x[-1]
            scale = y.abs().max().clamp_min(1e-12)
            if (a @ x - y).abs().max() > _MAP_TOL * scale or (m @ m.T - eye).abs().max() > _MAP_TOL:
                return None
            out.append((m, c))
        return out

    def prepare(self, rows: int, tick: Callable[[], None], target: torch.Tensor) -> None:
        """The vocabulary through layer 0 at position 0, once: f_0 (V, F)."""
        v, parts = self.lm.vocab_size, []
        for c0 in range(0, v, rows):
            parts.append(layer0_at(self.lm, torch.arange(c0, min(v, c0 + rows), device=self.lm.device), 0))  # (C, F)
            tick()
        self.f0 = torch.cat(parts)  # (V, F)

    def ranked(self, p: int, tau: torch.Tensor, rows: int) -> torch.Tensor | None:
        """||f_p(t) - tau|| / ||tau|| for every token through the fitted map (V,), or None where it does not fit."""
        fit = self.fit(p)
        if fit is None:
            return None
        assert self.f0 is not None
        t64 = tau.double()  # (F,)
        t0 = torch.cat([(t - c) @ mm.T for (mm, c), t in zip(fit, t64.split(self.width))]).float()  # (F,) at 0
        norm = t64.norm().clamp_min(1e-12).cpu()
        return torch.cat([(c - t0).norm(dim=1).double().cpu() / norm for c in self.f0.split(rows)])  # (V,)


class _LearnedPositions:
    """GPT-2's layer 0, K‖V = LayerNorm(E_t + P_p) W + b, written out to rank candidates (never to decide).

    Positions enter linearly before the norm, so with x_t = E_t - mean, y_p = P_p - mean, U = (x ⊙ γ) W
    and Y = (y ⊙ γ) W: f_p(t) = (U_t + Y_p) / σ_tp + β W + b, σ_tp² = |x_t + y_p|² / D + eps. The
    distance to τ then needs three dot products per token (x·y_p, U·Y_p, U·(τ - βW - b)) instead of
    a forward through the projection. Used only where it reproduces the model's own K‖V on a sample.
    """

    def __init__(self, lm: LoadedModel, n: int):
        tr: Any = lm.model.transformer  # GPT2Model (find checked its parts)
        ln, attn = tr.h[0].ln_1, tr.h[0].attn.c_attn
        self.wte: torch.Tensor = tr.wte.weight  # (V, D)
        d = ln.weight.shape[0]
        self.lm, self.eps, self.d = lm, float(ln.eps), d
        with torch.inference_mode():
            self.g, self.w = ln.weight.float(), attn.weight[:, d : 3 * d].float()  # (D,), (D, F): K then V
            self.beta = ln.bias.float() @ self.w + attn.bias[d : 3 * d].float()  # (F,)
            y = tr.wpe.weight[:n].float()  # (n, D)
            self.y = y - y.mean(1, keepdim=True)
            self.yy = (self.y * self.y).sum(1)  # (n,)
            self.Y = (self.y * self.g) @ self.w  # (n, F)
        self.x: torch.Tensor | None = None

    @staticmethod
    def find(lm: LoadedModel, n: int) -> _LearnedPositions | None:
        tr: Any = getattr(lm.model, "transformer", None)
        try:
            ln, attn, wpe = tr.h[0].ln_1, tr.h[0].attn.c_attn, tr.wpe
        except (AttributeError, IndexError, TypeError):
            return None
        if not isinstance(ln, torch.nn.LayerNorm) or not isinstance(wpe, torch.nn.Embedding) or ln.bias is None:
            return None
        if getattr(attn, "weight", None) is None or attn.weight.shape != (ln.weight.shape[0], 3 * ln.weight.shape[0]):
            return None
        return _LearnedPositions(lm, n)

    def _x(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.wte[ids].float()  # (C, D)
        return e - e.mean(1, keepdim=True)

    def kv(self, ids: torch.Tensor, p: int) -> torch.Tensor:
        """The written-out K‖V of ``ids`` at p (C, F), to check against the model's own."""
        x = self._x(ids)
        sigma = (((x + self.y[p]) ** 2).sum(1, keepdim=True) / self.d + self.eps).sqrt()  # (C, 1)
        return ((x * self.g) @ self.w + self.Y[p]) / sigma + self.beta

    def prepare(self, rows: int, tick: Callable[[], None], target: torch.Tensor) -> None:
        self.r = target.float() - self.beta  # (T, F)
        self.block: tuple[int, torch.Tensor] | None = None  # (first position, (V, 3, P) dot products)
        v, xxs, us = self.lm.vocab_size, [], []
        with torch.inference_mode():
            for c0 in range(0, v, rows):
                x = self._x(torch.arange(c0, min(v, c0 + rows), device=self.lm.device))  # (C, D)
                xxs.append((x * x).sum(1).double())
                us.append((x * self.g) @ self.w)  # (C, F)
                tick()
            # y_p sums to 0, so x_t . y_p = E_t . y_p: the embedding itself, not a centred copy
            self.x = self.wte.float()  # (V, D)
        self.U = torch.cat(us)  # (V, F)
        self.xx, self.UU = torch.cat(xxs), (self.U * self.U).sum(1).double()  # (V,) each

    def _dots(self, p: int) -> torch.Tensor:
        """(V, 3) float64: x·y_p, U·Y_p, U·r_p, computed for _POSITIONS positions at a time (one read of U)."""
        assert self.x is not None
        if self.block is None or not self.block[0] <= p < self.block[0] + self.block[1].shape[2]:
            p1 = min(len(self.r), p + _POSITIONS)
            with torch.inference_mode():
                xy = self.x @ self.y[p:p1].T  # (V, P)
                uy_ur = self.U @ torch.cat([self.Y[p:p1], self.r[p:p1]]).T  # (V, 2P)
            self.block = (p, torch.stack([xy, uy_ur[:, : p1 - p], uy_ur[:, p1 - p :]], 1))  # (V, 3, P)
        return self.block[1][:, :, p - self.block[0]].double()

    def ranked(self, p: int, tau: torch.Tensor, rows: int) -> torch.Tensor:
        r = self.r[p]  # (F,)
        xy, uy, ur = self._dots(p).unbind(1)  # (V,) each
        yy, YY, Yr = float(self.yy[p]), float(self.Y[p] @ self.Y[p]), float(self.Y[p] @ r)
        sigma = ((self.xx + 2 * xy + yy) / self.d + self.eps).sqrt()  # (V,)
        d2 = (self.UU + 2 * uy + YY) / sigma**2 - 2 * (ur + Yr) / sigma + float(r @ r)  # (V,)
        return (d2.clamp_min(0).sqrt() / float(tau.norm().clamp_min(1e-12))).cpu()


def position_map(lm: LoadedModel, n: int, width: int) -> _PositionMap | _LearnedPositions | None:
    """How layer 0 reaches each position from one vocabulary pass, or None where the shared search does
    not apply (module doc)."""
    v = lm.vocab_size
    m = min(v, width + _FIT_EXTRA)
    if lm.dtype != torch.float32 or m <= width:
        return None  # half types round every element past the map's tolerance; tiny vocabularies gain nothing
    sample = torch.linspace(0, v - 1, m, device=lm.device).round().long().unique()  # (m,)
    learned = _LearnedPositions.find(lm, n)
    if learned is not None:
        with torch.inference_mode():
            for p in {0, n - 1}:
                want = layer0_at(lm, sample, p)  # (m, F)
                if (learned.kv(sample, p) - want).abs().max() > _MAP_TOL * want.abs().max().clamp_min(1e-12):
                    return None
        return learned
    if n < 2:
        return None
    pm = _PositionMap(lm, width, layer0_at(lm, sample, 0), sample)
    return None if pm.fit(n - 1) is None else pm  # the farthest position decides: a position effect shows there


def shared_forwards(lm: LoadedModel, n: int, rows: int) -> int:
    """Progress ticks of the shared search: the vocabulary once, then a ranking and a check per position."""
    return math.ceil(lm.vocab_size / rows) + 2 * n


def search_shared(lm: LoadedModel, pm: _PositionMap | _LearnedPositions, target: torch.Tensor, n: int, rows: int,
                  tick: Callable[[], None], fallback: Callable[[int], torch.Tensor]) -> Best:  # fmt: skip
    """The shared search (module doc); ``fallback(p)`` gives the reference's distances at p (V,) for a
    position whose map does not fit although the farthest one's did."""
    best = Best(n)
    all_ids = torch.arange(lm.vocab_size)
    pm.prepare(rows, tick, target)
    for p in range(n):
        ranked = pm.ranked(p, target[p], rows)  # (V,)
        tick()
        if ranked is None:
            best.update(torch.tensor([p]), fallback(p)[None], all_ids)
        else:
            ids, exact = _verify(lm, p, target[p], ranked, rows)
            best.update(torch.tensor([p]), exact[None], ids)
        tick()
    return best


def _verify(lm: LoadedModel, p: int, tau: torch.Tensor, ranked: torch.Tensor, rows: int):
    """Run every candidate the ranking cannot rule out through layer 0 at p; (ids (K,), exact (K,))."""
    order = torch.argsort(ranked, stable=True)  # (V,)
    second = ranked[order[min(1, len(order) - 1)]]
    margin = _MARGIN
    done = 0
    ids, exact = [], []
    while True:
        want = int(torch.searchsorted(ranked[order], second + margin, right=True).clamp_min(2))
        for c0 in range(done, want, rows):
            cand = order[c0 : min(want, c0 + rows)].to(lm.device)  # (C,)
            ids.append(cand.cpu())
            exact.append(distance(layer0_at(lm, cand, p)[None], tau[None, None])[0].double().cpu())  # (C,)
        done = max(done, want)
        all_ids, all_d = torch.cat(ids), torch.cat(exact)
        err = float((ranked[all_ids] - all_d).abs().max())
        if 10 * err <= margin or done >= len(order):
            return all_ids, all_d
        margin = 10 * err
