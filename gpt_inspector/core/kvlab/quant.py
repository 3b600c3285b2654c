"""Quantized KV caches, simulated inside the attention function (see ``policy`` for the hook).

Two schemes:

- ``kivi`` (default): KIVI. Keys per channel over groups of ``group`` tokens, values per token
  over groups of ``group`` channels, asymmetric min-max rounding to ``bits``; the newest
  ``residual`` entries stay in full precision and a key group is quantized once all its tokens
  have left that window. Each entry is quantized once, from its full-precision value.
- ``transformers``: what transformers' ``QuantizedCache`` does with the quanto backend
  (``cache_implementation="quantized"``, ``axis_key``/``axis_value`` 0 or -1, any group quanto
  takes, larger than a head included): the prompt is quantized whole after its own
  forward; later entries collect in a full-precision residual and, when it reaches ``residual``
  entries, the whole cache (its dequantized part and the residual) is quantized again; every
  group is ``group`` consecutive numbers of the flattened (batch, head, position, channel)
  tensor. quanto's MaxOptimizer arithmetic: scale = (max - min) / (2^bits - 1), shift = -min,
  q = clamp(round((x + shift) / scale), 0, 2^bits - 1), x' = scale q - shift.

fp8 (both schemes' residual rule as in ``kivi``) casts each element to float8 (e4m3fn or e5m2)
and back, no scale. The prompt's own forward always attends in full precision (as KIVI and
transformers do); later forwards read the dequantized entries.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from ..errors import InspectorError
from .policy import QUANT, Policy

SCHEMES = ("kivi", "transformers")


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

    scheme = "kivi"

    def __init__(self, name: str, *, group: int | None = None, residual: int = 16):
        if name not in QUANT:
            raise InspectorError(f"unknown quantization {name!r}; use one of {', '.join(QUANT)}")
        self.name, self.group, self.residual = name, group, residual
        self.bits = {"int8": 8, "int4": 4, "int2": 2}.get(name, 8)
        self.fp8 = {"fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}.get(name)

    def describe(self) -> str:
        extra = "" if self.fp8 is not None else f" group {self.group}"
        return f"{self.name}{extra} residual {self.residual}"

    def bind(self, n_layers, n_heads, n_kv_heads, head_dim, context, itemsize, device="cpu") -> None:
        if self.group is None:
            self.group = min(32, head_dim)  # KIVI's default, or one group per head on small heads
        for what, v in (("group", self.group), ("residual", self.residual)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < (1 if what == "group" else 0):
                raise InspectorError(f"{what} must be a whole number >= {1 if what == 'group' else 0}, got {v!r}")
        # quanto groups the flattened cache (any group dividing it is taken, larger than a head too)
        if self.fp8 is None and self.scheme == "kivi" and head_dim % self.group:
            raise InspectorError(
                f"group {self.group} does not divide the head size {head_dim} (values are grouped along it)"
            )
        super().bind(n_layers, n_heads, n_kv_heads, head_dim, context, itemsize, device)

    def boundaries(self, length: int) -> tuple[int, int]:
        """(keys, values) quantized at the front of a cache of ``length`` entries."""
        old = max(0, length - self.residual)
        if self.fp8 is not None:
            return old, old
        return old // self._group() * self._group(), old  # keys wait for a whole group of tokens

    def _group(self) -> int:
        assert self.group is not None  # bind() chose one before any cache exists
        return self.group

    def reset(self) -> None:
        # per layer [K, V] (B, Hkv, capacity, d): what attention reads; rows below ``done`` hold final
        # dequantized values (an entry is quantized once, from its full-precision value), the rest
        # are refreshed from the model's full-precision cache at every forward
        self.read: list[list[torch.Tensor] | None] = [None] * self.n_layers
        self.done = [(0, 0)] * self.n_layers  # (keys, values) rows already dequantized in ``read``
        self.written = [(0, 0)] * self.n_layers  # rows of the recorder's K and V already holding dequantized values

    def snapshot(self):
        # rows below ``done`` never change again; the record rows from ``written`` on may be
        # rewritten (quantized) by the next forward, so they are kept as they are now
        return list(self.done), list(self.written), self._save_records(self.written)

    def restore(self, snap) -> None:
        self.done, self.written = list(snap[0]), list(snap[1])
        self._restore_records(snap[2])

    def _deq(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``x`` (B, Hkv, n, d) dequantized; int groups run along ``dim``: 2 for keys (tokens grouped,
        per channel; n is a whole number of groups), 3 for values (channels grouped, per token)."""
        if self.fp8 is not None:
            return x.to(self.fp8).to(x.dtype)
        return quantize_groups(x.unflatten(dim, (-1, self.group)), self.bits, dim + 1).reshape(x.shape).to(x.dtype)

    def _buffers(self, layer: int, key: torch.Tensor) -> list[torch.Tensor]:
        bufs = self.read[layer]
        b, h, tk, d = key.shape
        if bufs is not None and (bufs[0].shape[0] != b or bufs[0].dtype != key.dtype or bufs[0].device != key.device):
            bufs, self.done[layer] = None, (0, 0)  # another batch or dtype: start over
        if bufs is None or bufs[0].shape[2] < tk:
            cap = max(tk, 0 if bufs is None else 2 * bufs[0].shape[2]) + 64
            new = [torch.empty((b, h, cap, d), dtype=key.dtype, device=key.device) for _ in range(2)]
            if bufs is not None:
                n = bufs[0].shape[2]
                new[0][:, :, :n], new[1][:, :, :n] = bufs[0], bufs[1]
            self.read[layer] = bufs = new
        return bufs

    def attend(self, layer, key, value, q0, n_heads):
        tk = key.shape[2]
        if q0 == 0:
            self.done[layer] = (0, 0)
            return key, value, None  # the prompt's own forward attends in full precision
        qk, qv = self.boundaries(tk)
        kb, vb = self._buffers(layer, key)
        dk, dv = (min(a, b) for a, b in zip(self.done[layer], (qk, qv)))  # fewer after a rollback
        # only the rows that can still change are touched: the full-precision tail and new quantizations
        for buf, x, d, q, dim in ((kb, key, dk, qk, 2), (vb, value, dv, qv, 3)):
            buf[:, :, d:tk].copy_(x[:, :, d:tk])
            if q > d:
                buf[:, :, d:q] = self._deq(x[:, :, d:q], dim)
        self.done[layer] = (qk, qv)
        key, value = kb[:, :, :tk], vb[:, :, :tk]  # (B, Hkv, Tk, d)
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


