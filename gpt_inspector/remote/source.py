"""The run-source protocol over the wire: what lets the window (and any reader of a ``RunSource``)
read a session that runs on a remote engine.

Every read asks the engine for exactly what it names (the rows, the tiles, the bins), computed
there by the same reader code a local session runs, and keeps the answer until the session
changes; the whole-layer primitives (q, K, V of a layer, what the Q/K/V and KV cache panels show)
are kept across steps and extended by the new rows only, cropped where a step back or an edit
changed them. Nothing T x T and never every layer's cache, unless a reader asks for exactly that
(``attention``, an export; ``save_trace``, a download).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..core import outfile
from ..core.attention import MASKING_KINDS
from ..core.errors import InspectorError
from ..core.live import CAPABILITIES, Live
from ..core.source import RunSource
from .wire import MAX_THEN, THEN_OPS

# what runs only where the model is, for now: each refusal is the one line a front end shows
NOT_REMOTE: tuple[str, ...] = ()
QKV = ("queries", "keys", "values")
MOVING = ("p0", "p1", "keys", "k0", "k1")  # the arguments that name positions


def _key(op: str, args: dict) -> tuple:
    return (op, *sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in args.items()))


def _moved(v, t: int, block) -> object:
    """A position a read named at ``t`` positions, moved on by one step: the newest position (``t``)
    moves by one, and so does the start of the block holding the newest row (a pooled matrix
    recomputes its last row block: with blocks of 4, rows 8..10 at t = 10, then 8..11, 8..12, 12..13)."""
    if isinstance(v, bool) or not isinstance(v, int):
        return v
    if v == t:
        return v + 1
    b = block if isinstance(block, int) and block > 0 else 1
    return (t // b) * b if t > 0 and v == (t - 1) // b * b else v


def _why(name: str) -> str:
    return f"{name} runs on the engine's side and is not served over the link yet; run it where the model is"


class RemoteReads(RunSource):
    """The reader half of ``client.RemoteSession``: a ``RunSource`` whose primitives live on the engine."""

    read_only = False
    lm = None  # the model is on the engine's machine
    kv_layout = None  # answered by the engine (kv_* below), never derived here
    # set by the client from the engine's hello and state
    where: str
    dtype: str
    n_layers: int
    n_heads: int
    cache_length: int
    _kv: dict

    def _call_t(self, op: str, **args) -> tuple[object, list[torch.Tensor]]:  # the client's
        raise NotImplementedError

    def _require(self) -> None:  # the client's
        raise NotImplementedError

    # ------------------------------------------------------------------ the cache of reads
    def _reset_reads(self) -> None:
        """Forget every read (a new session, a reconnect): nothing kept is known to be current."""
        self._reads: dict[tuple, object] = {}
        self._prims: dict[tuple[str, int], torch.Tensor] = {}  # (op, layer) -> (h, n, d): rows 0..n current
        self._consts: dict | None = None  # per-layer constants (op "layers")
        self._kv_hist: dict[int, tuple[int, int]] = {}  # length -> (cache bytes, kept bytes)
        self._kv = {}
        self._log: list[tuple[str, dict]] = []  # the reads since the last change (what a repaint read)
        self._log_t = 0  # the positions when they began

    def _changed(self, changed_from: int) -> None:
        """The session changed; records from position ``changed_from`` on may differ."""
        self._reads.clear()
        self._log, self._log_t = [], self.cache_length
        for key, rows in list(self._prims.items()):
            self._prims[key] = rows[:, : min(changed_from, rows.shape[1])]

    def _read(self, op: str, **args) -> tuple[object, list[torch.Tensor]]:
        """One read, answered from the cache while the session has not changed since it was made."""
        self._require()
        key = _key(op, args)
        if op in THEN_OPS:
            self._log.append((op, args))
        hit = self._reads.get(key)
        if hit is None:
            hit = self._reads[key] = self._call_t(op, **args)
        return hit  # type: ignore[return-value]

    def _predicted(self) -> list[dict] | None:
        """The reads the repaint after one more step will make, if the last repaint's are known: the
        same reads, their newest positions moved on by one. A step's reply carries their answers (one
        round trip in all); a wrong guess costs only its bytes, never a number (nothing else reads them)."""
        t = self.cache_length
        if not self._log or self._log_t != t:
            return None
        out: list[dict] = []
        for op, args in self._log:
            moved = {k: _moved(v, t, args.get("block")) if k in MOVING else v for k, v in args.items()}
            if (
                op == "pooled_rows"
                and args.get("kind") in MASKING_KINDS
                and (args.get("p0"), args.get("p1")) == (t - 1, t)
            ):
                # a masked pooled matrix after a step reads only its newest row (core.pooling.PooledMatrix:
                # the cut row block keeps its older rows' maxima), so the next step's read is the next row
                moved["p0"] = t
            call = {"op": op, "args": moved}
            if call not in out:
                out.append(call)
        return out[:MAX_THEN]

    def _prefetched(self, then: list[dict] | None, answers, tensors: list[torch.Tensor]) -> None:
        """Keep the answers a step's reply carried for the reads ``then`` asked for."""
        i = 0
        for call, (ok, result, n) in zip(then or (), answers or ()):
            if ok:
                self._reads[_key(call["op"], call["args"])] = (result, tensors[i : i + n])
            i += n

    # ------------------------------------------------------------------ events (the window's view model)
    def subscribe(self, fn: Callable[[str, object], None]) -> None:
        self._listeners.append(fn)

    def _emit(self, event: str, payload) -> None:
        for fn in list(self._listeners):
            fn(event, payload)

    # ------------------------------------------------------------------ what the source is
    refused: dict = {}  # what the engine's model rules out on any session (core.source.model_refusals)

    @property
    def live(self) -> Live:
        return Live({**self.refused, **{c: _why(CAPABILITIES[c]) for c in NOT_REMOTE}})

    @property
    def engine(self) -> str:  # type: ignore[override]
        return self.where

    @property
    def source_name(self) -> str:
        return f"{self.model_name} on {self.where}"

    @property
    def cache_dtype(self) -> str:
        return self.dtype

    @property
    def kv_itemsize(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def attention_layers(self) -> tuple[int, ...]:  # type: ignore[override]
        return tuple(self._attention_layers)

    @property
    def records(self):  # type: ignore[override]
        raise InspectorError(_why("reading the raw records"))

    @property
    def head_output_start(self) -> int:
        return int(self._layer_consts()["head_output_start"])

    def _layer_consts(self) -> dict:
        if self._consts is None:
            self._consts = self._read("layers")[0]  # type: ignore[assignment]
        return self._consts  # type: ignore[return-value]

    def scaling(self, layer: int) -> float:
        return float(self._layer_consts()["scaling"][self.check_layer(layer)])

    def softcap(self, layer: int) -> float | None:
        cap = self._layer_consts()["softcap"][self.check_layer(layer)]
        return None if cap is None else float(cap)

    def sink(self, layer: int) -> torch.Tensor | None:
        x = self._layer_consts()["sink"][self.check_layer(layer)]
        return None if x is None else torch.tensor(x, dtype=torch.float32)  # (H,)

    # ------------------------------------------------------------------ primitives: kept, extended by new rows
    def _rows(self, op: str, layer: int, p0: int = 0, p1: int | None = None, heads=None) -> torch.Tensor:
        self._require()
        t = self.cache_length
        p1 = t if p1 is None else p1
        heads = None if heads is None else [int(h) for h in heads]
        if p0 != 0 or p1 != t or heads is not None:
            return self._read(op, layer=int(layer), p0=int(p0), p1=int(p1), heads=heads)[1][0]
        have = self._prims.get((op, layer))
        if have is None or have.shape[1] < t:
            # the Q/K/V and KV cache panels read all three of a layer: its new rows come in one request
            kept = [self._prims.get((x, layer)) for x in QKV]
            n = min(0 if x is None else x.shape[1] for x in kept)
            new = self._read("qkv_rows", layer=int(layer), p0=n, p1=t)[1]  # 3 x (h, t - n, d)
            for x, old, rows in zip(QKV, kept, new):
                self._prims[(x, layer)] = rows if old is None or n == 0 else torch.cat([old[:, :n], rows], dim=1)
            have = self._prims[(op, layer)]
        return have[:, :t]

    def queries(self, layer: int, p0: int = 0, p1: int | None = None, heads=None) -> torch.Tensor:
        """q of query rows p0..p1 (default all) for ``heads`` (default every head): (h, n, d)."""
        return self._rows("queries", layer, p0, p1, heads)

    def keys(self, layer: int, p0: int = 0, p1: int | None = None, heads=None) -> torch.Tensor:
        """The cached keys of positions p0..p1 for KV ``heads`` (default every KV head): (h_kv, n, d)."""
        return self._rows("keys", layer, p0, p1, heads)

    def values(self, layer: int, p0: int = 0, p1: int | None = None, heads=None) -> torch.Tensor:
        return self._rows("values", layer, p0, p1, heads)

    # ------------------------------------------------------------------ derived reads, computed on the engine
    def attention_rows(self, layer: int, p0: int, p1: int, kind: str = "probs", heads=None,
                       keys: int | None = None) -> torch.Tensor:  # fmt: skip
        """Query rows p0..p1 of ``kind`` (h, n, T) float32, computed on the server; only those rows travel."""
        heads = None if heads is None else [int(h) for h in heads]
        return self._read("attention_rows", layer=int(layer), p0=int(p0), p1=int(p1), kind=kind, heads=heads,
                          keys=keys)[1][0]  # fmt: skip

    def allowed_rows(self, layer: int, p0: int, p1: int, keys: int | None = None) -> torch.Tensor:
        """(H, p1 - p0, T) bool: the keys those query rows could attend to (see ``RunSource``)."""
        return self._read("allowed_rows", layer=int(layer), p0=int(p0), p1=int(p1), keys=keys)[1][0]

    def allowed(self, layer: int, head: int) -> np.ndarray:
        t = self.require_positions()
        rows = self._read("allowed_rows", layer=int(layer), p0=0, p1=t, heads=[int(head)])[1][0]
        return rows[0].numpy()  # (T, T): asked for whole (an export)

    def bias_rows(self, layer: int, p0: int, p1: int, heads=None) -> torch.Tensor | None:
        if self.check_layer(layer) not in self._layer_consts()["biased"]:
            return None
        heads = None if heads is None else [int(h) for h in heads]
        has, tensors = self._read("bias_rows", layer=int(layer), p0=int(p0), p1=int(p1), heads=heads)
        return tensors[0] if has else None

    def overview_bins(self, p0: int, p1: int, size: int) -> np.ndarray:
        return self._read("overview_bins", p0=int(p0), p1=int(p1), size=int(size))[1][0].numpy()

    def pooled_rows(self, layer: int, head: int, kind: str, p0: int, p1: int, keys: int, block: int) -> np.ndarray:
        return self._read("pooled_rows", layer=int(layer), head=int(head), kind=kind, p0=int(p0), p1=int(p1),
                          keys=int(keys), block=int(block))[1][0].numpy()  # fmt: skip

    def attention_block(self, layer: int, head: int, kind: str, p0: int, p1: int, k0: int, k1: int,
                        every: bool = False, block: int = 1) -> np.ndarray:  # fmt: skip
        return self._read("attention_block", layer=int(layer), head=int(head), kind=kind, p0=int(p0), p1=int(p1),
                          k0=int(k0), k1=int(k1), every=bool(every), block=int(block))[1][0].numpy()  # fmt: skip

    def attention(self, layer: int, head: int, kind: str = "probs") -> np.ndarray:
        """The whole (T, T) float32 numpy matrix of one head: asked for, so it travels whole."""
        return self._read("attention", layer=int(layer), head=int(head), kind=kind)[1][0].numpy()

    # ------------------------------------------------------------------ KV cache sizes, as the engine counts them
    def _kv_at(self, which: str, layer: int | None, length: int | None) -> int:
        self._require()
        if length is None or length == self.cache_length:
            per = self._kv[which]
            return int(sum(per) if layer is None else per[self.check_layer(layer)])
        if layer is not None:
            raise InspectorError("a remote session gives the KV bytes of one layer at its current length only")
        if length not in self._kv_hist:
            self._kv_hist[length] = tuple(self._call("kv_history", lengths=[int(length)])[0])  # type: ignore[attr-defined]
        return int(self._kv_hist[length][0 if which == "cache" else 1])

    def kv_cache_bytes(self, layer: int | None = None, length: int | None = None) -> int:
        return self._kv_at("cache", layer, length)

    def kv_kept_bytes(self, layer: int | None = None, length: int | None = None) -> int:
        return self._kv_at("kept", layer, length)

    def kv_per_head_bytes(self, layer: int | None = None) -> int:
        if layer is not None:
            raise InspectorError("a remote session gives the per-head bytes of the whole cache only")
        self._require()
        return int(self._kv["per_head"])

    @property
    def kv_note(self) -> str:
        """How the model's cache is laid out, where it is not per-head K and V (the engine's ``KVLayout.describe``)."""
        return str(self._kv.get("note", ""))

    @property
    def text(self) -> str:
        """The prompt and every chosen token, decoded by the engine's tokenizer."""
        return str(self._read("text")[0])

    def kv_cache_positions(self, layer: int, length: int | None = None) -> int:
        if length is not None and length != self.cache_length:
            raise InspectorError("a remote session gives the positions its cache holds now only")
        return int(self._kv["positions"][self.check_layer(layer)])

    # ------------------------------------------------------------------ computed on the engine, as a whole
    def head_outputs(self, layer: int) -> torch.Tensor:
        """(H, T, d) the attention output per head, as the engine has it (rows before its
        ``head_output_start`` recomputed there): one layer, asked for."""
        return self._read("head_outputs", layer=int(layer))[1][0]

    def head_output_row(self, layer: int, position: int) -> torch.Tensor:
        return self.head_outputs(layer)[:, position]  # (H, d)

    def kept_head_outputs(self, layer: int) -> tuple[int, torch.Tensor]:
        return 0, self.head_outputs(layer)

    def remote_lens(self, top_k: int = 5):
        """``core.lens.lens`` of the session, computed on the engine (it has the model)."""
        from ..core.lens import LensLayer, LensResult
        from ..core.step import TopEntry

        r, tensors = self._read("lens", top_k=int(top_k))
        layers = [LensLayer(int(i), [TopEntry(int(a), str(b), float(c), float(d)) for a, b, c, d in top], float(p),
                            float(lg)) for i, p, lg, top in r["layers"]]  # type: ignore[index]  # fmt: skip
        return LensResult(r["step"], r["position"], r["token_id"], r["label"], layers,  # type: ignore[index]
                          tensors[0].numpy() if r["attribution"] else None, r["remainder"], r["logit"],  # type: ignore[index]
                          r["note"])  # type: ignore[index]  # fmt: skip

    def remote_math_check(self, layer: int, head: int, position: int | None = None, tolerance: float | None = None):
        """``core.mathcheck.check``, computed on the engine (float64, beside the model's own output)."""
        from ..core.mathcheck import MathCheck
        from .reads import unpack

        r, tensors = self._read("math_check", layer=int(layer), head=int(head), position=position, tolerance=tolerance)
        return unpack(MathCheck, r, tensors)  # type: ignore[arg-type]

    def remote_math_check_all(self, layers=None, tolerance: float | None = None):
        from ..core.mathcheck import MathCheckReport
        from .reads import unpack

        layers = None if layers is None else [int(i) for i in ([layers] if isinstance(layers, int) else layers)]
        r, tensors = self._read("math_check_all", layers=layers, tolerance=tolerance)
        return unpack(MathCheckReport, r, tensors)  # type: ignore[arg-type]

    def remote_probe(self, layers=(0,), context: str = "auto", tolerance: float | None = None):
        """``core.probe.probe_session``, run on the engine (the probe replays candidates through its model)."""
        from ..core.probe import LayerProbe, PositionProbe, ProbeResult

        self.live.require("probe")
        layers = [int(layers)] if isinstance(layers, int) else [int(i) for i in layers]
        r: dict = self._read("probe", layers=layers, context=context, tolerance=tolerance)[0]  # type: ignore[assignment]
        out = [LayerProbe(**{**x, "positions": [PositionProbe(**p) for p in x["positions"]]}) for x in r["layers"]]
        return ProbeResult(**{**r, "layers": out})

    # ------------------------------------------------------------------ downloads
    def save_trace(self, path, derived: bool = False):
        """Save the session as a trace file here (the engine writes it, the bytes come over the link)."""
        from pathlib import Path

        path = Path(outfile.expand(path))
        if path.suffix != ".safetensors":
            raise InspectorError(f"trace files end in .safetensors, got {path.name}")
        outfile.check_target(path)
        self._require()
        data = self._call_t("trace", derived=bool(derived))[1][0]
        return outfile.write_bytes(path, data.numpy().tobytes())
