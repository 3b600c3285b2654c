"""The engine behind a websocket: one loaded model, one session, one client at a time.

Each connection runs in its own thread (websockets' threaded server); every model call holds the
engine's lock, so the session is only ever touched by one thread at a time. The session belongs to
the server, not to a connection: a client that crashes or drops leaves it as it was, and the next
client that shows the token gets it back.
"""

from __future__ import annotations

import hmac
import json
import sys
import threading
import time
import traceback
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

import torch

from ..core import outfile
from ..core.edits import HeadEdit, MaskEdit
from ..core.errors import InspectorError, StepFailed
from ..core.session import Session
from ..core.source import model_refusals
from ..core.step import top_entries
from . import wire
from .labs import LabOps
from .reads import ReadOps
from .session_ops import SessionOps, chat_json

BUSY = "another client is connected to this engine; close it first (one client at a time)"
# pings: a client that vanished without closing (a cut cable) frees the slot within this many seconds
# (after PING_INTERVAL + PING_TIMEOUT + CLOSE_TIMEOUT at most: about 17 s)
PING_INTERVAL, PING_TIMEOUT, CLOSE_TIMEOUT = 5.0, 10.0, 2.0


def _top(entries) -> list:
    return [[e.token_id, e.label, e.prob, e.logit] for e in entries]


def step_json(s) -> dict:
    """A step as the client mirrors it, with its sampler stages in brief; the (V,) logits and probs
    stay here until asked for."""
    stages = [{"key": x.key, "label": x.label, "origin": x.origin, "top": _top(x.top), "kept": x.kept,
               "removed": _top(x.removed), "n_removed": x.n_removed,
               "moved": [[*_top([e])[0], a, b] for e, a, b in x.moved]} for x in s.stages]  # fmt: skip
    return {"index": s.index, "position": s.position, "token_id": s.token_id, "token_text": s.token_text,
            "label": s.label, "entropy": s.entropy, "forced": s.forced, "time_s": s.time_s,
            "finish_reason": s.finish_reason, "prob": s.prob, "top": _top(s.top), "stages": stages}  # fmt: skip


