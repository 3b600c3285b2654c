"""The wire format between ``gpt-inspector serve`` and its client, and the checks on every message.

A request is one text frame: a JSON object ``{"op": str, "id": int, "args": {...}}``. A reply is one
text frame ``{"id": int, "ok": bool, "result" | "error": ..., "tensors": [{"dtype", "shape"}, ...]}``
followed by one binary frame per tensor: its raw little-endian bytes, C order. A long job
(``JOB_OPS``) sends progress notes ``{"id", "progress": [what, done, total]}`` before its reply, and
reads a ``cancel`` request sent meanwhile (answered at once, before or after the job's reply). Nothing is pickled,
and nothing in a message is used before ``check_request`` (or ``check_reply`` on the client) has
checked its size, its types and its ranges against ``OPS``.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import numpy as np
import torch

from ..core.errors import InspectorError
from ..core.kvlab.registry import NAMES as POLICIES  # names only: the registry imports no torch

# a request is a short JSON header; the biggest legitimate one is a head edit's patch source
# (one token id per position) or a long prompt, well under this
BAD_TOKEN = "a valid token is required: use the whole URL that gpt-inspector serve printed"  # the refusal's words
MAX_REQUEST_BYTES = 1 << 20
# a reply's header (token lists, labels, a recipe); its tensors are counted separately
MAX_HEADER_BYTES = 64 << 20
MAX_TENSOR_BYTES = 4 << 30
MAX_TENSORS = 64  # a step's reply carries the reads a window repaints after it (``then``)
MAX_DIMS = 4
MAX_ID = (1 << 53) - 1  # exact in a JSON number read as a double
MAX_INT = 1 << 31
MAX_TEXT = 1 << 18  # characters in a prompt
MAX_LIST = 1 << 17  # entries in an edit list or a patch source
KINDS = ("raw", "scores", "masked_scores", "probs")

# wire name -> (torch dtype, numpy little-endian view of its bytes)
DTYPES = {
    "float32": (torch.float32, "<f4"),
    "float64": (torch.float64, "<f8"),
    "float16": (torch.float16, "<f2"),
    "bfloat16": (torch.bfloat16, "<i2"),  # numpy has no bfloat16: its 16 bits travel as an int16
    "int64": (torch.int64, "<i8"),
    "bool": (torch.bool, "|b1"),
    "uint8": (torch.uint8, "|u1"),  # a trace file's bytes
}
_WIRE_NAME = {t: name for name, (t, _) in DTYPES.items()}


class WireError(InspectorError):
    """A message that breaks the protocol: refused in one line, the connection goes on.

    ``rid``: the request's id where it could be read, so the refusal answers that request."""

    rid: int | None = None


