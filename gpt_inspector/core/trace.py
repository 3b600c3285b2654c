"""Trace files: safetensors tensors + JSON metadata, never pickle (docs/trace-format.md).

Format v2 (``gpt-inspector-trace/2``) stores a run's primitives: per layer q, K, V and the head
outputs, the model's own mask rows where they are not plain causal, plus the edits, scaling and
soft-caps, the tokens, each step's logits and top-k candidates with their token text. Every
matrix is derived on load by the one equation (``core.attention``), exactly as for a live
session. ``save_trace(..., derived=True)`` also writes the matrices for readers with plain numpy.
Version 1 files (matrices stored) still open.

``load_trace`` checks every name, dtype and shape in the header against the metadata before it
reads a tensor: a corrupt or foreign file raises ``InspectorError`` and nothing else.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import torch

from . import decoding, outfile
from .attention import ScoreBias
from .edits import HeadEdit, MaskEdit, compile_edits
from .errors import InspectorError
from .kv_layout import KVLayout
from .source import Live, RunRecords, RunSource, to_numpy
from .step import TOP_N, Step

FORMAT = "gpt-inspector-trace/2"
FORMAT_V1 = "gpt-inspector-trace/1"
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
_MAX_JSON = 64 << 20  # bytes of one metadata value; larger is not a trace we wrote
_SHAPE = ("n_layers", "n_heads", "n_kv_heads", "head_dim", "context_length", "vocab_size")  # ints >= 1


def save_trace(source: RunSource, path: str | os.PathLike, derived: bool = False) -> Path:
    """Write everything ``source`` processed to ``path`` (.safetensors); see docs/trace-format.md."""
    from safetensors.numpy import save_file

    path = Path(path)
    if path.suffix != ".safetensors":
        raise InspectorError(f"trace files end in .safetensors, got {path.name}")
    outfile.check_target(path)  # a folder, device or link named here is refused before the tensors are gathered
    t = source.cache_length
    if t == 0:
        raise InspectorError("nothing to save: run a step first")
    if source.kv_policy is not None:
        # the format has no place for a policy's evictions: a reader would attend to evicted entries
        raise InspectorError("a KV cache lab run cannot be saved as a trace yet; save the reference run instead")
    L = source.n_layers
    if len(source.attention_layers) != L:
        # the format keeps every layer's q, K and V; a hybrid's state-space layers have none
        raise InspectorError("traces of hybrid models (layers without attention) are not supported yet")
    tensors: dict[str, np.ndarray] = {"tokens": np.asarray(source.tokens, dtype=np.int64)}
    for layer in range(L):
        for name, x in zip("qkv", source.qkv(layer)):
            tensors[f"layers.{layer}.{name}"] = x  # q (H, T, d), k and v (H_kv, T, d)
        start, out = source.kept_head_outputs(layer)
        tensors[f"layers.{layer}.attn_out"] = to_numpy(out)  # (H, T - start, d)
        rows = source.mask_rows(layer)
        if rows:
            pos = sorted(p for p in rows if p < t)
            per_head = any(rows[p].dim() >= 2 for p in pos)  # a mask per head (doge's dynamic top-k)
            m = np.zeros((len(pos), source.n_heads, t) if per_head else (len(pos), t), dtype=bool)
            for i, p in enumerate(pos):
                r = rows[p].numpy()  # keys past a row's own forward are future keys
                r = r[0] if r.ndim == 3 else r  # a live session's (1, H, T)
                m[i, ..., : min(r.shape[-1], t)] = r[..., :t]
            tensors[f"layers.{layer}.mask_positions"] = np.asarray(pos, dtype=np.int64)  # (n,)
            tensors[f"layers.{layer}.mask_rows"] = m  # (n, T) or (n, H, T) bool
        bias = source.score_bias(layer)
        if bias is not None and bias.form == "alibi":
            tensors[f"layers.{layer}.bias_ref"] = bias.ref[:t].float().numpy()  # (T,)
        elif bias is not None:
            tensors[f"layers.{layer}.bias_rows"] = bias.rows[:, :t].float().numpy()  # (H, T)
        if derived:
            for kind in ("scores", "masked_scores", "probs"):
                tensors[f"layers.{layer}.{kind}"] = source.attention_rows(layer, 0, t, kind).numpy()  # (H, T, T)
    steps = source.steps_done
    if steps:
        tensors["step_logits"] = np.stack([s.logits.float().numpy() for s in steps])  # (n_steps, V)
    step_meta = [
        {"index": s.index, "position": s.position, "token_id": s.token_id, "forced": s.forced,
         "finish_reason": s.finish_reason, "top": [[e.token_id, e.label] for e in s.top]}
        for s in steps
    ]  # fmt: skip
    meta = {
        "format": FORMAT,
        "model": source.model_name,
        "prompt": source.prompt,
        "prompt_length": str(source.prompt_length),
        "decoding": json.dumps(source.decoding.to_json()),
        **_sampler_meta(source),
        "mask_edits": json.dumps([e.to_json() for e in source.mask_edits]),
        "head_edits": json.dumps([e.to_json() for e in source.head_edits]),
        "seed": str(source.seed),
        "text": source.text,
        "token_labels": json.dumps(source.token_labels()),
        "steps": json.dumps(step_meta),
        "scaling": json.dumps([source.scaling(layer) for layer in range(L)]),
        "softcap": json.dumps([source.softcap(layer) for layer in range(L)]),
        "sinks": json.dumps([None if source.sink(layer) is None else source.sink(layer).tolist() for layer in range(L)]),
        "score_bias": json.dumps([_bias_meta(source.score_bias(layer)) for layer in range(L)]),
        "unverified": source.unverified or "",
        "shape": json.dumps({**{k: getattr(source, k) for k in _SHAPE}, "cache_dtype": source.cache_dtype,
                             **_value_head_dim(source)}),
        # what the model's cache held per layer (a latent, shared layers): kv_cache_bytes as it really was
        **({} if source.kv_layout is None else {"kv_layout": json.dumps(source.kv_layout.to_json())}),
        "finished": source.finished or "",
        "derived": "1" if derived else "0",
        "attn_out_start": str(source.head_output_start),
    }  # fmt: skip
    _write_atomically(path, lambda tmp: save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
                                                  tmp, metadata=meta))  # fmt: skip
    return path


def _sampler_meta(source) -> dict:
    """What, beyond the user's settings, rebuilds the same processors without the model: its shipped
    generation-config defaults, its EOS ids, generate's max_length. Nothing for a source without a sampler."""
    make = getattr(source, "sampler", None)
    if not callable(make):
        return {}
    sp = make()
    try:
        shipped = json.dumps(sp.shipped)
    except (TypeError, ValueError):  # a default JSON cannot hold (a sequence bias keyed by tuples): not recorded
        shipped = "{}"
    return {"sampler": json.dumps({"shipped": json.loads(shipped), "eos_token_ids": list(sp.eos_token_ids),
                                   "max_length": sp.max_length})}  # fmt: skip


