"""Hostile and malformed messages: each is refused in one line and the server keeps serving.

The server side is fuzzed over a real connection (random bytes, random text, JSON of the wrong shape
and types, unknown ops, huge numbers and lengths, deep nesting, a frame over the size limit); the
client side's reply parsing is fuzzed directly (truncated tensors, lying shapes and dtypes).
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from gpt_inspector.remote import wire

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=12,
)
arg_names = sorted({name for schema in wire.OPS.values() for name in schema})
requests = st.fixed_dictionaries(
    {
        "op": st.sampled_from(sorted(wire.OPS)) | st.text(max_size=20),
        "id": st.integers(min_value=0, max_value=2**40) | json_values,
        "args": st.dictionaries(st.sampled_from(arg_names) | st.text(max_size=10), json_values, max_size=6)
        | json_values,
    }
)


def _ws(url):
    """A raw connection; the last test's client may hold the slot for a moment after its close."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return connect(url, compression=None, proxy=None, max_size=None, open_timeout=30)
        except InvalidStatus as e:
            if e.response.status_code != 409 or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _answer(ws) -> dict:
    """One reply: its header, its tensor frames read and checked against it."""
    head = json.loads(ws.recv(timeout=60))
    assert set(head) >= {"id", "ok", "tensors"}
    for meta in head["tensors"]:
        dtype, shape, nbytes = wire.tensor_meta(meta)
        wire.tensor_from(ws.recv(timeout=60), dtype, shape, nbytes)
    if not head["ok"]:
        err = head["error"]
        assert isinstance(err, str) and err and "\n" not in err and len(err) < 500
        assert not err.startswith("internal error"), err  # a refusal, never a bug of ours
    return head


def _still_serving(ws):
    ws.send(wire.request("hello", 7, {}))
    head = _answer(ws)
    assert head["ok"] and head["id"] == 7 and head["result"]["n_layers"] == 2


@pytest.fixture
def ws(server):
    with _ws(server.url) as w:
        w.send(wire.request("open", 1, {"prompt": "She eats an apple."}))
        assert _answer(w)["ok"]
        w.send(wire.request("run", 2, {"n": 3}))
        assert _answer(w)["ok"]
        yield w


@FUZZ
@given(data=st.binary(max_size=4000))
def test_random_bytes_are_refused(ws, data):
    ws.send(data)
    head = _answer(ws)
    assert not head["ok"] and "text frames" in head["error"]
    _still_serving(ws)


@FUZZ
@given(text=st.text(max_size=4000))
def test_random_text_is_refused(ws, text):
    ws.send(text)
    head = _answer(ws)
    assert not head["ok"] or text.strip().startswith("{")
    _still_serving(ws)


@FUZZ
@given(req=requests)
def test_requests_of_the_wrong_shape_or_types_are_refused_and_valid_ones_answered(ws, req):
    ws.send(json.dumps(req))
    head = _answer(ws)
    if head["ok"]:  # what got through is what the schema allows (a refusal may come from either)
        assert head["id"] == wire.check_request(json.dumps(req))[1]
    _still_serving(ws)