# ---------------------------------------------------------------------- argument schema
class Arg:
    """One argument: its type, whether it may be absent or null, and its bounds."""

    def __init__(self, kind: str, required: bool = True, nullable: bool = False, lo=None, hi=None, n: Any = 0):
        self.kind, self.required, self.nullable, self.lo, self.hi, self.n = kind, required, nullable, lo, hi, n

    def check(self, name: str, v):
        if v is None:
            if self.nullable:
                return None
            raise WireError(f"argument {name!r} must not be null")
        kind = self.kind
        if kind == "int":
            if isinstance(v, bool) or not isinstance(v, int):
                raise WireError(f"argument {name!r} must be an integer, got {type(v).__name__}")
            lo = -MAX_INT if self.lo is None else self.lo
            hi = MAX_INT if self.hi is None else self.hi
            if not lo <= v <= hi:
                raise WireError(f"argument {name!r} must lie in [{lo}, {hi}], got {v}")
            return v
        if kind == "float":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise WireError(f"argument {name!r} must be a finite number")
            if (self.lo is not None and v < self.lo) or (self.hi is not None and v > self.hi):
                raise WireError(f"argument {name!r} must lie in [{self.lo}, {self.hi}], got {v}")
            return float(v)
        if kind == "bool":
            if not isinstance(v, bool):
                raise WireError(f"argument {name!r} must be true or false")
            return v
        if kind == "str":
            if not isinstance(v, str) or len(v) > self.n:
                raise WireError(f"argument {name!r} must be a string of at most {self.n} characters")
            return v
        if kind == "choice":
            if v not in self.n:
                raise WireError(f"argument {name!r} must be one of {', '.join(self.n)}")
            return v
        if kind == "floats":
            if not isinstance(v, list) or len(v) > self.n:
                raise WireError(f"argument {name!r} must be a list of at most {self.n} numbers")
            item = Arg("float", lo=self.lo, hi=self.hi)
            return [item.check(f"{name}[]", x) for x in v]
        if kind == "ints":
            if not isinstance(v, list) or len(v) > self.n:
                raise WireError(f"argument {name!r} must be a list of at most {self.n} integers")
            item = Arg("int", lo=self.lo, hi=self.hi)
            return [item.check(f"{name}[]", x) for x in v]
        if kind == "object":  # an object of optional fields, each checked by its own Arg (``n``: the schema)
            if not self.n:  # checked by the caller against a schema of its own
                if not isinstance(v, dict):
                    raise WireError(f"argument {name!r} must be an object")
                return v
            return _check_obj(f"argument {name!r}", v, self.n)
        if kind == "int_lists":
            if not isinstance(v, list) or len(v) > MAX_LIST:
                raise WireError(f"argument {name!r} must be a list of at most {MAX_LIST} lists of integers")
            return [Arg("ints", lo=0, hi=MAX_INT, n=MAX_LIST).check(f"{name}[]", x) for x in v]
        if kind == "calls":  # reads run after a step, in its reply: each one checked as a request of its own
            if not isinstance(v, list) or len(v) > MAX_THEN:
                raise WireError(f"argument {name!r} must be a list of at most {MAX_THEN} reads")
            out = []
            for call in v:
                c = _check_obj(f"{name}[]", call, {"op": Arg("choice", n=THEN_OPS), "args": Arg("object", n={})})
                # a read after a step reads the run that stepped: no selector of its own
                own = {k: a for k, a in OPS[c["op"]].items() if k not in RUN_SELECTORS}
                out.append({"op": c["op"], "args": _check_obj(f"{name}[] {c['op']!r}", call["args"], own)})
            return out
        if kind == "messages":  # a chat's turns (core.chat checks the text itself on the engine)
            if not isinstance(v, list) or not 0 < len(v) <= self.n:
                raise WireError(f"argument {name!r} must be a list of 1 to {self.n} turns")
            return [_check_obj(f"{name}[]", m, MESSAGE) for m in v]
        if kind in ("mask_edits", "head_edits"):
            if not isinstance(v, list) or len(v) > MAX_LIST:
                raise WireError(f"argument {name!r} must be a list of at most {MAX_LIST} edits")
            return [_check_obj(f"{name}[]", x, MASK_EDIT if kind == "mask_edits" else HEAD_EDIT) for x in v]
        raise AssertionError(kind)


def _check_obj(what: str, obj, schema: dict[str, Arg]) -> dict:
    if not isinstance(obj, dict):
        raise WireError(f"{what} must be an object")
    unknown = [k for k in obj if k not in schema]
    if unknown:
        raise WireError(f"{what}: unknown argument {str(unknown[0])[:40]!r}")
    out = {}
    for name, arg in schema.items():
        if name in obj:
            out[name] = arg.check(name, obj[name])
        elif arg.required:
            raise WireError(f"{what}: missing argument {name!r}")
    return out


