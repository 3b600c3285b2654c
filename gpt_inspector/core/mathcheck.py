"""Attention math check: redo the attention output from the captured q, K, V with the textbook formula.

    out = softmax(q · Kᵀ × scaling + bias + mask) · V

written out in float64 numpy, with the mask from ``allowed`` (the model's own mask plus mask
edits) and query head h reading KV head h // (H / Hkv). It is compared with the output our
capture recorded from the model's own forward. Agreement within float tolerance shows that the
q, K, V, scaling and mask the debugger displays are exactly what produced the model's numbers;
a mismatch means a record (or the displayed equation) does not describe what the model did.

Works on anything with the Session accessors: a live ``Session`` or a loaded ``Trace``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import InspectorError, check_index
from .validate import json_number

FORMULA = "out = softmax(q · Kᵀ × scaling + mask) · V"

# Relative tolerance per dtype the model ran in; scaled by the largest |V| the head reads, since
# the float32 (or half) dot products in the model round relative to the values they sum.
_RTOL = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 6e-2}


@dataclass
class MathCheck:
    """One query position of one head, recomputed and compared."""

    layer: int
    head: int
    kv_head: int
    position: int
    scaling: float
    softcap: float | None
    weights: np.ndarray  # (T,) float64 softmax row; 0 where masked
    allowed: np.ndarray  # (T,) bool
    recomputed: np.ndarray  # (d,) float64
    model: np.ndarray  # (d,) float64, the model's own output
    tolerance: float
    formula: str = FORMULA
    nonfinite: bool = False  # an input the formula reads (q, an allowed key's K or V, the output) is inf/NaN

    @property
    def diff(self) -> np.ndarray:
        return np.abs(self.recomputed - self.model)  # (d,)

    @property
    def max_abs_diff(self) -> float:
        if self.nonfinite:  # inf - inf is NaN but inf == inf: neither proves the equation, so never a match
            return math.inf
        return float(self.diff.max()) if self.diff.size else 0.0

    @property
    def worst_dim(self) -> int:
        return int(np.argmax(self.diff)) if self.diff.size else 0

    @property
    def ok(self) -> bool:
        return bool(self.max_abs_diff <= self.tolerance)  # NaN fails

    def summary(self) -> str:
        verdict = "match" if self.ok else "MISMATCH"
        why = " (non-finite inputs)" if self.nonfinite else ""
        return (
            f"layer {self.layer} head {self.head} position {self.position}: max |diff| {self.max_abs_diff:.3g} "
            f"(tolerance {self.tolerance:.3g}) {verdict}{why}"
        )

    def to_json(self) -> dict:
        out = {
            k: getattr(self, k)
            for k in (
                "layer",
                "head",
                "kv_head",
                "position",
                "scaling",
                "softcap",
                "formula",
                "weights",
                "recomputed",
                "model",
                "max_abs_diff",
                "tolerance",
                "ok",
                "nonfinite",
            )
        }
        # in place, so the keys keep their order: arrays as lists, and JSON has no inf or NaN
        out.update(weights=self.weights.tolist(), recomputed=self.recomputed.tolist(), model=self.model.tolist(),
                   max_abs_diff=json_number(self.max_abs_diff))  # fmt: skip
        return out


@dataclass
class MathCheckReport:
    """Every layer/head/position checked; the maximum difference per layer and head."""

    layers: list[int]
    n_heads: int
    n_positions: int
    max_diff: np.ndarray  # (len(layers), H) float64
    worst_position: np.ndarray  # (len(layers), H) int
    tolerance: np.ndarray  # (len(layers), H) float64
    formula: str = FORMULA
    first_position: int = 0  # positions checked: first_position .. first_position + n_positions - 1

    @property
    def ok(self) -> bool:
        return bool(np.all(self.max_diff <= self.tolerance))  # NaN fails

    @property
    def max_abs_diff(self) -> float:
        return float(np.nanmax(self.max_diff)) if not np.isnan(self.max_diff).all() else math.nan

    def failures(self) -> list[tuple[int, int, int, float, float]]:
        """(layer, head, worst position, max diff, tolerance) for every head over tolerance."""
        bad = ~(self.max_diff <= self.tolerance)
        return [
            (self.layers[i], h, int(self.worst_position[i, h]), float(self.max_diff[i, h]), float(self.tolerance[i, h]))
            for i, h in zip(*np.nonzero(bad))
        ]

    def summary(self) -> str:
        checked = f"{len(self.layers)} layers x {self.n_heads} heads x {self.n_positions} positions"
        if self.first_position:
            checked += f" (from position {self.first_position}, where the steps decide tokens)"
        if self.ok:
            return f"all {checked} match the model within tolerance (max |diff| {self.max_abs_diff:.3g})"
        f = self.failures()
        layer, head, pos, d, tol = max(f, key=lambda x: -math.inf if math.isnan(x[3]) else x[3] / x[4])
        return (
            f"{len(f)} of {len(self.layers) * self.n_heads} heads exceed tolerance over {checked}; "
            f"worst: layer {layer} head {head} position {pos}, max |diff| {d:.3g} > {tol:.3g}"
        )

    def to_json(self) -> dict:
        return {
            "formula": self.formula,
            "ok": self.ok,
            "max_abs_diff": json_number(self.max_abs_diff),
            "positions": self.n_positions,
            "first_position": self.first_position,
            "layers": [
                {
                    "layer": layer,
                    "heads": [
                        {
                            "head": h,
                            "max_abs_diff": json_number(float(self.max_diff[i, h])),
                            "worst_position": int(self.worst_position[i, h]),
                            "tolerance": float(self.tolerance[i, h]),
                            "ok": bool(self.max_diff[i, h] <= self.tolerance[i, h]),
                        }
                        for h in range(self.n_heads)
                    ],
                }
                for i, layer in enumerate(self.layers)
            ],
        }


# ---------------------------------------------------------------------- the source


def _kv_map(source, layer: int) -> np.ndarray:
    return np.array([source.kv_head_of(h, layer) for h in range(source.n_heads)])  # (H,) query head -> KV head


def _tolerance(source, v_heads: np.ndarray, tolerance: float | None) -> np.ndarray:
    """Per query head; v_heads (H, T, d) the values each head reads."""
    if tolerance is not None:
        return np.full(v_heads.shape[0], float(tolerance))
    rtol = _RTOL.get(source.cache_dtype, _RTOL["float16"])
    # finite values only: an inf in V must not make the tolerance infinite and everything "match"
    mag = np.where(np.isfinite(v_heads), np.abs(v_heads), 0.0)
    scale = mag.reshape(v_heads.shape[0], -1).max(axis=1)  # (H,)
    return rtol * np.maximum(scale, 1.0)


def _nonfinite(q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray, model: np.ndarray) -> np.ndarray:
    """(H, Tq) True where a row reads a non-finite value; q, model (H, Tq, d), k, v (H, T, d), allowed (H, Tq, T).

    The one rule both check paths use, so a single head and the all-heads report agree.
    """
    bad_key = ~(np.isfinite(k).all(axis=-1) & np.isfinite(v).all(axis=-1))  # (H, T)
    reads_bad = (allowed & bad_key[:, None, :]).any(axis=-1)  # (H, Tq)
    return ~np.isfinite(q).all(axis=-1) | reads_bad | ~np.isfinite(model).all(axis=-1)


def _validate_tolerance(tolerance) -> None:
    if tolerance is not None and not (
        isinstance(tolerance, (int, float)) and tolerance > 0 and math.isfinite(tolerance)
    ):
        raise InspectorError(f"tolerance must be a positive number, got {tolerance!r}")


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray, scaling: float, softcap, sink=None,
            bias=None):  # fmt: skip
    """The formula for a stack of heads; q (H, Tq, d), k, v (H, T, d), allowed (H, Tq, T); float64.

    ``sink`` (H,): attention-sink logits (gpt_oss), one more term in each softmax denominator.
    ``bias`` (H, Tq, T): the model's additive score bias (ALiBi, doge), added to the scaled scores.
    """
    scores = np.einsum("hqd,hkd->hqk", q, k) * scaling  # (H, Tq, T)
    if bias is not None:
        scores = scores + bias
    if softcap is not None:
        scores = np.tanh(scores / softcap) * softcap
    scores = np.where(allowed, scores, -np.inf)  # (H, Tq, T)
    top = scores.max(axis=-1, keepdims=True)  # (H, Tq, 1)
    if sink is not None:
        sink = np.asarray(sink, dtype=np.float64)[:, None, None]  # (H, 1, 1)
        top = np.maximum(top, sink)
    with np.errstate(invalid="ignore"):  # a row with no allowed key turns to NaN and fails the check
        e = np.exp(scores - top)
        denom = e.sum(axis=-1, keepdims=True)  # (H, Tq, 1)
        if sink is not None:
            denom = denom + np.exp(sink - top)
        w = e / denom  # (H, Tq, T)
    return w, np.einsum("hqk,hkd->hqd", w, v)  # (H, Tq, d)


def _bias(source, layer: int, p0: int, p1: int, heads=None) -> np.ndarray | None:
    b = source.bias_rows(layer, p0, p1, heads)
    return None if b is None else b.double().numpy()  # (h, n, T)


def _sink(source, layer: int) -> np.ndarray | None:
    s = source.sink(layer)
    return None if s is None else s.double().numpy()  # (H,)


# ---------------------------------------------------------------------- public


def check(source, layer: int, head: int, position: int | None = None, tolerance: float | None = None) -> MathCheck:
    """Recompute one head's output at one query position (default: the last) and compare."""
    if getattr(source, "engine", None) is not None:  # a remote engine's session: it runs this code beside the model
        return source.remote_math_check(layer, head, position, tolerance)
    layer, head = source.check_layer(layer), source.check_head(head)
    _validate_tolerance(tolerance)
    t = source.require_positions()
    if position is None:
        position = t - 1
    position = check_index(position, t, "position")
    start = source.head_outputs_from
    if position < start:
        raise InspectorError(
            f"the model's attention output at position {position} is not kept (only from position {start}, "
            "where the steps decide tokens): pick a later query position"
        )
    q, k, v = source.qkv(layer)  # (H, T, d), (Hkv, T, d), (Hkv, T, d)
    kvh = int(_kv_map(source, layer)[head])
    allowed = source.allowed_rows(layer, position, position + 1)[head, 0].numpy()  # (T,): one row, never (T, T)
    scaling, softcap = float(source.scaling(layer)), source.softcap(layer)
    sink = _sink(source, layer)
    vk = v[kvh].astype(np.float64)  # (T, d)
    w, out = _attend(
        q[head, position][None, None].astype(np.float64),  # (1, 1, d)
        k[kvh][None].astype(np.float64),  # (1, T, d)
        vk[None],  # (1, T, d)
        allowed[None, None],  # (1, 1, T)
        scaling,
        softcap,
        None if sink is None else sink[head : head + 1],
        _bias(source, layer, position, position + 1, (head,)),
    )
    model = source.attention_output(layer)[head, position].astype(np.float64)  # (d,)
    tol = float(_tolerance(source, vk[None], tolerance)[0])
    bad = bool(_nonfinite(q[head, position][None, None], k[kvh][None], v[kvh][None], allowed[None, None],
                          model[None, None])[0, 0])  # fmt: skip
    return MathCheck(layer, head, kvh, position, scaling, softcap, w[0, 0], allowed, out[0, 0], model, tol,
                     nonfinite=bad)  # fmt: skip