def _bias_meta(bias) -> dict | None:
    if bias is None:
        return None
    if bias.form == "alibi":
        return {"form": "alibi", "slopes": bias.slopes.float().tolist()}
    return {"form": "key"}


def _value_head_dim(source) -> dict:
    """``{"v_head_dim": dv}`` where V's head size differs from q's and K's (MLA), else nothing."""
    layers = source.attention_layers
    dv = source.values(layers[0]).shape[-1] if layers and source.cache_length else source.head_dim
    return {} if dv == source.head_dim else {"v_head_dim": int(dv)}


def check_destination(path: Path) -> None:
    """Refuse a destination that cannot take a file, before any work is done for it."""
    outfile.check_writable(path)


def _write_atomically(path: Path, write) -> None:
    """``write(tmp_name)`` through the one writer (core.outfile): a failed or interrupted write (disk full,
    read-only folder, Ctrl+C) leaves whatever ``path`` held before and no temporary; the run is untouched."""
    outfile.write_with(path, write, mode=0o600)  # the prompt and the run's numbers: private, as autosaves are


class _TraceRecords(RunRecords):
    """The run-source records a trace file holds, as ``load_trace`` validated them."""

    def __init__(self, tensors: dict[str, torch.Tensor], meta: dict, edits, mask_rows: list, biases: list):
        self._t = tensors
        self.head_output_start: int = meta["attn_out_start"]
        self.edits = edits
        self._scaling: list[float] = meta["scaling"]
        self._softcap: list[float | None] = meta["softcap"]
        self._sinks = [None if s is None else torch.tensor(s, dtype=torch.float32) for s in meta["sinks"]]
        self._mask_rows, self._biases = mask_rows, biases

    def queries(self, layer: int) -> torch.Tensor:
        return self._t[f"layers.{layer}.q"]

    def keys(self, layer: int) -> torch.Tensor:
        return self._t[f"layers.{layer}.k"]

    def values(self, layer: int) -> torch.Tensor:
        return self._t[f"layers.{layer}.v"]

    def head_outputs(self, layer: int) -> torch.Tensor:
        return self._t[f"layers.{layer}.attn_out"]

    def mask_rows(self, layer: int) -> dict[int, torch.Tensor]:
        return self._mask_rows[layer]

    def scaling(self, layer: int) -> float:
        return self._scaling[layer]

    def softcap(self, layer: int) -> float | None:
        return self._softcap[layer]

    def sink(self, layer: int) -> torch.Tensor | None:
        return self._sinks[layer]

    def score_bias(self, layer: int) -> ScoreBias | None:
        return self._biases[layer]