_POS = dict(lo=0, hi=MAX_INT)
LAYER = Arg("int", lo=0, hi=4096)
HEAD = Arg("int", lo=0, hi=4096)
HEADS = Arg("ints", required=False, nullable=True, lo=0, hi=4096, n=4096)
ROWS = {"p0": Arg("int", **_POS), "p1": Arg("int", **_POS)}
MASK_EDIT = {"query": Arg("int", **_POS), "key": Arg("int", **_POS), "layer": Arg("int", False, True, 0, 4096),
             "head": Arg("int", False, True, 0, 4096), "blocked": Arg("bool", False)}  # fmt: skip
HEAD_EDIT = {"layer": Arg("int", lo=0, hi=4096), "head": Arg("int", False, True, 0, 4096),
             "patch_from": Arg("ints", False, True, 0, MAX_INT, MAX_LIST)}  # fmt: skip
DECODING = {"temperature": Arg("float", False, False, 0.0, 1e6), "top_k": Arg("int", False, True, 1, MAX_INT),
            "top_p": Arg("float", False, True, 0.0, 1.0)}  # fmt: skip

MESSAGE = {"role": Arg("str", n=MAX_TEXT), "content": Arg("str", n=MAX_TEXT)}
CHAT = {"messages": Arg("messages", n=1024), "add_generation_prompt": Arg("bool", False)}
_COUNT = Arg("int", False, True, 1, MAX_INT)

_P = dict(lo=0.0, hi=1.0)
_N = dict(lo=0, hi=MAX_INT)
# generate's other sampler settings (core.decoding.Decoding's names); the server's Decoding checks the rest
SETTINGS = {"min_p": Arg("float", False, True, **_P), "typical_p": Arg("float", False, True, **_P),
            "epsilon_cutoff": Arg("float", False, True, **_P), "eta_cutoff": Arg("float", False, True, **_P),
            "repetition_penalty": Arg("float", False, True, 0.0, 1e6),
            "no_repeat_ngram_size": Arg("int", False, True, **_N),
            "suppress_tokens": Arg("ints", False, True, n=MAX_LIST, **_N),
            "bad_words_ids": Arg("int_lists", False, True), "min_new_tokens": Arg("int", False, True, **_N),
            "forced_eos_token_id": Arg("int", False, True, **_N), "max_new_tokens": Arg("int", False, True, **_N)}  # fmt: skip
_SETTINGS = Arg("object", False, True, n=SETTINGS)
_KIND = Arg("choice", n=KINDS)
# the reads a step's reply may carry (``then``): what a window repaints after a step, one round trip in all
THEN_OPS = ("overview_bins", "attention_rows", "allowed_rows", "qkv_rows", "bias_rows", "pooled_rows",
            "attention_block", "policy_rows")  # fmt: skip
MAX_THEN = 12
_KEYS = Arg("int", False, True, 0, MAX_INT)

# the KV cache lab and compare, run on the engine (remote/labs.py): long jobs (JOB_OPS) send progress
# notes before their reply and stop at a "cancel" request sent meanwhile
_LAB = Arg("int", lo=0, hi=MAX_ID)
_OPT = Arg("int", False, True, 0, MAX_INT)
LAB_OPTIONS = {"sinks": _OPT, "recent": _OPT, "window": _OPT, "group": _OPT, "residual": _OPT, "page": _OPT,
               "scheme": Arg("choice", False, True, n=("kivi", "transformers")), "schedule": Arg("str", False, True, n=32),
               "share": Arg("choice", False, True, n=("head", "layer")), "layer_budgets": Arg("int_lists", False, True)}  # fmt: skip
