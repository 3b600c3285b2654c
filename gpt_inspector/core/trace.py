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

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import torch

from . import decoding, outfile
from .attention import ScoreBias, expand_kv
from .edits import HeadEdit, MaskEdit, compile_edits
from .errors import InspectorError
from .live import Live
from .source import RunRecords, RunSource, to_numpy
from .step import TOP_N, Step
from .trace_check import ITEMSIZE, SHAPE_FIELDS, check_plausible_size, validate_header, validate_values

FORMAT = "gpt-inspector-trace/2"
NEVER = torch.iinfo(torch.long).max  # a policy run's evicted_at of an entry still held (core.kvlab's convention)
FORMAT_V1 = "gpt-inspector-trace/1"


def save_refusal(source: RunSource) -> str | None:
    """Why ``source`` cannot be saved as a trace, in one line, or None where it can (a front end
    asks before offering Save)."""
    if source.cache_length == 0:
        return "nothing to save: run a step first"
    policy = source.kv_policy
    if policy is not None and policy.kind != "eviction":
        # a quantized row's error is measured against the model's full-precision cache, which a file does not hold
        return "a KV cache lab run under a quantizing policy cannot be saved as a trace yet; save the reference run"
    if len(source.attention_layers) != source.n_layers:
        # the format keeps every layer's q, K and V; a hybrid's state-space layers have none
        return "traces of hybrid models (layers without attention) are not supported yet"
    return None


def save_trace(source: RunSource, path: str | os.PathLike, derived: bool = False) -> Path:
    """Write everything ``source`` processed to ``path`` (.safetensors); see docs/trace-format.md."""
    from safetensors.numpy import save_file

    path = Path(path)
    if path.suffix != ".safetensors":
        raise InspectorError(f"trace files end in .safetensors, got {path.name}")
    outfile.check_target(path)  # a folder, device or link named here is refused before the tensors are gathered
    refused = save_refusal(source)
    if refused is not None:
        raise InspectorError(refused)
    t, L, policy = source.cache_length, source.n_layers, source.kv_policy
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
            assert bias.ref is not None  # an alibi form carries its reference positions
            tensors[f"layers.{layer}.bias_ref"] = bias.ref[:t].float().numpy()  # (T,)
        elif bias is not None:
            assert bias.rows is not None  # a key form carries its rows
            tensors[f"layers.{layer}.bias_rows"] = bias.rows[:, :t].float().numpy()  # (H, T)
        if derived:
            for kind in ("scores", "masked_scores", "probs"):
                tensors[f"layers.{layer}.{kind}"] = source.attention_rows(layer, 0, t, kind).numpy()  # (H, T, T)
    if policy is not None:  # a KV lab policy run: when each entry was evicted, and the bytes the policy held
        tensors.update(_policy_tensors(policy, L, t))
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
        "sinks": json.dumps([None if (sk := source.sink(layer)) is None else sk.tolist() for layer in range(L)]),
        "score_bias": json.dumps([_bias_meta(source.score_bias(layer)) for layer in range(L)]),
        "unverified": source.unverified or "",
        "shape": json.dumps({**{k: getattr(source, k) for k in SHAPE_FIELDS}, "cache_dtype": source.cache_dtype,
                             **_value_head_dim(source)}),
        # what the model's cache held per layer (a latent, shared layers): kv_cache_bytes as it really was
        **({} if source.kv_layout is None else {"kv_layout": json.dumps(source.kv_layout.to_json())}),
        "finished": source.finished or "",
        **_chat_meta(source),
        "derived": "1" if derived else "0",
        **({} if policy is None else {"kv_policy": json.dumps({"name": policy.describe(), "kind": "eviction"})}),
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


def _policy_tensors(policy, n_layers: int, t: int) -> dict[str, np.ndarray]:
    """A KV lab policy run's cache, read through the policy's public readers: per layer (Hkv, T) int64,
    the cache length after whose forward each entry was evicted (-1: still held), and (L, T + 1) int64,
    the bytes the policy's cache held at each length."""
    out = {"kv_policy.bytes": np.asarray([[policy.cache_bytes(i, n) if n else 0 for n in range(t + 1)]
                                          for i in range(n_layers)], dtype=np.int64)}  # fmt: skip
    for layer in range(n_layers):
        gone = policy.evicted(layer, t)  # (Hkv, T): evicted by the end
        first = torch.full(gone.shape, t)  # (Hkv, T): the first query row an entry was hidden from (t: none)
        for p0 in range(0, t, 256):  # blocks of query rows: (Hkv, 256, T) at most
            rows = policy.evicted_rows(layer, p0, min(p0 + 256, t), t, gone.shape[0])  # (Hkv, n, T) or None
            if rows is not None:
                first = torch.minimum(first, torch.where(rows.any(1), rows.int().argmax(1) + p0, t))
        # an entry evicted after the last forward was hidden from no row: it went at length t
        out[f"layers.{layer}.evicted_at"] = torch.where(first < t, first, torch.where(gone, t, -1)).numpy()
    return out