BLOCK_BYTES = 256 << 20  # float64 work per block of a check: the check streams, its memory stays flat in T


def _blocks(n_heads: int, t: int, d: int) -> tuple[int, int]:
    """(heads, rows) per block so a block's float64 arrays stay near BLOCK_BYTES at any length."""
    per_head = 3 * t * d * 8  # the head's K, V and q in float64
    hb = max(1, min(n_heads, BLOCK_BYTES // 2 // per_head))
    per_row = 6 * t * 8  # scores, exp, weights, bias and mask rows of one query, one head
    return hb, max(1, min(t, BLOCK_BYTES // 2 // (hb * per_row)))


def check_all(source, layers=None, tolerance: float | None = None) -> MathCheckReport:
    """Check every head at every position of the given layers (default all); max |diff| per head."""
    if getattr(source, "engine", None) is not None:
        return source.remote_math_check_all(layers, tolerance)
    _validate_tolerance(tolerance)
    t = source.require_positions()
    if layers is None:
        layers = source.attention_layers  # a hybrid's state-space layers have no attention to check
    elif isinstance(layers, (int, np.integer)) and not isinstance(layers, bool):
        layers = [layers]
    layers = [source.check_layer(layer) for layer in layers]
    if not layers:
        raise InspectorError("no layers to check")
    n_heads = source.n_heads
    max_diff = np.full((len(layers), n_heads), -1.0)  # below any |diff|: the first block's maximum wins
    worst = np.zeros((len(layers), n_heads), dtype=np.int64)
    tol = np.zeros((len(layers), n_heads))
    start = source.head_outputs_from  # rows before it were never kept: nothing to compare
    for i, layer in enumerate(layers):
        q, k, v = source.qkv(layer)  # (H, T, d), (Hkv, T, d), (Hkv, T, d)
        kv_map = _kv_map(source, layer)
        model = source.attention_output(layer)  # (H, T, d); rows before start are not kept
        scaling, softcap, sink = float(source.scaling(layer)), source.softcap(layer), _sink(source, layer)
        hb, rb = _blocks(n_heads, t, max(k.shape[-1], v.shape[-1]))
        for h0 in range(0, n_heads, hb):
            hs = np.arange(h0, min(h0 + hb, n_heads))
            kh = k[kv_map[hs]].astype(np.float64)  # (h, T, d)
            vh = v[kv_map[hs]].astype(np.float64)  # (h, T, d)
            tol[i, hs] = _tolerance(source, vh[:, :t], tolerance)
            # row blocks: (H, T, T) float64 at once is 34 GB for two heads at 16,384 positions
            for p0 in range(start, t, rb):
                p1 = min(p0 + rb, t)
                allowed = source.allowed_rows(layer, p0, p1)[hs].numpy()  # (h, n, T)
                bias = _bias(source, layer, p0, p1, hs.tolist())  # (h, n, T) or None
                _, out = _attend(q[hs, p0:p1].astype(np.float64), kh, vh, allowed, scaling, softcap,
                                 None if sink is None else sink[hs], bias)  # fmt: skip
                mod = model[hs, p0:p1].astype(np.float64)  # (h, n, d)
                with np.errstate(invalid="ignore"):
                    diff = np.abs(out - mod).max(axis=-1)  # (h, n)
                # NaN must win the max so a broken row cannot hide behind a finite one
                bad = _nonfinite(q[hs, p0:p1], kh, vh, allowed, mod)
                diff = np.where(np.isnan(diff) | bad, np.inf, diff)
                top = diff.max(axis=1)  # (h,)
                better = top > max_diff[i, hs]  # strictly: the first position with the maximum is the worst
                worst[i, hs[better]] = p0 + diff.argmax(axis=1)[better]
                max_diff[i, hs[better]] = top[better]
    return MathCheckReport(layers, n_heads, t - start, max_diff, worst, tol, first_position=start)


__all__ = ["FORMULA", "MathCheck", "MathCheckReport", "check", "check_all"]