LAB_OPS: dict[str, dict[str, Arg]] = {
    "cancel": {},  # answered at once (whether a job was running); the job's own reply says where it stopped
    "kvlab_run": {
        "policy": Arg("choice", n=POLICIES),
        "budget": Arg("int", False, True, 0, MAX_INT),
        "steps": Arg("int", lo=0, hi=1 << 16),
        "free_running": Arg("bool", False),
        "options": Arg("object", False, True, n=LAB_OPTIONS),
    },  # fmt: skip
    "kvlab_step": {"lab": _LAB},
    "kvlab_back": {"lab": _LAB},
    "kvlab_probe": {"lab": _LAB},
    "kvlab_rows": {"lab": _LAB},
    "compare": {
        "max_new_tokens": Arg("int", False, True, 1, MAX_INT),
        "max_length": Arg("int", False, True, 1, MAX_INT),
        "num_beams": Arg("int", False, lo=1, hi=64),
        "num_return_sequences": Arg("int", False, lo=1, hi=64),
        "length_penalty": Arg("float", False, lo=-1e6, hi=1e6),
        "early_stopping": Arg("choice", False, n=("false", "true", "never")),
        "samples": Arg("int", False, lo=0, hi=1024),
        "temperatures": Arg("floats", False, True, 0.0, 1e6, 64),
        "temperature": Arg("float", False, lo=0.0, hi=1e6),
        "top_k": Arg("int", False, True, 1, MAX_INT),
        "top_p": Arg("float", False, True, 0.0, 1.0),
        "seed": Arg("int", False, lo=0, hi=(1 << 63) - 1),
        "sampler": _SETTINGS,
        "prompt_lookup_num_tokens": Arg("int", False, True, 1, 1 << 16),
        "assistant": Arg("str", False, True, n=4096),  # a draft model's folder on the engine's machine
        "num_assistant_tokens": Arg("int", False, True, 1, MAX_INT),
        "assistant_confidence_threshold": Arg("float", False, True, 0.0, 1.0),
    },  # fmt: skip
}
JOB_OPS = ("kvlab_run", "kvlab_probe", "compare")
MAX_NOTE_BYTES = 1024