def quanto_affine(x: torch.Tensor, bits: int, group: int, axis: int = 0) -> torch.Tensor:
    """quanto's MaxOptimizer + quantize_affine + dequantize, written out, in x's dtype.

    quanto's ``group``: on axis 0, ``group`` consecutive numbers of the flattened tensor (so a group
    may span heads and positions: it can be larger than the head size); on axis -1, ``group``
    consecutive rows of the (numbers / channels, channels) view at one channel. quanto refuses a group
    that does not divide the numbers per batch row (HF's ``QuantizedCache`` raises there too); a
    tensor that is one group on axis 0 is quantized per element by quanto's optimizer (its axis
    becomes None), which gives every number back exactly.
    """
    per_row = x.numel() // x.shape[axis]  # quanto's axis_numel
    if group > per_row or per_row % group:
        raise InspectorError(f"quanto refuses group {group} here: it must divide the {per_row} numbers of each "
                             f"batch row of the cache ({tuple(x.shape)}, axis {axis}), as transformers' "
                             "QuantizedCache would fail")  # fmt: skip
    levels = 2**bits - 1  # qmax - qmin
    if axis == 0:
        g = x.reshape(-1, group)  # (n_groups, group)
        if g.shape[0] == 1:
            return x.clone()
        lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
    else:
        d, n = x.shape[-1], per_row // group
        g = x.reshape(n, group, d).permute(1, 2, 0).reshape(group, d * n)  # (group, channels x groups)
        lo, hi = g.amin(0, keepdim=True), g.amax(0, keepdim=True)
    scale, shift = (hi - lo) / levels, -lo
    data = torch.clamp(torch.round((g + shift) / scale), 0, levels).to(torch.uint8)
    out = scale * data - shift  # a zero scale (a flat group) gives back its minimum
    if axis == 0:
        return out.reshape(x.shape)
    return out.reshape(group, x.shape[-1], -1).permute(2, 0, 1).reshape(x.shape)


