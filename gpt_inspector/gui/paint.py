"""Work the views would do on the GUI thread, done by the worker after it builds a snapshot.

Two things, both in ``prepare``:

- A part of the snapshot whose contents equal the last published one's is that part again, the
  same object. Every build makes fresh arrays, and between two steps the worker publishes several
  unchanged ones (the overview's slices, a selected query, a pooled matrix streaming in); the views
  skip a part they have already drawn (``is`` checks), so q / K / V, the KV cache and the softmax
  rows are not set again for nothing.
- ``Painted``: the pixels of the score matrix and its tile (``views.image.argb``: the GUI thread
  only wraps them) and the levels of the q / K / V and KV cache images.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from .snapshot import Snapshot
from .views.common import CMAP, DIVERGING, symmetric_levels
from .views.image import Pixels, pixels

__all__ = ["Painted", "prepare"]

MATRIX_LUT = CMAP.getLookupTable(nPts=256)  # the score matrix and its tile
SIGNED_LUT = DIVERGING.getLookupTable(nPts=256)  # q / K / V and the KV cache


@dataclass(frozen=True)
class Painted:
    """Ready pixels for a snapshot's images (None where there is nothing to draw)."""

    matrix: Pixels | None = None
    tile: Pixels | None = None
    qkv_k: Pixels | None = None  # q and K share their levels (q's cells are in them)
    qkv_v: Pixels | None = None
    kv_k: Pixels | None = None
    kv_v: Pixels | None = None


def _same(a, b) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype.kind == "f":  # bit for bit, a NaN the same NaN: array_equal's equal_nan took 10x as long
            bits = np.dtype(f"u{a.dtype.itemsize}")  # (q / K / V at 32k: 40 ms a rebuild on the worker)
            return np.array_equal(a.view(bits), b.view(bits))
        return np.array_equal(a, b, equal_nan=a.dtype.kind == "c")
    if dataclasses.is_dataclass(a):  # a step's copy: its tensors are the step's own, compared by identity
        return _same_part(a, b)
    if hasattr(a, "shape"):  # a tensor: == is not a yes / no
        return False
    try:
        return bool(a == b)
    except Exception:  # any other == that is not a yes / no: changed
        return False


def _same_part(old, new) -> bool:
    return type(old) is type(new) and all(
        _same(getattr(old, f.name), getattr(new, f.name)) for f in dataclasses.fields(new)
    )


def _kept(old, new):
    """``new`` with each field that equals ``old``'s being ``old``'s object; ``old`` itself where all do.

    Field by field: a step's overview row changes a title or a count, not the score matrix or q / K
    / V beside it, whose pixels (and the views' drawing) then stay as they are.
    """
    if type(old) is not type(new):
        return new
    fields = dataclasses.fields(new)
    same = {f.name: getattr(old, f.name) for f in fields if _same(getattr(old, f.name), getattr(new, f.name))}
    if len(same) == len(fields):
        return old
    return dataclasses.replace(new, **same) if same else new


PARTS = ("tokens", "mask", "kv", "scores", "query_row", "qkv", "overview")


def prepare(prev: Snapshot | None, snap: Snapshot) -> Snapshot:
    """``snap`` with the unchanged parts of ``prev`` and its images' pixels made (``snap.painted``)."""
    if prev is not None and prev.source_id == snap.source_id and prev.T == snap.T:
        snap = dataclasses.replace(snap, **{name: _kept(getattr(prev, name), getattr(snap, name)) for name in PARTS})
    old = prev.painted if prev is not None and prev.painted is not None else Painted()

    def made(ready: Pixels | None, values, levels, lut, argb: bool = True) -> Pixels | None:
        if values is None or values.ndim != 2 or values.size == 0:
            return None
        if ready is not None and ready.values is values:
            return ready  # the same part as before: its pixels too
        return pixels(values, levels() if callable(levels) else levels, lut, made=argb)

    s, q, kv = snap.scores, snap.qkv, snap.kv
    painted = Painted(
        # the matrix's masked cells are what pyqtgraph is slow at: its pixels made here
        matrix=made(old.matrix, s.matrix, s.levels, MATRIX_LUT),
        tile=made(old.tile, s.tile, s.levels, MATRIX_LUT),
        # q / K / V and the cache have no masked cell: their levels (q's cells in K's scale) only
        qkv_k=None if q.q is None else made(old.qkv_k, q.k, lambda: _symmetric(q.q, q.k), SIGNED_LUT, False),
        qkv_v=made(old.qkv_v, q.v, lambda: _symmetric(q.v), SIGNED_LUT, False),
        kv_k=made(old.kv_k, kv.kv_k, lambda: _symmetric(kv.kv_k), SIGNED_LUT, False),
        kv_v=made(old.kv_v, kv.kv_v, lambda: _symmetric(kv.kv_v), SIGNED_LUT, False),
    )
    return dataclasses.replace(snap, painted=painted, t_built=time.perf_counter())  # built: ready to draw


def _symmetric(*arrays: np.ndarray) -> tuple[float, float]:
    """``symmetric_levels`` of the arrays' cells together, without copying them into one."""
    ends = [float(f(a)) for a in arrays for f in (np.max, np.min)]
    if not all(np.isfinite(ends)):  # the rare overflowed cache (NaN or inf cells): the careful way
        return symmetric_levels(np.concatenate([a.ravel() for a in arrays]))
    hi, lo = max(ends), min(ends)
    m = max(hi, -lo)
    return (-m, m) if m > 0 else (-1.0, 1.0)