# every operation the server knows, with its arguments; anything else is refused
OPS: dict[str, dict[str, Arg]] = {
    "hello": {},
    "state": {},
    "open": {
        "prompt": Arg("str", n=MAX_TEXT),
        "seed": Arg("int", False, lo=0, hi=(1 << 63) - 1),
        **DECODING,
        "settings": _SETTINGS,
        "chat": Arg("object", False, True, n=CHAT),  # a chat prompt instead: the engine applies its template
    },
    "step": {"then": Arg("calls", False, True)},
    "run": {"n": Arg("int", lo=0, hi=1 << 20)},
    "step_back": {},
    "restart": {},
    "force_token": {"token_id": Arg("int", lo=0, hi=MAX_INT)},
    "set_decoding": {**DECODING, "redecide": Arg("bool", False), "settings": _SETTINGS},
    "set_mask_edits": {"edits": Arg("mask_edits")},
    "set_head_edits": {"edits": Arg("head_edits")},
    "queries": {"layer": LAYER, **ROWS, "heads": HEADS},
    "keys": {"layer": LAYER, **ROWS, "heads": HEADS},
    "values": {"layer": LAYER, **ROWS, "heads": HEADS},
    "attention_rows": {
        "layer": LAYER,
        **ROWS,
        "kind": Arg("choice", False, n=KINDS),
        "heads": HEADS,
        "keys": Arg("int", False, True, 0, MAX_INT),
    },
    "layers_attention_rows": {
        "layers": Arg("ints", lo=0, hi=4096, n=4096),
        **ROWS,
        "kind": Arg("choice", False, n=KINDS),
        "heads": HEADS,
        "keys": Arg("int", False, True, 0, MAX_INT),
    },
    "attention": {"layer": LAYER, "head": HEAD, "kind": Arg("choice", False, n=KINDS)},
    "distribution": {"index": Arg("int", lo=0, hi=MAX_INT)},
    "top": {"index": Arg("int", lo=0, hi=MAX_INT), "n": Arg("int", False, lo=1, hi=1000)},
    "labels": {"ids": Arg("ints", lo=0, hi=MAX_INT, n=MAX_LIST)},
    "recipe": {},
    "kv_cache_bytes": {"layer": Arg("int", False, True, 0, 4096)},
    # what a window shows (remote/reads.py): view-sized reads, and the few commands only it sends
    "layers": {},
    "qkv_rows": {"layer": LAYER, **ROWS},
    "allowed_rows": {"layer": LAYER, **ROWS, "keys": _KEYS, "heads": HEADS},
    "bias_rows": {"layer": LAYER, **ROWS, "heads": HEADS},
    "overview_bins": {**ROWS, "size": Arg("int", lo=1, hi=MAX_INT)},
    "pooled_rows": {
        "layer": LAYER,
        "head": HEAD,
        "kind": _KIND,
        **ROWS,
        "keys": Arg("int", **_POS),
        "block": Arg("int", lo=1, hi=1 << 20),
    },  # fmt: skip
    "attention_block": {
        "layer": LAYER,
        "head": HEAD,
        "kind": _KIND,
        **ROWS,
        "k0": Arg("int", **_POS),
        "k1": Arg("int", **_POS),
        "every": Arg("bool", False),
        "block": Arg("int", False, lo=1, hi=1 << 20),
    },  # fmt: skip
    "kv_history": {"lengths": Arg("ints", lo=0, hi=MAX_INT, n=MAX_LIST)},
    "patch_edit": {"layer": LAYER, "head": HEAD, "prompt": Arg("str", n=MAX_TEXT)},
    "trace": {"derived": Arg("bool", False)},
    "head_outputs": {"layer": LAYER},
    "text": {},
    "probe": {
        "layers": Arg("ints", lo=0, hi=4096, n=4096),
        "context": Arg("choice", False, n=("auto", "cache", "greedy")),
        "tolerance": Arg("float", False, True, 0.0, 1e6),
    },  # fmt: skip
    "lens": {"top_k": Arg("int", False, lo=1, hi=1000)},
    "math_check": {
        "layer": LAYER,
        "head": HEAD,
        "position": Arg("int", False, True, **_N),
        "tolerance": Arg("float", False, True, 0.0, 1e6),
    },  # fmt: skip
    "math_check_all": {
        "layers": Arg("ints", False, True, lo=0, hi=4096, n=4096),
        "tolerance": Arg("float", False, True, 0.0, 1e6),
    },  # fmt: skip
    **LAB_OPS,
    # chat prompts, assisted decoding and a rebuilt session (remote/session_ops.py)
    "chat_build": CHAT,
    "assisted_start": {
        "assistant": Arg("str", False, True, n=4096),
        "prompt_lookup_num_tokens": _COUNT,
        "max_matching_ngram_size": _COUNT,
        "num_assistant_tokens": _COUNT,
        "assistant_confidence_threshold": Arg("float", False, True, 0.0, 1.0),
        "max_new_tokens": _COUNT,
    },  # fmt: skip
    "assisted_round": {"rounds": Arg("int", False, True, 1, 1 << 20)},
    "assisted_back": {},
    "replay": {"recipe": Arg("object")},  # core.recipe_check checks it whole on the engine
}


# runs the engine keeps beside its session, each named by a selector on the ops that may read (or step) it
# instead of the session (remote/labs.py ``run_view``): the reads every run answers
BEAM_OPS = ("state", "queries", "keys", "values", "attention_rows", "layers_attention_rows", "attention", "distribution",
            "top", "labels", "kv_cache_bytes", "layers", "qkv_rows", "allowed_rows", "bias_rows", "overview_bins",
            "pooled_rows", "attention_block", "kv_history", "head_outputs", "text", "trace", "math_check", "math_check_all")  # fmt: skip
# the KV lab's policy run is a Session: the window steps it as it steps one locally (a step past the lab's
# last ends the lab's Step, a step back undoes lab steps), the lab panel's Run and Compare start from it,
# and its edits are refused there in the engine's words
POLICY_RUN_OPS = (*BEAM_OPS, "policy_rows", "step", "run", "step_back", "restart", "force_token", "set_decoding",
                  "set_mask_edits", "set_head_edits", "patch_edit", "recipe", "kvlab_run", "compare")  # fmt: skip
