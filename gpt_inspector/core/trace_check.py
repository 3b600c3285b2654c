"""A trace file checked before anything in it is used: every name, dtype and shape in its header
against its metadata, every metadata value's type and range, and the tensors' values.

``core.trace`` reads a file only through these checks; a corrupt or foreign file raises
``InspectorError`` with one line and nothing else.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from .chat import Chat, check_messages
from .edits import HeadEdit, MaskEdit
from .errors import InspectorError
from .kv_layout import KVLayout

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
MAX_JSON = 64 << 20  # bytes of one metadata value; larger is not a trace we wrote
# Ceilings on what a trace may claim, far above any model we know and far below what freezes the
# window: views, exports and checks loop over heads and draw labels, so a 66 KB file with 4,096 heads or
# a 60 MB label cost minutes of work before a refusal could come.
MAX_HEADS = 512  # query heads per layer: Falcon-180B's 232 is the most of any released model
MAX_LABEL = 1024  # characters in one token's label: the longest tokens of real vocabularies are a few hundred
MAX_NAME = 4096  # characters in the model's name: a hub id or a path, and PATH_MAX is 4096
SHAPE_FIELDS = ("n_layers", "n_heads", "n_kv_heads", "head_dim", "context_length", "vocab_size")  # ints >= 1

_SPARSE_CHECK_FROM = (
    64 << 20
)  # below this a trace is too small to hurt, and compressed filesystems may report few blocks
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "BOOL": 1}


def check_plausible_size(name: str, path: Path, header: dict, expect: dict, v1: bool) -> None:
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


def _json(name: str, meta: dict, key: str, typ):
    raw = meta.get(key)
    if raw is None:
        raise InspectorError(f"{name}: metadata {key!r} is missing")
    if len(raw) > MAX_JSON:
        raise InspectorError(f"{name}: metadata {key!r} is implausibly large")
    try:
        val = json.loads(raw)
    except (TypeError, ValueError, RecursionError):
        raise InspectorError(f"{name}: metadata {key!r} is not valid JSON") from None
    if not isinstance(val, typ):
        raise InspectorError(f"{name}: metadata {key!r} has the wrong type")
    return val


def _chat(name: str, c: dict, prompt: str, prompt_length: int) -> Chat:
    roles, gen = c.get("roles"), c.get("add_generation_prompt")
    if not isinstance(gen, bool) or not isinstance(roles, list) or len(roles) != prompt_length:
        raise InspectorError(f"{name}: metadata 'chat' is malformed")
    if not all(isinstance(r, str) and len(r) <= 64 for r in roles):
        raise InspectorError(f"{name}: metadata 'chat' has a role that is not short text")
    try:
        msgs = check_messages(c.get("messages"))
    except InspectorError as e:
        raise InspectorError(f"{name}: metadata 'chat': {e}") from None
    # the ids are the trace's prompt tokens, which the tensors check: not repeated here
    return Chat(tuple((m["role"], m["content"]) for m in msgs), gen, prompt, (), tuple(roles))


def _int(name: str, meta: dict, key: str) -> int:
    try:
        return int(meta[key])
    except (KeyError, ValueError, TypeError):
        raise InspectorError(f"{name}: metadata {key!r} is missing or not an integer") from None


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def validate_header(name: str, header: dict, meta: dict, v1: bool) -> tuple[dict, dict]:
    """Check the metadata and every tensor's name, dtype and shape, reading no tensor data.

    Returns the parsed metadata and the tensors to read, name -> (shape, dtype).
    """
    out: dict = {"format": meta.get("format")}
    for key in ("model", "prompt", "text"):
        if not isinstance(meta.get(key), str):
            raise InspectorError(f"{name}: metadata {key!r} is missing")
        out[key] = meta[key]
    if len(out["model"]) > MAX_NAME:
        raise InspectorError(f"{name}: the model's name is {len(out['model']):,} characters; at most {MAX_NAME:,}")
    out["finished"] = meta.get("finished", "")
    out["seed"] = _int(name, meta, "seed")
    out["prompt_length"] = _int(name, meta, "prompt_length")
    shape = _json(name, meta, "shape", dict)
    for key in SHAPE_FIELDS:
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
    out["chat"] = None
    if "chat" in meta:
        out["chat"] = _chat(name, _json(name, meta, "chat", dict), out["prompt"], out["prompt_length"])
    if H > MAX_HEADS:
        raise InspectorError(f"{name}: {H:,} heads per layer; a trace holds at most {MAX_HEADS}")
    if L > 4096 or d > 65536 or V > 1 << 24:
        raise InspectorError(f"{name}: implausible shape {shape}")
    out["shape"] = shape
    out["kv_policy"] = None  # a KV lab policy run: its name; its evictions are tensors
    if "kv_policy" in meta:
        about = _json(name, meta, "kv_policy", dict)
        if not isinstance(about.get("name"), str) or len(about["name"]) > MAX_NAME or about.get("kind") != "eviction":
            raise InspectorError(f"{name}: metadata 'kv_policy' is malformed")
        out["kv_policy"] = {"name": about["name"]}
    out["decoding"] = _json(name, meta, "decoding", dict)
    out["sampler"] = _json(name, meta, "sampler", dict) if "sampler" in meta else None  # older files: none
    for key, cls, what in (("mask_edits", MaskEdit, "mask edit"), ("head_edits", HeadEdit, "head edit")):
        raw = _json(name, meta, key, list) if key in meta or key == "mask_edits" else []  # older files: no head edits
        edits = [cls.from_json(x) if isinstance(x, dict) else _bad(name, key) for x in raw]
        for ed in edits:  # a mask edit's layer may be None (every layer), a head edit's never is
            if (ed.layer is not None and not 0 <= ed.layer < L) or (ed.head is not None and not 0 <= ed.head < H):
                raise InspectorError(f"{name}: {what} {ed.to_json()} is outside the model's layers or heads")
            # positions and token ids become tensor indices: a huge one overflowed in torch, not here
            if isinstance(ed, MaskEdit) and not 0 <= ed.key <= ed.query < shape["context_length"]:
                raise InspectorError(f"{name}: mask edit at ({ed.query}, {ed.key}) is outside the model's context")
            if isinstance(ed, HeadEdit) and ed.patch_from is not None and not all(0 <= t < V for t in ed.patch_from):
                raise InspectorError(f"{name}: a head edit patches from token ids outside the vocabulary")
        out[key] = [ed.to_json() for ed in edits]
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
    longest = max(map(len, labels))
    if longest > MAX_LABEL:
        raise InspectorError(f"{name}: a token label is {longest:,} characters; at most {MAX_LABEL:,}")
    for key in ("prompt", "text"):  # made of the labels: no longer than they are together
        if len(out[key]) > MAX_LABEL * n_tok:
            raise InspectorError(f"{name}: metadata {key!r} is {len(out[key]):,} characters for {n_tok} tokens")

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
            n_rows = rows[0][0] if len(rows[0]) == 1 else -1
            if n_rows < 0 or n_rows > T:
                raise InspectorError(f"{name}: tensor 'layers.{layer}.mask_positions' has shape {rows[0]}")
            need[f"layers.{layer}.mask_positions"] = ((n_rows,), "I64")
            per_head = len(header.get(f"layers.{layer}.mask_rows", ((),))[0]) == 3
            need[f"layers.{layer}.mask_rows"] = ((n_rows, H, T) if per_head else (n_rows, T), "BOOL")
        bias = biases[layer] if not v1 else None
        if bias is not None and bias["form"] == "alibi":
            need[f"layers.{layer}.bias_ref"] = ((T,), "F32")
        elif bias is not None:
            need[f"layers.{layer}.bias_rows"] = ((H, T), "F32")
    if n_steps or v1:
        need["step_logits"] = ((n_steps, V), "F32")
    if out["kv_policy"] is not None:
        need["kv_policy.bytes"] = ((L, T + 1), "I64")
        need.update({f"layers.{layer}.evicted_at": ((Hkv, T), "I64") for layer in range(L)})
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
        and 0 <= e[0] < V and isinstance(e[1], str) and len(e[1]) <= MAX_LABEL
        for e in top
    )  # fmt: skip


def _bad(name: str, key: str):
    raise InspectorError(f"{name}: metadata {key!r} is malformed")


def validate_values(name: str, t: dict[str, torch.Tensor], meta: dict) -> None:
    V = meta["shape"]["vocab_size"]
    if "kv_policy.bytes" in t and bool((t["kv_policy.bytes"] < 0).any()):
        raise InspectorError(f"{name}: the policy's cache bytes are negative")
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
        ev = t.get(f"layers.{layer}.evicted_at")  # -1 (held) or the cache length after which it went
        if ev is not None and bool(((ev < -1) | (ev == 0) | (ev > T)).any()):
            raise InspectorError(f"{name}: layer {layer} has evictions outside [1, {T}]")
        rows = t.get(f"layers.{layer}.mask_rows")
        if rows is not None and len(rows) and not bool(rows.any(dim=-1).all()):
            raise InspectorError(f"{name}: layer {layer} has a mask row that allows no key")
