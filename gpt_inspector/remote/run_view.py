"""Another run the engine keeps beside its session, read over the session's link: the base of an
inspected beam (``beam_client.RemoteBeam``) and of the KV lab's policy run (``RemotePolicyRun``).

The engine names such a run by a selector on the ops that may read (or step) it
(``wire.RUN_SELECTORS``): ``beam`` = [comparison, beam], ``policy_run`` = the lab's number. A
``RemoteRunView`` is a ``RemoteSession`` without a link of its own: every request goes over its
client's link (and lock), the selector added to the ops that take it; any other op that reads or
changes a session is refused here, so none of them reaches the engine's live session by mistake.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core.errors import InspectorError
from ..core.live import Live
from . import wire
from .client import RemoteSession

INFO = ("model_name", "n_layers", "n_heads", "n_kv_heads", "head_dim", "context_length", "vocab_size", "dtype",
        "unverified", "device", "note", "refused")  # fmt: skip
NEUTRAL = ("hello", "cancel", "chat_build")  # ops that read no session: they go over the link as they are


class RemoteRunView(RemoteSession):
    """A run of the engine's named by ``selector`` = {name: value} (see the module docstring)."""

    def __init__(self, client: RemoteSession, name: str, value):
        # no link of its own: RemoteSession.__init__ would open one
        self._client, self._selector, self._ops = client, {name: value}, wire.RUN_SELECTORS[name][1]
        self.url, self.where, self.timeout = client.url, client.where, client.timeout
        for k in INFO:
            setattr(self, k, getattr(client, k))
        self.bytes_sent = self.bytes_received = self.requests = 0
        self._change_mark, self.changes = 0, 0
        self._listeners, self._label_of = [], {}
        self._reset_reads()
        self.tokens, self._labels, self.steps_done = [], [], []
        self._attention_layers, self._state = [], None
        self._take(self._call("state"))

    @property
    def link(self) -> RemoteSession:
        return self._client.link

    def _refuse(self, op: str) -> InspectorError:
        return InspectorError(f"{op} is not served for this run over the link")

    def _call_t(self, op: str, _job=None, **args) -> tuple[object, list[torch.Tensor]]:
        if op in self._ops:
            args = {**args, **self._selector}
        elif op not in NEUTRAL:
            raise self._refuse(op)
        return self._client._call_t(op, _job, **args)

    @property
    def _cancel_sent(self) -> bool:  # type: ignore[override]  # a job's cancel is sent, and known, by the link's owner
        return self._client._cancel_sent

    @property
    def link_alive(self) -> bool:
        return self._client.link_alive

    def close(self) -> None:  # the link is the client's
        pass

    def reconnect(self, timeout: float = 30.0, open_timeout: float | None = None) -> RemoteRunView:
        self._client.reconnect(timeout, open_timeout)
        self._take(self._call("state"))
        return self

    def open(self, *a, **k) -> None:
        raise self._refuse("open")

    def replay(self, recipe: dict) -> None:
        raise self._refuse("replay")


# ---------------------------------------------------------------------- the KV lab's policy run
class RemotePolicy:
    """The policy run's ``kv_policy`` here: what ``core.kvlab.policy_rows`` reads of it is computed on
    the engine (its cache holds the full-precision rows a quantized row's error is measured against),
    and only the selected layer's rows come back: (Hkv, T) bool and (2, Hkv, T) float32."""

    def __init__(self, run: RemotePolicyRun, name: str, kind: str):
        self._run, self.name, self.kind = run, name, kind

    def describe(self) -> str:
        return self.name

    def rows(self, layer: int) -> tuple[np.ndarray, np.ndarray | None] | None:
        """``policy_rows(run, layer)`` as the engine computed it: (evicted, error or None)."""
        if self._run.cache_length == 0:
            return None
        head, tensors = self._run._read("policy_rows", layer=int(layer))  # kept until the run changes
        if len(tensors) != 1 + bool(head["error"]):  # type: ignore[index]
            raise InspectorError("the engine sent malformed policy rows")
        return tensors[0].numpy(), tensors[1].numpy() if len(tensors) == 2 else None

    def evicted(self, layer: int, length: int) -> torch.Tensor:
        """(Hkv, length) bool: the rows the policy's cache no longer holds, at the run's current length."""
        if length != self._run.cache_length:
            raise InspectorError("over the link the evicted rows are given at the run's current length only")
        rows = self.rows(layer)
        return torch.zeros((self._run.n_kv_heads, 0), dtype=torch.bool) if rows is None else torch.from_numpy(rows[0])


class RemotePolicyRun(RemoteRunView):
    """The engine's KV lab's policy run (lab ``lab_id``), as Show policy run puts it in a window: read
    as the session is read, stepped there as a local window steps ``lab.run`` (Step past the lab's
    last step ends the lab's own Step; Step back undoes lab steps); the lab panel's Step and Back
    bring what they did to it (``follow``)."""

    read_only = False

    def __init__(self, client: RemoteSession, lab_id: int, policy: str, kind: str):
        self.kv_policy = RemotePolicy(self, policy, kind)
        super().__init__(client, "policy_run", int(lab_id))

    def _take(self, st: dict) -> None:
        self._refused = dict(st.get("refused", {}))
        super()._take(st)

    @property
    def live(self) -> Live:
        return Live(self._refused)  # the engine's policy run's own refusals, word for word

    @property
    def source_name(self) -> str:
        return f"the KV lab's policy run ({self.kv_policy.name}) on {self.where}"

    def follow(self, sync: dict) -> None:
        """The lab stepped (or stepped back) this run on the engine: mirror it, and tell the views."""
        had = list(self.steps_done)
        self.changes += 1
        self._sync(sync)
        self._emit_changes(had)


__all__ = ["RemotePolicy", "RemotePolicyRun", "RemoteRunView"]