OPS["policy_rows"] = {"layer": LAYER}  # what the KV cache view marks: evicted rows, a quantized row's error
# selector -> (its schema, the ops that take it): ``beam`` = [comparison, beam], ``policy_run`` = the lab's number
RUN_SELECTORS = {"beam": (Arg("ints", False, lo=0, hi=MAX_ID, n=2), BEAM_OPS),
                 "policy_run": (Arg("int", False, lo=0, hi=MAX_ID), POLICY_RUN_OPS)}  # fmt: skip
for _name, (_arg, _ops) in RUN_SELECTORS.items():
    for _op in _ops:
        OPS[_op] = {**OPS[_op], _name: _arg}


def check_request(data) -> tuple[str, int, dict]:
    """(op, id, args) of one request frame, every field checked; ``WireError`` in one line otherwise."""
    if not isinstance(data, str):
        raise WireError("requests are JSON text frames, not binary")
    if len(data) > MAX_REQUEST_BYTES:  # characters: at most 4 bytes each, so the frame limit bounds this too
        raise WireError(f"request of {len(data)} characters; the limit is {MAX_REQUEST_BYTES}")
    try:
        obj = json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise WireError(f"request is not JSON: {str(e).splitlines()[0][:80]}") from None
    if not isinstance(obj, dict) or set(obj) != {"op", "id", "args"}:
        raise WireError('a request is an object with exactly "op", "id" and "args"')
    rid = obj["id"]
    if isinstance(rid, bool) or not isinstance(rid, int) or not 0 <= rid <= MAX_ID:
        raise WireError(f'"id" must be an integer in [0, {MAX_ID}]')
    try:
        op = obj["op"]
        if not isinstance(op, str) or op not in OPS:
            raise WireError(f"unknown op {str(op)[:40]!r}")
        return op, rid, _check_obj(f"op {op!r}", obj["args"], OPS[op])
    except WireError as e:
        e.rid = rid
        raise


def _no_constant(name):  # NaN and Infinity are not JSON, and no argument takes them
    raise ValueError(f"{name} is not a number JSON allows")


def request(op: str, rid: int, args: dict) -> str:
    return json.dumps({"op": op, "id": rid, "args": args}, allow_nan=False)


# ---------------------------------------------------------------------- replies and tensors
def tensor_bytes(t: torch.Tensor) -> tuple[dict, bytes]:
    """(its header entry, its raw little-endian C-order bytes)."""
    t = t.detach().to("cpu").contiguous()
    name = _WIRE_NAME.get(t.dtype)
    if name is None:
        raise InspectorError(f"no wire format for dtype {t.dtype}")
    src = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    arr = src.numpy()
    if sys.byteorder != "little":
        arr = arr.astype(np.dtype(DTYPES[name][1]))
    return {"dtype": name, "shape": list(t.shape)}, arr.tobytes()


def reply(rid: int, result=None, tensors=(), error: str | None = None) -> tuple[str, list[bytes]]:
    """A reply header and its binary frames."""
    metas, frames = [], []
    for t in tensors:
        meta, raw = tensor_bytes(t)
        metas.append(meta)
        frames.append(raw)
    head = {"id": rid, "ok": error is None, "tensors": metas}
    if error is None:
        head["result"] = result
    else:
        head["error"] = error
    # a reply may carry -inf (a logit a model masks out of its vocabulary): JSON's NaN/Infinity words,
    # which Python's reader takes; requests stay strict
    return json.dumps(head), frames


def note(rid: int, what: str, done: int, total: int) -> str:
    """A long job's progress note, sent before its reply: ``{"id", "progress": [what, done, total]}``."""
    return json.dumps({"id": rid, "progress": [str(what)[:64], int(done), int(total)]})