class _StoredPolicy:
    """A saved KV lab policy run's cache, as its trace recorded it: the evictions replay on every
    row the readers derive (``RunSource.allowed_rows``), and its bytes are the policy's own."""

    kind = "eviction"

    def __init__(self, about: dict, evicted_at: list[torch.Tensor], nbytes: torch.Tensor):
        self.name = about["name"]
        self._ev = [torch.where(ev < 0, NEVER, ev) for ev in evicted_at]  # (Hkv, T) each
        self._bytes = nbytes  # (L, T + 1)

    def describe(self) -> str:
        return self.name

    def evicted_rows(self, layer: int, p0: int, p1: int, length: int, n_heads: int) -> torch.Tensor | None:
        """(H, p1 - p0, length) bool: the entries evicted when query rows p0..p1 ran, or None."""
        ev = self._ev[layer][:, :length]  # (Hkv, length)
        block = ev[:, None, :] <= torch.arange(p0, p1)[None, :, None]  # (Hkv, n, length)
        return expand_kv(block, n_heads) if bool(block.any()) else None

    def evicted(self, layer: int, length: int) -> torch.Tensor:
        """(Hkv, length) bool: the entries the policy's cache no longer held after ``length`` positions."""
        return self._ev[layer][:, :length] <= length

    def cache_bytes(self, layer: int, length: int) -> int:
        return int(self._bytes[layer, length])


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
        for key in SHAPE_FIELDS:  # n_layers, n_heads, ...: validated ints
            setattr(self, key, shape[key])
        self.kv_layout = meta.get("kv_layout")  # a KVLayout (validated), or None: an ordinary per-head cache
        self.cache_dtype: str = (
            shape.get("cache_dtype", "float32") if shape.get("cache_dtype") in ITEMSIZE else "float32"
        )
        self.model_name: str = meta["model"]
        self.prompt: str = meta["prompt"]
        self.seed: int = meta["seed"]
        self.text: str = meta["text"]
        self.tokens: list[int] = tensors["tokens"].tolist()
        self.prompt_ids: list[int] = self.tokens[: meta["prompt_length"]]
        chat = meta.get("chat")  # the turns the prompt was built from, with each prompt token's role
        self.chat = None if chat is None else dataclasses.replace(chat, ids=tuple(self.prompt_ids))
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
        self.steps_done: list[Step] = [self._step(i, s) for i, s in enumerate(meta["steps"])]
        if meta.get("kv_policy") is not None:  # a KV lab policy run: its evictions replay on every reader
            self.kv_policy = _StoredPolicy(meta["kv_policy"], [tensors[f"layers.{i}.evicted_at"]
                                           for i in range(self.n_layers)], tensors["kv_policy.bytes"])  # fmt: skip

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
        return ITEMSIZE[self.cache_dtype]

    @property
    def step_logits(self) -> np.ndarray:
        return self._t["step_logits"].numpy()


def _chat_meta(source) -> dict:
    chat = getattr(source, "chat", None)
    if chat is None:
        return {}
    return {"chat": json.dumps({**chat.to_json(), "roles": list(chat.roles)})}


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
            meta, expect = validate_header(name, header, raw_meta, v1=fmt == FORMAT_V1)
            check_plausible_size(name, path, header, expect, v1=fmt == FORMAT_V1)
            # only what the format needs is read; v1's stored matrices are derived again instead
            tensors = {k: f.get_tensor(k) for k in expect}
            if fmt == FORMAT_V1:
                _v1_mask_rows(tensors, f, meta)
    except InspectorError:
        raise
    except Exception as e:  # safetensors raises several types for truncated or garbled files
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InspectorError(f"{name} is not a readable trace file: {first}") from None
    validate_values(name, tensors, meta)
    return Trace(path, tensors, meta)


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
