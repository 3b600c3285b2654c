"""The engine's answers to what a window shows: view-sized reads, computed here by the run-source
reader's own code (``core.tiles``, ``core.source``), so only the small result crosses the wire.

Mixed into ``server.Engine``; each ``op_<name>`` returns (JSON result, tensors) and runs under the
engine's lock with its arguments already checked against ``wire.OPS``.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import fields
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..core.errors import InspectorError

MAX_BINS = 1 << 24  # numbers (float64) in one answer of overview bins

if TYPE_CHECKING:
    from ..core.session import Session


class ReadOps:
    """What ``gpt-inspector --connect`` reads of the session, beyond ``server.Engine``'s rows."""

    lm: object

    def _s(self) -> Session:  # server.Engine's
        raise NotImplementedError

    def op_layers(self):
        """Per layer, the constants a reader of rows needs: the scaling, soft-cap, sink logits and
        whether the model adds a score bias (a session records them with its first forward)."""
        s = self._s()
        s.require_positions()
        att = set(s.attention_layers)
        sinks = [s.sink(i) for i in range(s.n_layers)]  # each (H,) or None
        return {"scaling": [s.scaling(i) if i in att else 1.0 for i in range(s.n_layers)],
                "softcap": [s.softcap(i) for i in range(s.n_layers)],
                "sink": [None if x is None else x.float().tolist() for x in sinks],
                "biased": [i for i in sorted(att) if s.score_bias(i) is not None],
                "head_output_start": s.head_output_start}, []  # fmt: skip

    def op_qkv_rows(self, layer, p0, p1):
        """q, K and V of positions p0..p1 of one layer in one reply: (H, n, d), (H_kv, n, d), (H_kv, n, d)."""
        s = self._s()
        _rows(s, p0, p1)
        return None, [s.queries(layer)[:, p0:p1], s.keys(layer)[:, p0:p1], s.values(layer)[:, p0:p1]]

    def op_allowed_rows(self, layer, p0, p1, keys=None, heads=None):
        a = self._s().allowed_rows(layer, p0, p1, keys)  # (H, n, T) bool
        return None, [a if heads is None else a[torch.as_tensor(heads, dtype=torch.long)]]

    def op_bias_rows(self, layer, p0, p1, heads=None):
        b = self._s().bias_rows(layer, p0, p1, heads)  # (h, n, T) or None
        return b is not None, [] if b is None else [b]

    def op_overview_bins(self, p0, p1, size):
        s = self._s()
        _rows(s, p0, p1)
        bins = s.n_layers * s.n_heads * ((p1 - 1) // size - p0 // size + 1) * -(-p1 // size)
        if p1 > p0 and bins > MAX_BINS:  # the overview's bins are few; this many would only fill the engine's memory
            raise InspectorError(f"{bins} overview bins asked for; the limit is {MAX_BINS}: use a larger size")
        return None, [torch.from_numpy(s.overview_bins(p0, p1, size))]  # (L, H, row bins, key bins) float64

    def op_pooled_rows(self, layer, head, kind, p0, p1, keys, block):
        s = self._s()
        _rows(s, p0, p1)
        return None, [torch.from_numpy(s.pooled_rows(s.check_attention_layer(layer), s.check_head(head), kind, p0, p1,
                                                     keys, block))]  # fmt: skip

    def op_attention_block(self, layer, head, kind, p0, p1, k0, k1, every=False, block=1):
        s = self._s()
        t = _rows(s, p0, p1)
        if not 0 <= k0 <= k1 <= t:
            raise InspectorError(f"key columns must lie in [0, {t}], got {k0}..{k1}")
        layer, head = s.check_attention_layer(layer), s.check_head(head)
        return None, [torch.from_numpy(s.attention_block(layer, head, kind, p0, p1, k0, k1, every, block))]

    def op_kv_history(self, lengths):
        s = self._s()
        return [[s.kv_cache_bytes(length=n), s.kv_kept_bytes(length=n)] for n in lengths], []

    def op_patch_edit(self, layer, head, prompt):
        """The HeadEdit that patches (layer, head) from a run of ``prompt`` stepped as far as this one."""
        from ..core.session import Session

        s = self._s()
        src = Session(s.lm, prompt)
        while src.cache_length < s.cache_length and not src.finished:
            src.step()
        return s.patch_edit(layer, head, src).to_json(), []

    def op_text(self):
        return self._s().text, []

    def op_head_outputs(self, layer):
        return None, [self._s().head_outputs(layer)]  # (H, T, d): the math check's model side, one layer

    def op_lens(self, top_k=5):
        from ..core.lens import lens

        r = lens(self._s(), top_k)
        top = lambda xs: [[e.token_id, e.label, e.prob, e.logit] for e in xs]  # noqa: E731
        head = {"step": r.step, "position": r.position, "token_id": r.token_id, "label": r.label, "logit": r.logit,
                "layers": [[x.layer, x.prob, x.logit, top(x.top)] for x in r.layers], "remainder": r.remainder,
                "note": r.note, "attribution": r.attribution is not None}  # fmt: skip
        return head, [] if r.attribution is None else [torch.from_numpy(np.ascontiguousarray(r.attribution))]

    def op_math_check(self, layer, head, position=None, tolerance=None):
        from ..core.mathcheck import check

        return pack(check(self._s(), layer, head, position, tolerance))

    def op_math_check_all(self, layers=None, tolerance=None):
        from ..core.mathcheck import check_all

        return pack(check_all(self._s(), layers, tolerance))

    def op_probe(self, layers, context="auto", tolerance=None):
        from dataclasses import asdict

        from ..core.probe import probe_session

        return asdict(probe_session(self._s(), layers, context=context, tolerance=tolerance)), []

    def op_trace(self, derived=False):
        """The session as a trace file (docs/trace-format.md), its bytes: saved where the client runs."""
        s = self._s()
        with tempfile.TemporaryDirectory(prefix="gpt-inspector-trace-") as d:
            path = os.path.join(d, "run.safetensors")
            s.save_trace(path, derived=derived)
            with open(path, "rb") as f:
                data = np.frombuffer(f.read(), dtype=np.uint8).copy()
        return None, [torch.from_numpy(data)]  # (bytes,) uint8


def pack(obj) -> tuple[dict, list[torch.Tensor]]:
    """A flat dataclass of numbers, strings and arrays as (JSON, tensors): each array by its index."""
    out, tensors = {}, []
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, np.ndarray):
            out[f.name] = {"tensor": len(tensors)}
            tensors.append(torch.from_numpy(np.ascontiguousarray(v)))
        else:
            out[f.name] = v.item() if isinstance(v, np.generic) else v
    return out, tensors


def unpack(cls, result: dict, tensors: list[torch.Tensor]):
    """``pack``'s inverse: the dataclass ``cls`` with its arrays back as numpy arrays."""
    kw = {}
    for f in fields(cls):
        v = result[f.name]
        kw[f.name] = tensors[v["tensor"]].numpy() if isinstance(v, dict) and set(v) == {"tensor"} else v
    return cls(**kw)


def _rows(s, p0: int, p1: int) -> int:
    t = s.require_positions()
    if not 0 <= p0 <= p1 <= t:
        raise InspectorError(f"query rows must lie in [0, {t}], got {p0}..{p1}")
    return t