def check_note(data, expected_id: int) -> tuple[str, int, int] | None:
    """(what, done, total) of a progress note for request ``expected_id``; None where ``data`` is not a note."""
    if not isinstance(data, str) or len(data) > MAX_NOTE_BYTES or '"progress"' not in data:
        return None
    try:
        head = json.loads(data)
    except ValueError:
        return None
    if not isinstance(head, dict) or set(head) != {"id", "progress"}:
        return None
    p = head["progress"]
    if head["id"] != expected_id or not isinstance(p, list) or len(p) != 3 or not isinstance(p[0], str):
        raise WireError("the engine sent a malformed progress note")
    if any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_INT for x in p[1:]):
        raise WireError("the engine sent a malformed progress note")
    return p[0], p[1], p[2]


def tensor_meta(meta) -> tuple[str, tuple[int, ...], int]:
    """(dtype name, shape, byte count) of a reply's tensor entry, checked."""
    if not isinstance(meta, dict) or set(meta) != {"dtype", "shape"}:
        raise WireError("a tensor entry is an object with exactly dtype and shape")
    dtype, shape = meta["dtype"], meta["shape"]
    if dtype not in DTYPES:
        raise WireError(f"unknown tensor dtype {str(dtype)[:20]!r}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise WireError(f"a tensor shape is a list of at most {MAX_DIMS} sizes")
    if any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TENSOR_BYTES for n in shape):
        raise WireError("tensor sizes must be non-negative integers")
    nbytes = math.prod(shape) * np.dtype(DTYPES[dtype][1]).itemsize
    if nbytes > MAX_TENSOR_BYTES:
        raise WireError(f"a tensor of {nbytes} bytes; the limit is {MAX_TENSOR_BYTES}")
    return dtype, tuple(shape), nbytes


def check_reply(data, expected_id: int) -> tuple[dict, list[tuple[str, tuple[int, ...], int]]]:
    """The reply header and its tensors' (dtype, shape, bytes), checked before any frame is read."""
    if not isinstance(data, str) or len(data) > MAX_HEADER_BYTES:
        raise WireError("the engine sent something that is not a reply header")
    try:
        head = json.loads(data)
    except ValueError:
        raise WireError("the engine sent a reply that is not JSON") from None
    if not isinstance(head, dict) or not isinstance(head.get("ok"), bool) or not isinstance(head.get("tensors"), list):
        raise WireError("the engine sent a malformed reply header")
    if head.get("id") != expected_id:
        raise WireError(f"reply to request {head.get('id')!r}, expected {expected_id}")
    if len(head["tensors"]) > MAX_TENSORS:
        raise WireError(f"a reply with {len(head['tensors'])} tensors; the limit is {MAX_TENSORS}")
    return head, [tensor_meta(m) for m in head["tensors"]]


def tensor_from(frame, dtype: str, shape: tuple[int, ...], nbytes: int) -> torch.Tensor:
    """The tensor a binary frame carries, once its byte count matches the header's dtype and shape."""
    if not isinstance(frame, (bytes, bytearray)):
        raise WireError("expected a binary tensor frame")
    if len(frame) != nbytes:
        raise WireError(f"a tensor frame of {len(frame)} bytes; its header says {nbytes}")
    torch_dtype, np_dtype = DTYPES[dtype]
    arr = np.frombuffer(frame, dtype=np.dtype(np_dtype)).astype(np.dtype(np_dtype).newbyteorder("="), copy=True)
    t = torch.from_numpy(arr).reshape(shape)
    return t.view(torch.bfloat16) if torch_dtype == torch.bfloat16 else t


def quiet_logger():
    """websockets' logger, silenced: a failed handshake or a lost link is
    reported once, by us, in one line, not as a traceback."""
    import logging

    log = logging.getLogger("gpt_inspector.remote.websockets")
    log.setLevel(logging.CRITICAL + 1)
    log.propagate = False
    return log