class Engine(ReadOps, LabOps, SessionOps):
    """The loaded model and its session, and every operation of ``wire.OPS`` on them."""

    def __init__(self, lm, session: Session | None = None):
        self.lm = lm
        self.session = session
        self.lock = threading.Lock()
        self.stopping = threading.Event()  # Ctrl+C: a long run stops after its current step

    # ------------------------------------------------------------------ dispatch
    def handle(self, op: str, args: dict, job=None) -> tuple[object, list[torch.Tensor]]:
        """``op_<op>(**args)``; a long job (``wire.JOB_OPS``) also gets ``job``: its link (see ``labs``)."""
        with self.lock:
            # a read of an inspected beam or the lab's policy run (wire.RUN_SELECTORS): it stands in for the session
            self.view = self.run_view(args)
            try:
                return getattr(self, f"op_{op}")(**args, **({"job": job} if op in wire.JOB_OPS else {}))
            finally:
                self.view = None

    def op_cancel(self):  # a cancel with no job running: it has nothing to stop
        return False, []

    view = None  # the run (a beam, the lab's policy run) a request names, while it runs (handle)

    def _s(self) -> Session:
        if self.view is not None:
            return self.view
        if self.session is None:
            raise InspectorError("no session yet: open one with a prompt (connect(url, prompt=...))")
        return self.session

    def info(self) -> dict:
        lm = self.lm
        return {"model_name": lm.name, "n_layers": lm.n_layers, "n_heads": lm.n_heads, "n_kv_heads": lm.n_kv_heads,
                "head_dim": lm.head_dim, "context_length": lm.context_length, "vocab_size": lm.vocab_size,
                "dtype": str(lm.dtype).removeprefix("torch."), "unverified": lm.unverified,
                "session": self.session is not None, "device": str(lm.device), "note": lm.note,
                "refused": model_refusals(lm)}  # fmt: skip

    def state(self) -> dict:
        s = self._s()
        return {"prompt": s.prompt, "prompt_ids": list(s.prompt_ids), "seed": s.seed,
                "attention_layers": list(s.attention_layers), "chat": chat_json(getattr(s, "chat", None)),
                "refused": dict(s.live.refused), **self._sync(s, 0, 0)}  # fmt: skip

    @staticmethod
    def _sync(s: Session, tokens_from: int, steps_from: int, changed_from: int = 0) -> dict:
        """What changed: the tokens and steps from those indices on, and the small state around them."""
        return {"n_tokens": len(s.tokens), "tokens_from": tokens_from, "tokens": s.tokens[tokens_from:],
                "labels": s.token_labels(s.tokens[tokens_from:]), "n_steps": s.n_steps, "steps_from": steps_from,
                "steps": [step_json(x) for x in s.steps_done[steps_from:]], "cache_length": s.cache_length,
                "finished": s.finished, "decoding": s.decoding.to_json(),
                "mask_edits": [e.to_json() for e in s.mask_edits],
                "head_edits": [e.to_json() for e in s.head_edits], "changed_from": changed_from,
                "kv": {"cache": [s.kv_cache_bytes(i) for i in range(s.n_layers)],
                       "kept": [s.kv_kept_bytes(i) for i in range(s.n_layers)],
                       "positions": [s.kv_cache_positions(i) for i in range(s.n_layers)],
                       "per_head": s.kv_per_head_bytes(),
                       "note": "" if s.kv_layout is None else s.kv_layout.describe()}}  # fmt: skip

    def _changing(self, change, edits: bool = False, s: Session | None = None):
        """Run ``change(session)`` (``s``: another run than the one named); the reply carries what it
        changed (only the tail, except after edits)."""
        s = self._s() if s is None else s
        n_tokens, n_steps, length = len(s.tokens), s.n_steps, s.cache_length
        out = change(s)
        t0 = max(0, min(n_tokens, len(s.tokens)) - 1)
        k0 = 0 if edits else max(0, min(n_steps, s.n_steps) - 1)
        # the first position whose records may differ now: a step appends, a step back crops, an
        # edit recomputes from its earliest affected position
        changed = min(length, s.cache_length)
        if edits and out.earliest_position is not None:
            changed = min(changed, out.earliest_position)
        return out, self._sync(s, t0, k0, changed)

    # ------------------------------------------------------------------ session commands
    def op_hello(self):
        return self.info(), []

    def op_state(self):
        return self.state(), []

    def op_open(self, prompt, seed=0, temperature=0.0, top_k=None, top_p=None, settings=None, chat=None):
        start = {"prompt": prompt} if chat is None else {"prompt": prompt, **chat}  # a chat: the template is here
        self.session = Session(self.lm, **start, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                               **(settings or {}))  # fmt: skip
        self.assisted = None
        return self.state(), []

    def op_step(self, then=None):
        _, sync = self._changing(lambda s: s.step())
        tensors: list[torch.Tensor] = []
        if then:  # the reads the client expects to repaint with: answered now, each on its own
            sync["then"] = []
            for call in then:
                try:
                    result, ts = getattr(self, f"op_{call['op']}")(**call["args"])
                except Exception as e:  # a read that fails fails alone: the step happened, its reply must say so
                    sync["then"].append([False, _one_line(e), 0])
                    continue
                sync["then"].append([True, result, len(ts)])
                tensors += ts
        return sync, tensors

    def op_run(self, n):
        def run(s):
            for _ in range(n):  # one by one: Ctrl+C on the server stops between two steps
                if self.stopping.is_set() or s.ended:
                    break
                s.step()

        return self._changing(run)[1], []

    def op_step_back(self):
        return self._changing(lambda s: s.step_back())[1], []

    def op_restart(self):
        return self._changing(lambda s: s.restart())[1], []

    def op_force_token(self, token_id):
        return self._changing(lambda s: s.force_token(token_id))[1], []

    def op_set_decoding(self, redecide=False, settings=None, **changes):
        changes.update(settings or {})
        return self._changing(lambda s: s.set_decoding(**changes, redecide=redecide))[1], []

    def _report(self, report, sync):
        tensors = [t for t in (report.before, report.after) if t is not None]
        head = {"earliest_position": report.earliest_position, "recomputed": report.recomputed,
                "has_distributions": len(tensors) == 2, **sync}  # fmt: skip
        return head, tensors

    def op_set_mask_edits(self, edits):
        edits = [MaskEdit(**{"blocked": True, **e}) for e in edits]
        return self._report(*self._changing(lambda s: s.set_mask_edits(edits), edits=True))

    def op_set_head_edits(self, edits):
        edits = [HeadEdit(e["layer"], e.get("head"), None if e.get("patch_from") is None else tuple(e["patch_from"]))
                 for e in edits]  # fmt: skip
        return self._report(*self._changing(lambda s: s.set_head_edits(edits), edits=True))

    # ------------------------------------------------------------------ reads: only the rows asked for
    def _rows(self, s: Session, p0: int, p1: int) -> None:
        t = s.require_positions()
        if not 0 <= p0 <= p1 <= t:
            raise InspectorError(f"query rows must lie in [0, {t}], got {p0}..{p1}")

    def _primitive(self, which: str, layer, p0, p1, heads):
        s = self._s()
        full = getattr(s, which)(layer)  # (H or Hkv, T, d), a view of the records
        self._rows(s, p0, p1)
        if heads is not None:
            limit = s.n_heads if which == "queries" else full.shape[0]
            for h in heads:
                if not 0 <= h < limit:
                    raise InspectorError(f"head must be in [0, {limit}), got {h}")
            full = full[torch.as_tensor(heads, dtype=torch.long)]
        return None, [full[:, p0:p1]]  # (h, n, d)

    def op_queries(self, layer, p0, p1, heads=None):
        return self._primitive("queries", layer, p0, p1, heads)

    def op_keys(self, layer, p0, p1, heads=None):
        return self._primitive("keys", layer, p0, p1, heads)

    def op_values(self, layer, p0, p1, heads=None):
        return self._primitive("values", layer, p0, p1, heads)

    def op_attention_rows(self, layer, p0, p1, kind="probs", heads=None, keys=None):
        return None, [self._s().attention_rows(layer, p0, p1, kind, heads=heads, keys=keys)]  # (h, n, keys)

    def op_layers_attention_rows(self, layers, p0, p1, kind="probs", heads=None, keys=None):
        s = self._s()
        if not layers:
            raise InspectorError("layers is empty: name at least one layer")
        rows = [s.attention_rows(i, p0, p1, kind, heads=heads, keys=keys) for i in layers]  # each (h, n, keys)
        return None, [torch.stack(rows)]  # (L, h, n, keys): one request for every layer a step repaints

    def op_attention(self, layer, head, kind="probs"):
        return None, [torch.from_numpy(self._s().attention(layer, head, kind))]  # (T, T): asked for whole

    def _step_at(self, index):
        s = self._s()
        if not 0 <= index < s.n_steps:
            raise InspectorError(f"step index must be in [0, {s.n_steps}), got {index}")
        return s, s.steps_done[index]

    def op_distribution(self, index):
        _, st = self._step_at(index)
        return None, [st.logits, st.probs]  # (V,), (V,)

    def op_top(self, index, n=10):
        s, st = self._step_at(index)
        return [[e.token_id, e.label, e.prob, e.logit] for e in top_entries(st.probs, st.logits, s.label, n)], []

    def op_labels(self, ids):
        v = self.lm.vocab_size
        bad = [i for i in ids if i >= v]
        if bad:
            raise InspectorError(f"token ids must be in [0, {v}), got {bad[0]}")
        return [self._s().label(i) for i in ids], []

    def op_recipe(self):
        return self._s().recipe(), []

    def op_kv_cache_bytes(self, layer=None):
        return self._s().kv_cache_bytes(layer), []


