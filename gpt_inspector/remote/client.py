"""``gi.connect(url)``: a session on an engine that ``gpt-inspector serve`` runs elsewhere.

The object mirrors the small state (tokens, labels, steps with their top-k, decoding, edits) and
asks the server for numbers only when read, and only the rows asked for: ``attention_rows(l, p0, p1)``
moves (h, p1 - p0, T) floats, never the T x T matrices of every head. The numbers are the server's
own tensors, byte for byte.

Built on websockets' threaded (``sync``) client, so a Qt worker thread can own one without asyncio.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import torch

from ..core.decoding import Decoding
from ..core.edits import HeadEdit, MaskEdit
from ..core.errors import InspectorError
from ..core.step import TOP_N, TopEntry
from . import wire

# the client pings the server this often and gives up on a silent link after PING_TIMEOUT more
PING_INTERVAL, PING_TIMEOUT = 1.0, 4.0
# and waits no longer than this for a dead link's closing handshake
CLOSE_TIMEOUT = 1.0
# how long a new connection waits for the slot of a client that is just closing
BUSY_GRACE = 1.0


class LinkLost(InspectorError):
    """The link to the engine dropped; the server keeps the session: ``reconnect()`` gets it back."""


class RemoteRefused(InspectorError):
    """The engine refused the connection (a wrong token, another client connected)."""


def connect(url: str, prompt: str | None = None, temperature: float = 0.0, top_k: int | None = None,
            top_p: float | None = None, seed: int = 0, timeout: float = 10.0) -> RemoteSession:  # fmt: skip
    """Attach to the engine at ``url`` (the line ``gpt-inspector serve`` printed, token included).

    With ``prompt`` a new session starts on it (replacing the server's); without, the server's
    session is taken over as it stands (after a reconnect, exactly where it was left).
    """
    r = RemoteSession(url, timeout)
    if prompt is not None:
        r.open(prompt, temperature, top_k, top_p, seed)
    return r


@dataclass
class RemoteStep:
    """A step as ``Session.steps_done`` holds it; ``logits`` and ``probs`` (V,) are fetched when read."""

    index: int
    position: int
    token_id: int
    token_text: str
    label: str
    entropy: float
    forced: bool
    time_s: float
    finish_reason: str | None
    prob: float
    top: list[TopEntry]
    _client: RemoteSession | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_json(cls, d: dict, client: RemoteSession) -> RemoteStep:
        top = [TopEntry(int(i), str(lb), float(p), float(lg)) for i, lb, p, lg in d["top"]]
        keys = ("index", "position", "token_id", "token_text", "label", "entropy", "forced", "time_s",
                "finish_reason", "prob")  # fmt: skip
        return cls(**{k: d[k] for k in keys}, top=top, _client=client)

    @property
    def logits(self) -> torch.Tensor:
        return self._client.distribution(self.index)[0]

    @property
    def probs(self) -> torch.Tensor:
        return self._client.distribution(self.index)[1]


@dataclass
class RemoteReport:
    """``MaskEditReport`` as the server sent it: how the current next-token distribution moved."""

    earliest_position: int | None
    recomputed: int
    before: torch.Tensor | None
    after: torch.Tensor | None

    @property
    def total_variation(self) -> float:
        if self.before is None or self.after is None:
            return 0.0
        return float(0.5 * (self.before - self.after).abs().sum())


class RemoteSession:
    """The Session API over the wire (see the module docstring); one request at a time."""

    read_only = False

    def __init__(self, url: str, timeout: float = 10.0):
        parts = urlsplit(url)
        if parts.scheme not in ("ws", "wss") or not parts.hostname:
            raise InspectorError(
                f"expected the ws://HOST:PORT/?token=... line gpt-inspector serve printed, got {_redact(url)!r}"
            )
        self.url, self.timeout = url, timeout
        self.where = f"{parts.scheme}://{parts.netloc}"  # what messages name: never the token
        self._lock = threading.Lock()
        self._conn = None
        self._next_id = 0
        self.bytes_sent = self.bytes_received = 0
        self.tokens: list[int] = []
        self._labels: list[str] = []
        self.steps_done: list[RemoteStep] = []
        # until a session is open on the server (connect(url, prompt=...))
        self.prompt, self.prompt_ids, self.seed, self.attention_layers = None, [], 0, []
        self.cache_length, self.finished, self.decoding = 0, None, Decoding()
        self.mask_edits: list[MaskEdit] = []
        self.head_edits: list[HeadEdit] = []
        # a client that has just closed frees the server's slot a moment after its close returns
        self._attach_retrying(BUSY_GRACE, busy_only=True)

    # ------------------------------------------------------------------ the link
    def _attach(self) -> None:
        from websockets.exceptions import InvalidStatus, WebSocketException
        from websockets.sync.client import connect as ws_connect

        try:
            # the context-manager entry opens the link; our close() is its exit (the object outlives a block)
            self._conn = ws_connect(self.url, open_timeout=self.timeout, compression=None, proxy=None, max_size=None,
                                    ping_interval=PING_INTERVAL, ping_timeout=PING_TIMEOUT, close_timeout=CLOSE_TIMEOUT,
                                    logger=wire.quiet_logger()).__enter__()  # fmt: skip
        except InvalidStatus as e:
            body = (e.response.body or b"").decode("utf-8", "replace").strip() or f"HTTP {e.response.status_code}"
            raise RemoteRefused(f"the engine at {self.where} refused the connection: {body.splitlines()[0]}") from None
        except (OSError, TimeoutError, WebSocketException) as e:
            raise LinkLost(f"cannot reach the engine at {self.where}: {_one_line(e)}") from None
        info = self._call("hello")
        for k in ("model_name", "n_layers", "n_heads", "n_kv_heads", "head_dim", "context_length", "vocab_size",
                  "dtype", "unverified"):  # fmt: skip
            setattr(self, k, info[k])
        self._state = None
        if info["session"]:
            self._take(self._call("state"))

    def reconnect(self, timeout: float = 30.0) -> RemoteSession:
        """Connect again (after ``LinkLost``) and take the server's session back, where the server has it.

        Retries until ``timeout`` seconds have passed: a server that has not yet noticed the old
        link is gone answers "another client" for a moment.
        """
        self.close()
        self._attach_retrying(timeout, busy_only=False)
        return self

    def _attach_retrying(self, seconds: float, busy_only: bool) -> None:
        """``_attach``, tried again for ``seconds`` while the server is busy (or, unless ``busy_only``,
        unreachable); a wrong token is never retried."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                return self._attach()
            except (LinkLost, RemoteRefused) as e:
                busy = isinstance(e, RemoteRefused) and "another client" in str(e)
                if time.monotonic() > deadline or not (busy or (not busy_only and isinstance(e, LinkLost))):
                    raise
                time.sleep(0.1)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # closing a link already gone
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, op: str, **args):
        """The result of one request (its tensors: ``_call_t``)."""
        return self._call_t(op, **args)[0]

    def _call_t(self, op: str, **args) -> tuple[object, list[torch.Tensor]]:
        """(result, tensors) of one request; ``LinkLost`` in one line if the link drops."""
        from websockets.exceptions import ConnectionClosed as closed

        with self._lock:
            if self._conn is None:
                raise LinkLost(f"not connected to the engine at {self.where}: call reconnect()")
            self._next_id += 1
            rid = self._next_id
            try:
                msg = wire.request(op, rid, args)
            except (TypeError, ValueError) as e:  # before anything is sent: the link stays as it was
                raise InspectorError(f"{op}: arguments must be plain numbers, strings and lists ({e})") from None
            try:
                self._conn.send(msg)
                self.bytes_sent += len(msg.encode())
                data = self._conn.recv()
                self.bytes_received += len(data.encode()) if isinstance(data, str) else len(data)
                head, metas = wire.check_reply(data, rid)
                tensors = []
                for dtype, shape, nbytes in metas:
                    frame = self._conn.recv()
                    self.bytes_received += len(frame)
                    tensors.append(wire.tensor_from(frame, dtype, shape, nbytes))
            except (closed, OSError, TimeoutError) as e:
                self.close()
                raise LinkLost(
                    f"lost the link to the engine at {self.where} ({_one_line(e)}); the server keeps the "
                    "session: call reconnect()"
                ) from None
            except BaseException:
                # a garbled reply, or Ctrl+C between a request and its reply: this link is out of step
                # with the server and cannot be trusted further (reconnect() starts a clean one)
                self.close()
                raise
        if not head["ok"]:
            raise InspectorError(str(head.get("error", "the engine refused the request"))[:500])
        return head.get("result"), tensors

    # ------------------------------------------------------------------ mirrored state
    def _take(self, st: dict) -> None:
        self._state = st
        for k in ("prompt", "prompt_ids", "seed", "attention_layers"):
            if k in st:
                setattr(self, k, st[k])
        self._sync(st)

    def _sync(self, d: dict) -> None:
        t0, k0 = d["tokens_from"], d["steps_from"]
        self.tokens = self.tokens[:t0] + list(d["tokens"])
        self._labels = self._labels[:t0] + list(d["labels"])
        self.steps_done = self.steps_done[:k0] + [RemoteStep.from_json(x, self) for x in d["steps"]]
        if len(self.tokens) != d["n_tokens"] or len(self.steps_done) != d["n_steps"]:
            self._take(self._call("state"))  # out of step (never expected): take the whole state
            return
        self.cache_length, self.finished = d["cache_length"], d["finished"]
        self.decoding = Decoding(**d["decoding"])
        self.mask_edits = [MaskEdit.from_json(e) for e in d["mask_edits"]]
        self.head_edits = [HeadEdit.from_json(e) for e in d["head_edits"]]

    def _require(self) -> None:
        if self._state is None:
            raise InspectorError("no session on the engine yet: open one, connect(url, prompt=...)")

    @property
    def n_steps(self) -> int:
        return len(self.steps_done)

    @property
    def current(self) -> RemoteStep | None:
        return self.steps_done[-1] if self.steps_done else None

    @property
    def ended(self) -> bool:
        return bool(self.finished)

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_ids)

    def token_labels(self, ids=None) -> list[str]:
        if ids is None:
            return list(self._labels)
        return self._call("labels", ids=[int(i) for i in ids])

    def label(self, token_id: int) -> str:
        return self.token_labels([token_id])[0]

    # ------------------------------------------------------------------ commands
    def open(self, prompt: str, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0) -> None:  # fmt: skip
        """Start a new session on the server (the one it had is dropped)."""
        self.tokens, self._labels, self.steps_done = [], [], []
        self._take(self._call("open", prompt=prompt, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))

    def _change(self, op: str, **args):
        self._require()
        head, tensors = self._call_t(op, **args)
        self._sync(head)
        return head, tensors

    def step(self) -> RemoteStep:
        self._change("step")
        return self.current

    def run(self, n: int) -> list[RemoteStep]:
        before = self.n_steps
        self._change("run", n=n)
        return self.steps_done[before:]

    def step_back(self) -> RemoteStep:
        gone = self.current
        self._change("step_back")
        return gone

    def restart(self) -> None:
        self._change("restart")

    def force_token(self, token_id: int) -> RemoteStep:
        self._change("force_token", token_id=token_id)
        return self.current

    _UNSET = object()

    def set_decoding(self, temperature=_UNSET, top_k=_UNSET, top_p=_UNSET, redecide: bool = False):
        args = {k: v for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p))
                if v is not self._UNSET}  # fmt: skip
        self._change("set_decoding", **args, redecide=redecide)
        return self.current

    def set_temperature(self, t: float, redecide: bool = False):
        return self.set_decoding(temperature=t, redecide=redecide)

    def set_top_k(self, k: int | None, redecide: bool = False):
        return self.set_decoding(top_k=k, redecide=redecide)

    def set_top_p(self, p: float | None, redecide: bool = False):
        return self.set_decoding(top_p=p, redecide=redecide)

    def _report(self, op: str, edits) -> RemoteReport:
        head, tensors = self._change(op, edits=edits)
        before, after = tensors if head["has_distributions"] else (None, None)
        return RemoteReport(head["earliest_position"], head["recomputed"], before, after)

    def set_mask_edits(self, edits) -> RemoteReport:
        return self._report("set_mask_edits", [_edit_json(e, MaskEdit) for e in edits])

    def add_mask_edit(self, edit: MaskEdit) -> RemoteReport:
        return self.set_mask_edits([*self.mask_edits, edit])

    def clear_mask_edits(self) -> RemoteReport:
        return self.set_mask_edits([])

    def set_head_edits(self, edits) -> RemoteReport:
        """Knock-outs (``HeadEdit(layer, head)``) and patches (``patch_from``: the source run's token ids)."""
        return self._report("set_head_edits", [_edit_json(e, HeadEdit) for e in edits])

    def knock_out(self, layer: int, head: int | None = None) -> RemoteReport:
        return self.set_head_edits([*self.head_edits, HeadEdit(layer, head)])

    # ------------------------------------------------------------------ reads: the rows asked for
    def _rows(self, op: str, layer: int, p0: int, p1: int | None, heads) -> torch.Tensor:
        self._require()
        p1 = self.cache_length if p1 is None else p1
        heads = None if heads is None else [int(h) for h in heads]
        return self._call_t(op, layer=layer, p0=p0, p1=p1, heads=heads)[1][0]

    def queries(self, layer: int, p0: int = 0, p1: int | None = None, heads=None) -> torch.Tensor:
        """q of query rows p0..p1 (default all) for ``heads`` (default every head): (h, n, d)."""
        return self._rows("queries", layer, p0, p1, heads)

    def keys(self, layer: int, p0: int = 0, p1: int | None = None, heads=None) -> torch.Tensor:
        """The cached keys of positions p0..p1 for KV ``heads`` (default every KV head): (h_kv, n, d)."""
        return self._rows("keys", layer, p0, p1, heads)

    def values(self, layer: int, p0: int = 0, p1: int | None = None, heads=None) -> torch.Tensor:
        return self._rows("values", layer, p0, p1, heads)

    def qkv(self, layer: int):
        """q (H, T, d), k (H_kv, T, d), v (H_kv, T, d) as float32 numpy arrays, as ``Session.qkv``."""
        return tuple(x.to(torch.float32).numpy() for x in (self.queries(layer), self.keys(layer), self.values(layer)))

    def attention_rows(self, layer: int, p0: int, p1: int, kind: str = "probs", heads=None,
                       keys: int | None = None) -> torch.Tensor:  # fmt: skip
        """Query rows p0..p1 of ``kind`` (h, n, T) float32, computed on the server; only those rows travel."""
        self._require()
        heads = None if heads is None else [int(h) for h in heads]
        return self._call_t("attention_rows", layer=layer, p0=p0, p1=p1, kind=kind, heads=heads, keys=keys)[1][0]

    def layers_attention_rows(self, layers, p0: int, p1: int, kind: str = "probs", heads=None,
                              keys: int | None = None) -> torch.Tensor:  # fmt: skip
        """``attention_rows`` of several layers in one request, stacked: (L, h, n, T). A window repaints
        the newest row of every layer after a step with this: one round trip instead of one per layer."""
        self._require()
        heads = None if heads is None else [int(h) for h in heads]
        layers = [int(i) for i in layers]
        out = self._call_t("layers_attention_rows", layers=layers, p0=p0, p1=p1, kind=kind, heads=heads, keys=keys)
        return out[1][0]

    def attention(self, layer: int, head: int, kind: str = "probs"):
        """The whole (T, T) float32 numpy matrix of one head: asked for, so it travels whole."""
        self._require()
        return self._call_t("attention", layer=layer, head=head, kind=kind)[1][0].numpy()

    def distribution(self, index: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, probs), each (V,) float32, of step ``index`` (default the current one)."""
        self._require()
        index = self.n_steps - 1 if index is None else index
        return tuple(self._call_t("distribution", index=index)[1])

    def top(self, index: int | None = None, n: int = TOP_N) -> list[TopEntry]:
        """The ``n`` most likely next tokens of step ``index`` (default the current one), best first."""
        self._require()
        index = self.n_steps - 1 if index is None else index
        return [TopEntry(int(i), str(lb), float(p), float(lg)) for i, lb, p, lg in self._call("top", index=index, n=n)]

    def recipe(self) -> dict:
        self._require()
        return self._call("recipe")

    def kv_cache_bytes(self, layer: int | None = None) -> int:
        self._require()
        return self._call("kv_cache_bytes", layer=layer)


def _edit_json(e, cls) -> dict:
    if not isinstance(e, cls):
        raise InspectorError(f"expected {cls.__name__} values, got {e!r}")
    d = e.to_json()
    return {k: v for k, v in d.items() if v is not None}


def _one_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _redact(url: str) -> str:
    return url.split("?", 1)[0]
