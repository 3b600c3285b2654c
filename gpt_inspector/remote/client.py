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

from ..core.chat import check_messages
from ..core.decoding import Decoding
from ..core.edits import HeadEdit, MaskEdit
from ..core.errors import InspectorError
from ..core.step import TOP_N, Stage, TopEntry
from . import wire
from .assisted import chat_of
from .lab_client import RemoteLabs
from .source import RemoteReads

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
            top_p: float | None = None, seed: int = 0, timeout: float = 10.0, *, messages: list[dict] | None = None,
            add_generation_prompt: bool = True, **settings) -> RemoteSession:  # fmt: skip
    """Attach to the engine at ``url`` (the line ``gpt-inspector serve`` printed, token included).

    With ``prompt`` (or chat ``messages``, as ``Session`` takes them: the engine applies its tokenizer's
    template) a new session starts on it, replacing the server's; without, the server's session is taken
    over as it stands (after a reconnect, exactly where it was left).
    """
    r = RemoteSession(url, timeout)
    if prompt is not None or messages is not None:
        r.open(prompt or "", temperature, top_k, top_p, seed, messages=messages,
               add_generation_prompt=add_generation_prompt, **settings)  # fmt: skip
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
    stages: tuple[Stage, ...] = ()  # raw logits, then each of generate's processors (in brief, as Step's)
    _client: RemoteSession | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_json(cls, d: dict, client: RemoteSession) -> RemoteStep:
        keys = ("index", "position", "token_id", "token_text", "label", "entropy", "forced", "time_s",
                "finish_reason", "prob")  # fmt: skip
        stages = tuple(Stage(x["key"], x["label"], x["origin"], _entries(x["top"]), x["kept"], _entries(x["removed"]),
                             x["n_removed"], tuple((_entry(m[:4]), m[4], m[5]) for m in x["moved"]))
                       for x in d.get("stages", ()))  # fmt: skip
        return cls(**{k: d[k] for k in keys}, top=list(_entries(d["top"])), stages=stages, _client=client)

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