class Server:
    """Token check, the one-client slot, and the message loop around an ``Engine``."""

    def __init__(self, engine: Engine, host: str, port: int, token: str, log=sys.stderr):
        from websockets.sync.server import serve

        self.engine, self.token, self.log = engine, token, log
        self._slot = threading.Lock()
        self._client = None
        self.ws = serve(self._connection, host, port, process_request=self._admit, compression=None,
                        max_size=wire.MAX_REQUEST_BYTES + 1024, ping_interval=PING_INTERVAL,
                        ping_timeout=PING_TIMEOUT, close_timeout=CLOSE_TIMEOUT, logger=wire.quiet_logger())  # fmt: skip
        self.host, self.port = self.ws.socket.getsockname()[:2]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"ws://{host}:{self.port}/?token={self.token}"

    def _token_ok(self, path: str) -> bool:
        given = parse_qs(urlsplit(path).query).get("token", [])
        # constant time: how much of a guess matched must not show in how long the refusal takes
        return len(given) == 1 and hmac.compare_digest(given[0].encode(), self.token.encode())

    def _admit(self, connection, request):
        if not self._token_ok(request.path):
            return connection.respond(HTTPStatus.UNAUTHORIZED, wire.BAD_TOKEN + "\n")
        if self._client is not None:
            return connection.respond(HTTPStatus.CONFLICT, BUSY + "\n")
        return None

    def _connection(self, conn) -> None:
        with self._slot:  # two clients admitted at once: the second one is turned away here
            if self._client is not None:
                conn.close(1008, BUSY)
                return
            self._client = conn
        try:
            for data in conn:
                self._answer(conn, data)
        except Exception as e:  # the link went: the session stays for the next client
            if not _closed(e):
                print(f"gpt-inspector serve: connection error: {_one_line(e)}", file=self.log)
        finally:
            with self._slot:
                self._client = None

    def _answer(self, conn, data) -> None:
        rid = None
        try:
            op, rid, args = wire.check_request(data)
            job = _Job(self, conn, rid) if op in wire.JOB_OPS else None
            result, tensors = self.engine.handle(op, args, job)
            head, frames = wire.reply(rid, result, tensors)
        except (InspectorError, StepFailed) as e:
            head, frames = wire.reply(getattr(e, "rid", None) if rid is None else rid, error=_one_line(e))
        except KeyboardInterrupt:
            raise
        except Exception as e:  # a bug of ours: one line to the client, the stack to the server's terminal
            traceback.print_exc(file=self.log)
            head, frames = wire.reply(rid, error=f"internal error: {type(e).__name__}: {_one_line(e)}")
        conn.send(head)
        for f in frames:
            conn.send(f)

    def serve_forever(self) -> None:
        self.ws.serve_forever()

    def shutdown(self) -> None:
        self.engine.stopping.set()
        self.ws.shutdown(reason="the engine is shutting down")