class _Store:
    """One flush's store: the dequantized K and V, quantized from ``prev``'s store followed by the
    exact rows ``lo:hi`` (the prompt's: rows 0:hi alone). Old stores let go of their tensors and are
    rebuilt from that recipe when a step back needs them: each flush makes a whole-cache store, and
    keeping every one for the lab's step-back history grew as T^2 / residual."""

    __slots__ = ("kv", "prev", "lo", "hi")

    def __init__(self, kv, prev, lo: int, hi: int):
        self.kv, self.prev, self.lo, self.hi = kv, prev, lo, hi

    def get(self, quant, exact) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) dequantized, (B, Hkv, hi, d) each; ``quant``: (keys', values' quantizer);
        ``exact()`` gives the full-precision cache."""
        if self.kv is None:
            k, v = exact()
            qk, qv = quant
            if self.prev is None:
                self.kv = (qk(k[:, :, : self.hi]), qv(v[:, :, : self.hi]))
            else:
                pk, pv = self.prev.get(quant, exact)
                self.kv = (qk(torch.cat([pk, k[:, :, self.lo : self.hi]], 2)),
                           qv(torch.cat([pv, v[:, :, self.lo : self.hi]], 2)))  # fmt: skip
        return self.kv


class TransformersQuantization(Quantization):
    """transformers' ``QuantizedCache`` with the quanto backend, step for step (see the module doc)."""

    scheme = "transformers"
    KEEP = 2  # stores per layer that keep their tensors (the newest and the one before); older: rebuilt on demand

    def __init__(self, name: str, *, group: int | None = None, residual: int = 16, axis_key: int = 0,
                 axis_value: int = 0):  # fmt: skip
        if name not in ("int4", "int2"):
            raise InspectorError(f"transformers' quanto cache takes int4 or int2, not {name}")
        for what, v in (("axis_key", axis_key), ("axis_value", axis_value)):
            if isinstance(v, bool) or v not in (0, -1):
                raise InspectorError(f"{what} for transformers' quanto cache is 0 or -1, got {v!r}")
        super().__init__(name, group=group, residual=residual)
        self.axis_key, self.axis_value = axis_key, axis_value

    def describe(self) -> str:
        return super().describe() + " (transformers' scheme)"

    def bind(self, n_layers, n_heads, n_kv_heads, head_dim, context, itemsize, device="cpu") -> None:
        if self.residual < 1:
            raise InspectorError(
                "residual must be at least 1 in transformers' scheme (it flushes when the window fills)"
            )
        super().bind(n_layers, n_heads, n_kv_heads, head_dim, context, itemsize, device)

    def reset(self) -> None:
        super().reset()
        self.store: list[_Store | None] = [None] * self.n_layers  # per layer the newest flush's store
        self.pending = [0] * self.n_layers  # full-precision entries waiting after the store
        self.shown: list[_Store | None] = [None] * self.n_layers  # the store whose values the records hold
        # layer -> the full-precision cache (K, V) (B, Hkv, T, d), to rebuild a let-go store after a step
        # back; set by the lab. Without it every store keeps its tensors
        self.exact: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None

    def _new_store(self, kv, prev: _Store | None, lo: int, hi: int) -> _Store:
        st = _Store(kv, prev, lo, hi)
        old, n = prev, 1
        while old is not None and self.exact is not None:
            n += 1
            if n > self.KEEP:
                old.kv = None
            old = old.prev
        return st

    def _kv(self, layer: int, st: _Store, key=None, value=None):
        """A store's (K, V); the full-precision rows come from this forward (key, value) when given."""
        if key is not None:
            return st.get(self._quant, lambda: (key, value))

        def exact() -> tuple[torch.Tensor, torch.Tensor]:
            # only a let-go store asks, and stores are let go only while the lab has set ``exact``
            assert self.exact is not None
            return self.exact(layer)

        return st.get(self._quant, exact)

    def snapshot(self):
        # the forward after a flush rewrites every record row with the new store; the records then
        # hold the shown store's rows (put back from it) and full-precision rows after them (kept)
        nothing = 1 << 62  # no row: the next forward rewrites none of this layer's records
        lows = [(nothing,) * 2 if self.shown[i] is self.store[i] or self.store[i] is None else
                (0 if self.shown[i] is None else self.shown[i].hi,) * 2 for i in range(self.n_layers)]  # fmt: skip
        saved = self._save_records(lows) if any(lo < nothing for lo, _ in lows) else None
        return list(self.store), list(self.pending), list(self.shown), saved

    def restore(self, snap) -> None:
        self.store, self.pending, self.shown = (list(x) for x in snap[:3])
        saved, rec = snap[3], self.recorder
        if saved is None or rec is None:
            return
        with torch.inference_mode():  # the record buffers are inference tensors
            for layer, rows in enumerate(saved):
                shown = self.shown[layer]
                if rows[0] is not None and shown is not None:
                    k, v = self._kv(layer, shown)
                    rec.k[layer].write(k.detach(), 0)
                    rec.v[layer].write(v.detach(), 0)
        self._restore_records(saved)

    @property
    def _quant(self):
        """(keys', values' quantizer), on the axes the cache was configured with."""
        bits, group = self.bits, self._group()
        return (lambda x: quanto_affine(x.contiguous(), bits, group, self.axis_key),
                lambda x: quanto_affine(x.contiguous(), bits, group, self.axis_value))  # fmt: skip

    def attend(self, layer, key, value, q0, n_heads):
        tk = key.shape[2]
        if q0 == 0:  # the prompt's forward: full precision, then the whole prompt is quantized
            self.store[layer] = self._new_store((self._quant[0](key), self._quant[1](value)), None, 0, tk)
            self.pending[layer] = 0
            return key, value, None
        shown = self.store[layer]
        sk, sv = self._kv(layer, shown, key, value)
        n = shown.hi
        key = torch.cat([sk, key[:, :, n:]], 2)  # (B, Hkv, Tk, d): dequantized store, then full precision
        value = torch.cat([sv, value[:, :, n:]], 2)
        if self.pending[layer] + (tk - q0) >= self.residual:
            # read from the next forward on
            self.store[layer] = self._new_store((self._quant[0](key), self._quant[1](value)), shown, n, tk)
            self.pending[layer] = 0
        else:
            self.pending[layer] += tk - q0
        rec = self.recorder
        if rec is not None and rec.mirror_kv and self.shown[layer] is not shown:
            # a flush changed every stored row: the records take what this forward read
            rec.k[layer].write(key[:, :, :q0].detach(), 0)
            rec.v[layer].write(value[:, :, :q0].detach(), 0)
            self.shown[layer] = shown
        return key, value, None

    def cache_bytes(self, layer, length):
        n = 0 if self.store[layer] is None else min(self.store[layer].hi, length)
        numbers = n * self.n_kv_heads * self.head_dim  # per K and per V
        packed = 2 * math.ceil(numbers * self.bits / 8)
        groups = 2 * (numbers // self.group)  # one scale and one shift each
        return packed + 2 * groups * self.itemsize + 2 * (length - n) * self.n_kv_heads * self.head_dim * self.itemsize