class RemoteSession(RemoteReads, RemoteLabs):
    """The Session API over the wire (see the module docstring), and a run source (``RemoteReads``):
    the window drives one as it drives a local session. One request at a time.

    Traffic: ``bytes_sent``, ``bytes_received`` and ``requests`` count everything since the
    connection object was made; ``step_bytes`` counts the bytes (both ways) since the last command
    that changed the session began: read after a step and its repaint, the bytes that step cost.
    """

    chat = None  # a chat prompt's turns (core.chat.Chat), the engine's template's text and each token's role

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
        self.bytes_sent = self.bytes_received = self.requests = 0
        self._change_mark = 0
        self.changes = 0  # commands that changed the session so far: a window's autosave asks for the recipe anew
        self._listeners: list = []
        self._label_of: dict[int, str] = {}  # token id -> label, from every token seen
        self._reset_reads()
        self.tokens: list[int] = []
        self._labels: list[str] = []
        self.steps_done: list[RemoteStep] = []
        # until a session is open on the server (connect(url, prompt=...))
        self.prompt, self.prompt_ids, self.seed, self._attention_layers = None, [], 0, []
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
                  "dtype", "unverified", "device", "note", "refused"):  # fmt: skip
            setattr(self, k, info[k])
        self._state = None
        if info["session"]:
            self._take(self._call("state"))

    def reconnect(self, timeout: float = 30.0, open_timeout: float | None = None) -> RemoteSession:
        """Connect again (after ``LinkLost``) and take the server's session back, where the server has it.

        Retries until ``timeout`` seconds have passed: a server that has not yet noticed the old
        link is gone answers "another client" for a moment. ``open_timeout``: how long one attempt
        waits for the handshake (default the connection's ``timeout``).
        """
        self.close()
        keep = self.timeout
        self.timeout = keep if open_timeout is None else open_timeout
        try:
            self._attach_retrying(timeout, busy_only=False)
        finally:
            self.timeout = keep
        self._listeners.clear()  # what watched the old state (a window's view model) builds anew from this one
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

    def _call_t(self, op: str, _job=None, **args) -> tuple[object, list[torch.Tensor]]:
        """(result, tensors) of one request; ``LinkLost`` in one line if the link drops. ``_job``: a long
        job's (progress, cancelled), see ``lab_client``."""
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
                self.requests += 1
                self._conn.send(msg)
                self.bytes_sent += len(msg.encode())
                ack = None
                if _job is None:
                    data = self._conn.recv()
                    self.bytes_received += len(data.encode()) if isinstance(data, str) else len(data)
                else:
                    data, ack = self._await_reply(rid, *_job)
                head, metas = wire.check_reply(data, rid)
                tensors = []
                for dtype, shape, nbytes in metas:
                    frame = self._conn.recv()
                    self.bytes_received += len(frame)
                    tensors.append(wire.tensor_from(frame, dtype, shape, nbytes))
                if ack is not None:
                    self._read_ack(ack)
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
    @property
    def step_bytes(self) -> int:
        """Bytes both ways since the last command that changed the session began (see the class docstring)."""
        return self.bytes_sent + self.bytes_received - self._change_mark

    @property
    def link(self) -> RemoteSession:
        """The session whose connection this one's requests travel on: itself (an inspected beam: its
        client's), so a window watches and re-makes one link whatever it shows over it."""
        return self

    @property
    def link_alive(self) -> bool:
        """Whether the link is up as far as this side knows (a stalled one is closed by the pings)."""
        from websockets.protocol import State

        conn = self._conn
        return conn is not None and conn.protocol.state is State.OPEN

    def _take(self, st: dict) -> None:
        self.changes += 1
        self._state = st
        self._reset_reads()
        self.tokens, self._labels, self.steps_done = [], [], []
        for k in ("prompt", "prompt_ids", "seed"):
            if k in st:
                setattr(self, k, st[k])
        if "chat" in st:
            self.chat = chat_of(st["chat"], self.prompt_ids)
        self._attention_layers = list(st.get("attention_layers", self._attention_layers))
        self._sync(st)

    def _sync(self, d: dict) -> None:
        t0, k0 = d["tokens_from"], d["steps_from"]
        self.tokens = self.tokens[:t0] + list(d["tokens"])
        self._labels = self._labels[:t0] + list(d["labels"])
        self._label_of.update(zip(d["tokens"], d["labels"]))
        self.steps_done = self.steps_done[:k0] + [RemoteStep.from_json(x, self) for x in d["steps"]]
        if len(self.tokens) != d["n_tokens"] or len(self.steps_done) != d["n_steps"]:
            self._take(self._call("state"))  # out of step (never expected): take the whole state
            return
        self.cache_length, self.finished = d["cache_length"], d["finished"]
        self.decoding = Decoding(**d["decoding"])
        self.mask_edits = [MaskEdit.from_json(e) for e in d["mask_edits"]]
        self.head_edits = [HeadEdit.from_json(e) for e in d["head_edits"]]
        self._kv = d["kv"]
        self._changed(d.get("changed_from", 0))

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
        lab = self._label_of.get(int(token_id))
        if lab is None:
            lab = self._label_of[int(token_id)] = self.token_labels([token_id])[0]
        return lab

    # ------------------------------------------------------------------ commands
    def open(self, prompt: str = "", temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0, *, messages: list[dict] | None = None, add_generation_prompt: bool = True,
             **settings) -> None:  # fmt: skip
        """Start a new session on the server (the one it had is dropped); ``settings``: generate's
        other sampler settings, as ``Session`` takes them; ``messages``: a chat prompt instead of
        ``prompt``, which the engine's tokenizer's chat template renders."""
        chat = None
        if messages is not None:
            if prompt:
                raise InspectorError("give messages or a prompt, not both")
            chat = {"messages": check_messages(messages), "add_generation_prompt": bool(add_generation_prompt)}
        self._change_mark = self.bytes_sent + self.bytes_received
        self._listeners.clear()  # a new session: views of the old one are done with
        self._take(self._call("open", prompt=prompt, temperature=temperature, top_k=top_k, top_p=top_p, seed=int(seed),
                              settings=_settings(settings), chat=chat))  # fmt: skip

    def replay(self, recipe: dict) -> None:
        """A new session on the engine rebuilt from ``recipe`` (``Session.replay`` there: the same steps and edits)."""
        self._change_mark = self.bytes_sent + self.bytes_received
        self._listeners.clear()
        self._take(self._call("replay", recipe=recipe))

    def build_chat(self, messages: list[dict], add_generation_prompt: bool = True):
        """The ``core.chat.Chat`` the engine's chat template makes of ``messages``, without opening a session."""
        r = self._call(
            "chat_build", messages=check_messages(messages), add_generation_prompt=bool(add_generation_prompt)
        )
        return chat_of(r["chat"], [int(i) for i in r["ids"]])

    def remote_assisted(self, assistant: str | None = None, **numbers):
        """``core.assisted.Assisted`` on this session, run by the engine (``Assisted(r, ...)`` comes here)."""
        from .assisted import RemoteAssisted

        self._require()
        return RemoteAssisted(self, assistant, **numbers)

    def _assisted_op(self, op: str, **args) -> dict:
        """An assisted-decoding request; the views hear of the steps it took back and made, as of any step."""
        had = list(self.steps_done)
        head, _ = self._change(op, **args)
        self._emit_changes(had)
        return head

    def _emit_changes(self, had: list[RemoteStep]) -> None:
        """The views hear of the steps taken back since ``had`` and of those made (a change done by one request)."""
        keep = 0  # the steps both before and after
        for a, b in zip(had, self.steps_done):
            if (a.index, a.token_id) != (b.index, b.token_id):
                break
            keep += 1
        for st in had[keep:][::-1]:
            self._emit("step_back", st)
        for st in self.steps_done[keep:]:
            self._emit("step", st)

    def _change(self, op: str, **args):
        self._require()
        self.changes += 1
        self._change_mark = self.bytes_sent + self.bytes_received
        head, tensors = self._call_t(op, **args)
        self._sync(head)
        return head, tensors

    def step(self) -> RemoteStep:
        then = self._predicted()  # what the last repaint read, moved on by a step: answered in the same reply
        head, tensors = self._change("step", **({"then": then} if then else {}))
        self._prefetched(then, head.get("then"), tensors)
        self._emit("step", self.current)
        return self.current

    def run(self, n: int) -> list[RemoteStep]:
        before = self.n_steps
        self._change("run", n=n)
        for st in self.steps_done[before:]:
            self._emit("step", st)
        return self.steps_done[before:]

    def _going_back(self, op: str) -> list[RemoteStep]:
        had = list(self.steps_done)
        self._change(op)
        gone = had[self.n_steps :][::-1]  # newest first, as a local session steps back
        for st in gone:
            self._emit("step_back", st)
        return gone

    def step_back(self) -> RemoteStep:
        return self._going_back("step_back")[0]

    def restart(self) -> None:
        self._going_back("restart")

    def force_token(self, token_id: int) -> RemoteStep:
        self._change("force_token", token_id=int(token_id))
        self._emit("force", self.current)
        return self.current

    _UNSET = object()

    def set_decoding(self, temperature=_UNSET, top_k=_UNSET, top_p=_UNSET, redecide: bool = False, **settings):
        args = {k: v for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p))
                if v is not self._UNSET}  # fmt: skip
        self._change("set_decoding", **args, redecide=redecide, settings=_settings(settings))
        self._emit("decoding", self.current)
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
        report = RemoteReport(head["earliest_position"], head["recomputed"], before, after)
        self._emit("mask", report)
        return report

    # progress and cancelled: as Session takes them; the engine recomputes in one request, so a
    # remote recompute reports no progress and runs to its end once sent
    def set_mask_edits(self, edits, progress=None, cancelled=None) -> RemoteReport:
        return self._report("set_mask_edits", [_edit_json(e, MaskEdit) for e in edits])

    def add_mask_edit(self, edit: MaskEdit) -> RemoteReport:
        return self.set_mask_edits([*self.mask_edits, edit])

    def clear_mask_edits(self) -> RemoteReport:
        return self.set_mask_edits([])

    def set_head_edits(self, edits, progress=None, cancelled=None) -> RemoteReport:
        """Knock-outs (``HeadEdit(layer, head)``) and patches (``patch_from``: the source run's token ids)."""
        return self._report("set_head_edits", [_edit_json(e, HeadEdit) for e in edits])

    def knock_out(self, layer: int, head: int | None = None) -> RemoteReport:
        return self.set_head_edits([*self.head_edits, HeadEdit(layer, head)])

    def patch_edit_from(self, layer: int, head: int, prompt: str) -> HeadEdit:
        """The HeadEdit that patches (layer, head) from a run of ``prompt`` the engine steps as far as this one."""
        self._require()
        return HeadEdit.from_json(self._call("patch_edit", layer=int(layer), head=int(head), prompt=str(prompt)))

    # ------------------------------------------------------------------ reads beyond the run-source protocol
    def layers_attention_rows(self, layers, p0: int, p1: int, kind: str = "probs", heads=None,
                              keys: int | None = None) -> torch.Tensor:  # fmt: skip
        """``attention_rows`` of several layers in one request, stacked: (L, h, n, T). A window repaints
        the newest row of every layer after a step with this: one round trip instead of one per layer."""
        self._require()
        heads = None if heads is None else [int(h) for h in heads]
        layers = [int(i) for i in layers]
        out = self._call_t("layers_attention_rows", layers=layers, p0=p0, p1=p1, kind=kind, heads=heads, keys=keys)
        return out[1][0]

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


def _edit_json(e, cls) -> dict:
    if not isinstance(e, cls):
        raise InspectorError(f"expected {cls.__name__} values, got {e!r}")
    d = e.to_json()
    return {k: v for k, v in d.items() if v is not None}


def _entry(x) -> TopEntry:
    i, lb, p, lg = x
    return TopEntry(int(i), str(lb), float(p), float(lg))


def _entries(xs) -> tuple[TopEntry, ...]:
    return tuple(_entry(x) for x in xs)


def _settings(settings: dict) -> dict | None:
    """generate's other sampler settings as the wire takes them (tuples as lists), or None."""
    if not settings:
        return None
    return {k: [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, tuple) else v
            for k, v in settings.items()}  # fmt: skip


def _one_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _redact(url: str) -> str:
    return url.split("?", 1)[0]