class _Job:
    """A long op's link while it runs on the connection's thread: progress notes go out, and what the
    client sent meanwhile is read between two steps: a cancel is acknowledged and stops the job,
    anything else is refused in one line. A link that drops stops it too (the session stays)."""

    NOTE_S = 0.05  # at most one note this often (and the last one): a slow link carries no flood of them

    def __init__(self, server: Server, conn, rid: int):
        self.server, self.conn, self.rid = server, conn, rid
        self.stop = False
        self._sent = -1.0

    def progress(self, what: str, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.stop and (now - self._sent >= self.NOTE_S or done == total):
            self._sent = now
            self._send(wire.note(self.rid, what, done, total))
        self._poll()

    def cancelled(self) -> bool:
        self._poll()
        return self.stop or self.server.engine.stopping.is_set()

    def _send(self, *frames) -> None:
        try:
            for f in frames:
                self.conn.send(f)
        except Exception as e:  # the client is gone: the job stops, its reply goes nowhere
            if not _closed(e):
                raise
            self.stop = True

    def _poll(self) -> None:
        while not self.stop:
            try:
                data = self.conn.recv(timeout=0)
            except TimeoutError:
                return
            except Exception as e:
                if not _closed(e):
                    raise
                self.stop = True
                return
            try:
                op, rid, _ = wire.check_request(data)
                if op == "cancel":
                    self.stop = True
                    head, frames = wire.reply(rid, True)
                else:
                    head, frames = wire.reply(rid, error=f"request {self.rid} is still running: only cancel is taken "
                                              "until it ends")  # fmt: skip
            except wire.WireError as e:
                head, frames = wire.reply(e.rid, error=_one_line(e))
            self._send(head, *frames)


def _one_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _closed(e: BaseException) -> bool:
    from websockets.exceptions import ConnectionClosed

    return isinstance(e, (ConnectionClosed, OSError))


def save_recipe(engine: Engine, path) -> str | None:
    """Write the session's recipe to ``path`` (JSON); None if no session was ever opened."""
    if engine.session is None:
        return None
    text = json.dumps(engine.session.recipe(), ensure_ascii=False, indent=1) + "\n"
    return str(outfile.write_text(path, text, mode=0o600))  # the prompt and the text: the user's only