class Trace(RunSource):
    """A saved run, read-only, with every accessor of a live Session; no model needed (``live``
    refuses everything that runs one, in one line)."""

    def __init__(self, path: Path, tensors: dict[str, torch.Tensor], meta: dict):
        self.path = path
        self._t = tensors
        self.meta = meta
        shape = meta["shape"]
        for key in _SHAPE:  # n_layers, n_heads, ...: validated ints
            setattr(self, key, shape[key])
        self.kv_layout = meta.get("kv_layout")  # a KVLayout (validated), or None: an ordinary per-head cache
        self.cache_dtype: str = (
            shape.get("cache_dtype", "float32") if shape.get("cache_dtype") in _ITEMSIZE else "float32"
        )
        self.model_name: str = meta["model"]
        self.prompt: str = meta["prompt"]
        self.seed: int = meta["seed"]
        self.text: str = meta["text"]
        self.tokens: list[int] = tensors["tokens"].tolist()
        self.prompt_ids: list[int] = self.tokens[: meta["prompt_length"]]
        self.finished: str | None = meta["finished"] or None
        self.mask_edits: list[MaskEdit] = [MaskEdit.from_json(e) for e in meta["mask_edits"]]
        self.head_edits: list[HeadEdit] = [HeadEdit.from_json(e) for e in meta["head_edits"]]
        self.decoding, self._sampler = _trace_sampler(meta)
        self.unverified: str | None = meta["unverified"]
        edits = compile_edits(self.mask_edits, self.n_layers, self.n_heads)[1] if self.mask_edits else None
        self.records = _TraceRecords(tensors, meta, edits, [self._layer_mask_rows(layer) for layer in range(self.n_layers)],
                                     [self._layer_bias(layer, b) for layer, b in enumerate(meta["score_bias"])])  # fmt: skip
        self._labels = dict(zip(self.tokens, meta["token_labels"]))
        for s in meta["steps"]:
            for tid, lab in s.get("top", ()):
                self._labels.setdefault(tid, lab)
        self.steps_done = [self._step(i, s) for i, s in enumerate(meta["steps"])]

    def _layer_mask_rows(self, layer: int) -> dict[int, torch.Tensor]:
        pos = self._t.get(f"layers.{layer}.mask_positions")
        if pos is None:
            return {}
        rows = self._t[f"layers.{layer}.mask_rows"]
        return {int(p): rows[i] for i, p in enumerate(pos.tolist())}

    def _layer_bias(self, layer: int, b: dict | None) -> ScoreBias | None:
        if b is None:
            return None
        if b["form"] == "alibi":
            return ScoreBias("alibi", slopes=torch.tensor(b["slopes"], dtype=torch.float32),
                             ref=self._t[f"layers.{layer}.bias_ref"])  # fmt: skip
        return ScoreBias("key", rows=self._t[f"layers.{layer}.bias_rows"])

    def _step(self, i: int, s: dict) -> Step:
        logits = self._t["step_logits"][i].float()  # (V,)
        st = Step(s["index"], s["position"], s["token_id"], "", logits, logits, [], 0.0, s["forced"], 0.0,
                  s.get("finish_reason"))  # fmt: skip
        st.refresh(self._sampler, self.label, self.label, self.tokens[: len(self.prompt_ids) + st.index])
        st.top = st.top[:TOP_N]
        return st

    def sampler(self, dec=None) -> decoding.Sampler:
        """The processors the run used, rebuilt from the recorded settings (no model needed)."""
        return self._sampler

    def label(self, token_id: int) -> str:
        """The token's readable text, for every token of the run and every stored candidate."""
        return self._labels.get(int(token_id), f"#{int(token_id)}")

    @property
    def source_name(self) -> str:
        return str(self.path)

    @property
    def live(self) -> Live:
        return Live.nothing("a trace file has no model; load the model and re-run the prompt")

    @property
    def cache_length(self) -> int:
        return self._t["layers.0.q"].shape[1]

    @property
    def kv_itemsize(self) -> int:
        return _ITEMSIZE[self.cache_dtype]

    @property
    def step_logits(self) -> np.ndarray:
        return self._t["step_logits"].numpy()