@pytest.mark.parametrize(
    "text",
    [
        '{"op": "queries", "id": 1, "args": {"layer": 1' + "0" * 5000 + ', "p0": 0, "p1": 1}}',  # a huge number
        '{"op": "attention_rows", "id": 1, "args": {"layer": 0, "p0": 0, "p1": 99999999}}',
        '{"op": "keys", "id": 1, "args": {"layer": 0, "p0": 0, "p1": 2, "heads": [' + "0," * 5000 + "0]}}",
        '{"op": "open", "id": 1, "args": {"prompt": "' + "x" * (wire.MAX_TEXT + 1) + '"}}',
        '{"op": "open", "id": 1, "args": {"prompt": "x", "temperature": NaN}}',
        "[" * 100000 + "]" * 100000,  # nesting deeper than the parser's stack
        '{"op": "step", "id": 1, "args": {}, "extra": 1}',
        '{"op": "__class__", "id": 1, "args": {}}',
        '{"op": "set_mask_edits", "id": 1, "args": {"edits": [{"query": 1, "key": 2}]}}',  # a future key
        '{"op": "set_head_edits", "id": 1, "args": {"edits": [{"layer": 0, "head": 1, "patch_from": [1, 2]}]}}',
        '{"op": "labels", "id": 1, "args": {"ids": [999999]}}',
        '{"op": "run", "id": 1.5, "args": {"n": 1}}',
        # a run named in place of the session (wire.RUN_SELECTORS): a lab that is not there, a wrong type,
        # a number past the limit, two runs at once, a read that needs one, an op that takes none
        '{"op": "state", "id": 1, "args": {"policy_run": 123456789}}',
        '{"op": "state", "id": 1, "args": {"policy_run": "0"}}',
        '{"op": "queries", "id": 1, "args": {"layer": 0, "p0": 0, "p1": 1, "policy_run": 9007199254740992}}',
        '{"op": "state", "id": 1, "args": {"policy_run": 0, "beam": [0, 0]}}',
        '{"op": "policy_rows", "id": 1, "args": {"layer": 0}}',
        '{"op": "open", "id": 1, "args": {"prompt": "x", "policy_run": 0}}',
    ],
)
def test_hostile_values_are_refused_in_one_line(ws, text):
    ws.send(text)
    head = _answer(ws)
    assert not head["ok"]
    _still_serving(ws)


def test_a_frame_over_the_size_limit_ends_that_link_only(server):
    with _ws(server.url) as w:
        w.send("x" * (wire.MAX_REQUEST_BYTES + 4096))
        with pytest.raises(ConnectionClosed) as e:
            w.recv(timeout=30)
        assert e.value.rcvd is not None and e.value.rcvd.code == 1009  # "message too big"
    with _ws(server.url) as w:  # the server goes on serving the next connection
        _still_serving(w)


# ---------------------------------------------------------------------- the client's side of the wire
@FUZZ
@given(
    shape=st.lists(st.integers(0, 6), max_size=4), dtype=st.sampled_from(sorted(wire.DTYPES)), cut=st.integers(1, 64)
)
def test_a_truncated_or_padded_tensor_frame_is_refused(shape, dtype, cut):
    t = torch.zeros(shape, dtype=wire.DTYPES[dtype][0])
    meta, raw = wire.tensor_bytes(t)
    got_dtype, got_shape, nbytes = wire.tensor_meta(meta)
    back = wire.tensor_from(raw, got_dtype, got_shape, nbytes)
    assert back.dtype == t.dtype and torch.equal(back, t)
    for bad in (raw[: max(0, len(raw) - cut)], raw + b"\0" * cut):
        if len(bad) != len(raw):
            with pytest.raises(wire.WireError):
                wire.tensor_from(bad, got_dtype, got_shape, nbytes)


@FUZZ
@given(meta=json_values)
def test_a_lying_tensor_header_is_refused_before_any_frame_is_read(meta):
    try:
        dtype, shape, nbytes = wire.tensor_meta(meta)
    except wire.WireError:
        return
    assert dtype in wire.DTYPES and nbytes <= wire.MAX_TENSOR_BYTES


@FUZZ
@given(data=st.text(max_size=200) | st.binary(max_size=200))
def test_a_garbled_reply_header_is_refused(data):
    with pytest.raises(wire.WireError):
        wire.check_reply(data, 1)


def test_tensor_bytes_round_trip_every_dtype_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for name, (dtype, _) in wire.DTYPES.items():
        x = torch.randn(3, 5, generator=g).to(dtype) if dtype != torch.bool else torch.randn(3, 5, generator=g) > 0
        meta, raw = wire.tensor_bytes(x[:, 1:4])  # a non-contiguous view travels as its values
        assert meta == {"dtype": name, "shape": [3, 3]}
        back = wire.tensor_from(raw, *wire.tensor_meta(meta))
        assert torch.equal(back.view(torch.int16) if dtype == torch.bfloat16 else back,
                           x[:, 1:4].view(torch.int16) if dtype == torch.bfloat16 else x[:, 1:4])  # fmt: skip
    huge = {"dtype": "float32", "shape": [2**20, 2**20]}
    with pytest.raises(wire.WireError, match="limit"):
        wire.tensor_meta(huge)