def _trace_sampler(meta: dict) -> tuple[decoding.Decoding, decoding.Sampler]:
    """The recorded settings and the sampler they give; older files (no "sampler": no model defaults,
    no EOS) show the processors of the settings alone, and settings this version cannot read fall
    back to the first three, then to the raw distribution."""
    d, rec = meta["decoding"], meta.get("sampler") or {}
    for attempt in (lambda: decoding.Decoding.from_json(d),
                    lambda: decoding.Decoding(d.get("temperature", 0.0), d.get("top_k"), d.get("top_p")),
                    decoding.Decoding):  # fmt: skip
        try:
            dec = attempt()
            break
        except (InspectorError, AttributeError, TypeError):
            continue
    prompt_length = int(meta["prompt_length"])
    try:
        return dec, decoding.Sampler(dec, rec.get("shipped"), rec.get("eos_token_ids", ()), prompt_length,
                                     rec.get("max_length"))  # fmt: skip
    except (InspectorError, AttributeError, TypeError, ValueError):
        return dec, decoding.Sampler(dec, prompt_length=prompt_length)


# ------------------------------------------------------------------------------------------ loading
def load_trace(path: str | os.PathLike) -> Trace:
    """Open a trace file; anything malformed raises InspectorError with a one-line reason."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise InspectorError(f"no trace file at {path}")
    name = path.name
    try:
        with safe_open(str(path), framework="pt") as f:
            raw_meta = f.metadata() or {}
            fmt = raw_meta.get("format")
            if fmt not in (FORMAT, FORMAT_V1):
                raise InspectorError(f"{name} is not a gpt-inspector trace (format {fmt!r})")
            header = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
            meta, expect = _validate_header(name, header, raw_meta, v1=fmt == FORMAT_V1)
            _check_plausible_size(name, path, header, expect, v1=fmt == FORMAT_V1)
            # only what the format needs is read; v1's stored matrices are derived again instead
            tensors = {k: f.get_tensor(k) for k in expect}
            if fmt == FORMAT_V1:
                _v1_mask_rows(tensors, f, meta)
    except InspectorError:
        raise
    except Exception as e:  # safetensors raises several types for truncated or garbled files
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InspectorError(f"{name} is not a readable trace file: {first}") from None
    _validate_values(name, tensors, meta)
    return Trace(path, tensors, meta)


_SPARSE_CHECK_FROM = (
    64 << 20
)  # below this a trace is too small to hurt, and compressed filesystems may report few blocks
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "BOOL": 1}


def _check_plausible_size(name: str, path: Path, header: dict, expect: dict, v1: bool) -> None:
    """Refuse, before reading, a file whose tensors could not be what we wrote.

    A consistent header can still claim many GiB: reading it would exhaust memory. We wrote every
    byte we store, so data that the disk does not hold (a sparse file) is not one of our traces,
    and no trace may need more memory than the machine has.
    """
    from .validate import memory_bytes

    keys = list(expect) + ([k for k in header if k.endswith(".masked_scores")] if v1 else [])
    need = sum(math.prod(header[k][0]) * _DTYPE_BYTES.get(header[k][1], 8) for k in keys)
    ram = memory_bytes()
    if ram and need > ram:
        raise InspectorError(
            f"{name}: opening it needs {need / 2**30:.1f} GiB but this machine has {ram / 2**30:.1f} GiB of memory"
        )
    if need >= _SPARSE_CHECK_FROM:
        st = os.stat(path)
        stored = getattr(st, "st_blocks", None)
        if stored is not None and stored * 512 < need // 2:
            raise InspectorError(
                f"{name}: claims {need / 2**20:.0f} MiB of tensors but only {stored * 512 / 2**20:.0f} MiB "
                "are stored on disk (a sparse or hollow file, not a trace we wrote)"
            )


def _v1_mask_rows(tensors: dict, f, meta: dict) -> None:
    """v1 stored matrices; the model's own mask is where any head's masked score is finite."""
    for layer in range(meta["shape"]["n_layers"]):
        allowed = torch.isfinite(f.get_tensor(f"layers.{layer}.masked_scores")).any(dim=0)  # (T, T)
        t = allowed.shape[0]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        pos = torch.nonzero((allowed != causal).any(dim=1)).flatten()
        if len(pos):
            tensors[f"layers.{layer}.mask_positions"] = pos.to(torch.int64)
            tensors[f"layers.{layer}.mask_rows"] = allowed[pos]


def _json(name: str, meta: dict, key: str, typ):
    raw = meta.get(key)
    if raw is None:
        raise InspectorError(f"{name}: metadata {key!r} is missing")
    if len(raw) > _MAX_JSON:
        raise InspectorError(f"{name}: metadata {key!r} is implausibly large")
    try:
        val = json.loads(raw)
    except (TypeError, ValueError, RecursionError):
        raise InspectorError(f"{name}: metadata {key!r} is not valid JSON") from None
    if not isinstance(val, typ):
        raise InspectorError(f"{name}: metadata {key!r} has the wrong type")
    return val


def _int(name: str, meta: dict, key: str) -> int:
    try:
        return int(meta[key])
    except (KeyError, ValueError, TypeError):
        raise InspectorError(f"{name}: metadata {key!r} is missing or not an integer") from None


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _validate_header(name: str, header: dict, meta: dict, v1: bool) -> tuple[dict, dict]:
    """Check the metadata and every tensor's name, dtype and shape, reading no tensor data.

    Returns the parsed metadata and the tensors to read, name -> (shape, dtype).
    """
    out: dict = {"format": meta.get("format")}
    for key in ("model", "prompt", "text"):
        if not isinstance(meta.get(key), str):
            raise InspectorError(f"{name}: metadata {key!r} is missing")
        out[key] = meta[key]
    out["finished"] = meta.get("finished", "")
    out["seed"] = _int(name, meta, "seed")
    out["prompt_length"] = _int(name, meta, "prompt_length")
    shape = _json(name, meta, "shape", dict)
    for key in _SHAPE:
        v = shape.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InspectorError(f"{name}: shape field {key!r} is missing or not a positive integer")
    if shape["n_heads"] % shape["n_kv_heads"]:
        raise InspectorError(f"{name}: {shape['n_heads']} heads do not split over {shape['n_kv_heads']} KV heads")
    L, H, Hkv, d, V = (shape[k] for k in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size"))
    dv = shape.get("v_head_dim", d)  # V's head size where it differs from K's (multi-head latent attention)
    if isinstance(dv, bool) or not isinstance(dv, int) or not 1 <= dv <= 65536:
        raise InspectorError(f"{name}: shape field 'v_head_dim' is not a positive integer")
    out["kv_layout"] = None
    if "kv_layout" in meta:
        try:
            out["kv_layout"] = KVLayout.from_json(_json(name, meta, "kv_layout", dict), L)
        except ValueError as e:
            raise InspectorError(f"{name}: metadata 'kv_layout' is malformed: {e}") from None
    if L > 4096 or H > 4096 or d > 65536 or V > 1 << 24:
        raise InspectorError(f"{name}: implausible shape {shape}")
    out["shape"] = shape
    out["decoding"] = _json(name, meta, "decoding", dict)
    out["sampler"] = _json(name, meta, "sampler", dict) if "sampler" in meta else None  # older files: none
    for key, cls, what in (("mask_edits", MaskEdit, "mask edit"), ("head_edits", HeadEdit, "head edit")):
        raw = _json(name, meta, key, list) if key in meta or key == "mask_edits" else []  # older files: no head edits
        edits = [cls.from_json(e) if isinstance(e, dict) else _bad(name, key) for e in raw]
        for e in edits:  # a mask edit's layer may be None (every layer), a head edit's never is
            if (e.layer is not None and not 0 <= e.layer < L) or (e.head is not None and not 0 <= e.head < H):
                raise InspectorError(f"{name}: {what} {e.to_json()} is outside the model's layers or heads")
            # positions and token ids become tensor indices: a huge one overflowed in torch, not here
            if isinstance(e, MaskEdit) and not 0 <= e.key <= e.query < shape["context_length"]:
                raise InspectorError(f"{name}: mask edit at ({e.query}, {e.key}) is outside the model's context")
            if isinstance(e, HeadEdit) and e.patch_from is not None and not all(0 <= t < V for t in e.patch_from):
                raise InspectorError(f"{name}: a head edit patches from token ids outside the vocabulary")
        out[key] = [e.to_json() for e in edits]
    labels = _json(name, meta, "token_labels", list)
    steps = _json(name, meta, "steps", list)
    scaling = _json(name, meta, "scaling", list)
    if len(scaling) != L or not all(_positive(x) for x in scaling):
        raise InspectorError(f"{name}: scaling must hold one positive number per layer")
    softcap = _json(name, meta, "softcap", list) if "softcap" in meta else [None] * L
    if len(softcap) != L or not all(x is None or _positive(x) for x in softcap):
        raise InspectorError(f"{name}: softcap must hold one positive number or null per layer")
    sinks = _json(name, meta, "sinks", list) if "sinks" in meta else [None] * L
    if len(sinks) != L or not all(x is None or _sink_ok(x, H) for x in sinks):
        raise InspectorError(f"{name}: sinks must hold one list of {H} finite numbers or null per layer")
    biases = _json(name, meta, "score_bias", list) if "score_bias" in meta else [None] * L
    if len(biases) != L or not all(_bias_ok(b, H) for b in biases):
        raise InspectorError(
            f"{name}: score_bias must hold, per layer, null, an alibi form with {H} slopes or a key form"
        )

    tok = header.get("tokens")
    if tok is None or tok[1] != "I64" or len(tok[0]) != 1 or tok[0][0] == 0:
        raise InspectorError(f"{name}: 'tokens' must be a non-empty int64 vector")
    n_tok = tok[0][0]
    q0 = header.get("layers.0.q")
    if q0 is None or len(q0[0]) != 3:
        raise InspectorError(f"{name}: missing 'layers.0.q'")
    T = q0[0][1]
    if not 1 <= T <= n_tok:
        raise InspectorError(f"{name}: {T} processed positions but {n_tok} tokens")
    if n_tok > shape["context_length"] + 1:  # the last chosen token is never fed, so one past the context
        raise InspectorError(f"{name}: {n_tok} tokens but the model's context is {shape['context_length']}")
    n_steps = len(steps)
    if n_tok != out["prompt_length"] + n_steps:
        raise InspectorError(f"{name}: {n_tok} tokens but prompt {out['prompt_length']} + {n_steps} steps")
    start = _int(name, meta, "attn_out_start") if "attn_out_start" in meta else 0  # older files kept every row
    if not 0 <= start < T:
        raise InspectorError(f"{name}: attn_out_start {start} is outside the {T} processed positions")
    out["attn_out_start"] = start
    if len(labels) != n_tok or not all(isinstance(x, str) for x in labels):
        raise InspectorError(f"{name}: token_labels do not match the tokens")

    need: dict[str, tuple[tuple, str]] = {"tokens": ((n_tok,), "I64")}
    optional: dict[str, tuple[tuple, str]] = {}
    derived = {k: (H, T, T) for k in ("scores", "masked_scores", "probs")}
    layout = out["kv_layout"]
    for layer in range(L):
        # a layer's own K/V shape where the layout says (Gemma 4's full-attention layers: their own head size, KV heads)
        lk = None if layout is None else layout.layers[layer]
        (hk, dk), (hv, dvl) = ((Hkv, d), (Hkv, dv)) if lk is None else (lk.keys, lk.values)
        for n, s in (("q", (H, T, dk)), ("k", (hk, T, dk)), ("v", (hv, T, dvl)), ("attn_out", (H, T - start, dvl))):
            need[f"layers.{layer}.{n}"] = (s, "F32")
        for n, s in derived.items():
            (need if v1 else optional)[f"layers.{layer}.{n}"] = (s, "F32")
        rows = header.get(f"layers.{layer}.mask_positions")
        if rows is not None and not v1:
            n = rows[0][0] if len(rows[0]) == 1 else -1
            if n < 0 or n > T:
                raise InspectorError(f"{name}: tensor 'layers.{layer}.mask_positions' has shape {rows[0]}")
            need[f"layers.{layer}.mask_positions"] = ((n,), "I64")
            per_head = len(header.get(f"layers.{layer}.mask_rows", ((),))[0]) == 3
            need[f"layers.{layer}.mask_rows"] = ((n, H, T) if per_head else (n, T), "BOOL")
        bias = biases[layer] if not v1 else None
        if bias is not None and bias["form"] == "alibi":
            need[f"layers.{layer}.bias_ref"] = ((T,), "F32")
        elif bias is not None:
            need[f"layers.{layer}.bias_rows"] = ((H, T), "F32")
    if n_steps or v1:
        need["step_logits"] = ((n_steps, V), "F32")
    for key, (s, dt) in need.items():
        got = header.get(key)
        if got is None:
            raise InspectorError(f"{name}: tensor {key!r} is missing")
        if got[0] != s:
            raise InspectorError(f"{name}: tensor {key!r} has shape {got[0]}, expected {s}")
        if got[1] != dt:
            raise InspectorError(f"{name}: tensor {key!r} is {got[1]}, expected {dt}")
    for key, (s, dt) in optional.items():
        got = header.get(key)
        if got is not None and got != (s, dt):
            raise InspectorError(f"{name}: tensor {key!r} has shape {got[0]} {got[1]}, expected {s} {dt}")
    extra = set(header) - set(need) - set(optional)
    if extra:
        raise InspectorError(f"{name}: unexpected tensors {sorted(extra)[:3]}")
    for i, s in enumerate(steps):
        ok = (
            isinstance(s, dict)
            and s.get("index") == i
            and isinstance(s.get("position"), int)
            and not isinstance(s.get("position"), bool)
            and isinstance(s.get("token_id"), int)
            and 0 <= s["token_id"] < V
            and isinstance(s.get("forced"), bool)
            and (s.get("finish_reason") is None or isinstance(s.get("finish_reason"), str))
            and _top_ok(s.get("top", []), V)
        )
        if not ok:
            raise InspectorError(f"{name}: step {i} metadata is malformed")
    out.update(token_labels=labels, steps=steps, scaling=[float(x) for x in scaling],
               softcap=[None if x is None else float(x) for x in softcap], sinks=sinks, score_bias=biases,
               unverified=str(meta.get("unverified") or "") or None)  # fmt: skip
    # v1 kept only the matrices' shapes; its masked_scores are read for the mask, not kept
    to_read = {k: v for k, v in need.items() if not (v1 and k.rsplit(".", 1)[-1] in derived)}
    return out, to_read


def _sink_ok(x, H: int) -> bool:
    return (
        isinstance(x, list)
        and len(x) == H
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in x)
    )


def _bias_ok(b, H: int) -> bool:
    if b is None:
        return True
    if not isinstance(b, dict):
        return False
    if b.get("form") == "alibi":
        return set(b) == {"form", "slopes"} and _sink_ok(b["slopes"], H)
    return b == {"form": "key"}


def _top_ok(top, V: int) -> bool:
    return isinstance(top, list) and all(
        isinstance(e, list) and len(e) == 2 and isinstance(e[0], int) and not isinstance(e[0], bool)
        and 0 <= e[0] < V and isinstance(e[1], str)
        for e in top
    )  # fmt: skip


def _bad(name: str, key: str):
    raise InspectorError(f"{name}: metadata {key!r} is malformed")


def _validate_values(name: str, t: dict[str, torch.Tensor], meta: dict) -> None:
    V = meta["shape"]["vocab_size"]
    tokens = t["tokens"]
    if int(tokens.min()) < 0 or int(tokens.max()) >= V:
        raise InspectorError(f"{name}: token ids outside the vocabulary")
    T = t["layers.0.q"].shape[1]
    for layer in range(meta["shape"]["n_layers"]):
        pos = t.get(f"layers.{layer}.mask_positions")
        if (
            pos is not None
            and len(pos)
            and (int(pos.min()) < 0 or int(pos.max()) >= T or len(set(pos.tolist())) != len(pos))
        ):
            raise InspectorError(f"{name}: layer {layer} mask rows name positions outside [0, {T})")
        for part in ("bias_ref", "bias_rows"):
            bias = t.get(f"layers.{layer}.{part}")
            if bias is not None and not bool(torch.isfinite(bias).all()):
                raise InspectorError(f"{name}: layer {layer} has a score bias that is not finite")
        rows = t.get(f"layers.{layer}.mask_rows")
        if rows is not None and len(rows) and not bool(rows.any(dim=-1).all()):
            raise InspectorError(f"{name}: layer {layer} has a mask row that allows no key")
