"""A beam of a comparison that ran on the engine, inspected from here (Compare's "Inspect beam").

The engine keeps its last comparison (``labs.LabOps.beam_view``); ``RemoteSearch`` stands in for
its ``BeamSearch`` in the ``Comparison`` that ``remote_compare`` returns, and its
``result_view(r)`` is a ``RemoteBeam``: a read-only ``RemoteSession`` on the same link whose every
read names the beam (``wire.BEAM_OPS``), so the engine answers it from the beam's records, as a
local ``BeamView`` would, and only what the views ask for comes back.
"""

from __future__ import annotations

import torch

from ..core.errors import InspectorError
from ..core.live import Live
from .client import RemoteSession

READ_ONLY = "a beam is read-only (it shows the search as it ran)"
# what an inspected beam does not run over the link: each refusal is the line a front end shows
BEAM_REFUSED = {
    "step": f"stepping needs a live session: {READ_ONLY}",
    "recompute": "a beam keeps every head output: nothing to recompute",
    "lens": "the logit lens needs a live session: a beam keeps no residual stream",
    "kvlab": "the KV cache lab needs a live session: it runs a session's prompt and decoding, not a beam's",
    "probe": "the cache probe runs on the engine's live session, not on a beam inspected over the link",
    "compare": "comparing decodings needs the live session: switch back to it and press Compare",
}
INFO = ("model_name", "n_layers", "n_heads", "n_kv_heads", "head_dim", "context_length", "vocab_size", "dtype",
        "unverified", "device", "note", "refused")  # fmt: skip


class RemoteSearch:
    """What a remote ``Comparison`` holds in place of its search: the way to its beams on the engine."""

    remote = True  # its beams are read over the link: made on a worker thread, never on the GUI thread

    def __init__(self, client: RemoteSession, compare_id: int, n_beams: int):
        self.client, self.id, self.n_beams = client, compare_id, n_beams

    def result_view(self, r: int) -> RemoteBeam:
        if not 0 <= r < self.n_beams:
            raise InspectorError(f"beam must be in [0, {self.n_beams}), got {r}")
        return RemoteBeam(self.client, self.id, r)


class RemoteBeam(RemoteSession):
    """Returned beam ``r`` of the engine's comparison ``compare_id``, read as a ``RemoteSession`` is
    read; it shares its client's link (and its lock) and changes nothing."""

    read_only = True

    def __init__(self, client: RemoteSession, compare_id: int, r: int):
        # no link of its own: RemoteSession.__init__ would open one
        self._client, self._beam = client, [int(compare_id), int(r)]
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

    def _call_t(self, op: str, _job=None, **args) -> tuple[object, list[torch.Tensor]]:
        if _job is not None:
            raise InspectorError(f"{op}: {READ_ONLY}")
        return self._client._call_t(op, beam=self._beam, **args)

    @property
    def live(self) -> Live:
        return Live({**self.refused, **BEAM_REFUSED})

    @property
    def source_name(self) -> str:
        return f"beam {self._beam[1] + 1} of a beam search on {self.where}"

    @property
    def link(self) -> RemoteSession:
        return self._client

    @property
    def link_alive(self) -> bool:
        return self._client.link_alive

    def close(self) -> None:  # the link is the client's
        pass

    def reconnect(self, timeout: float = 30.0, open_timeout: float | None = None) -> RemoteBeam:
        self._client.reconnect(timeout, open_timeout)
        self._take(self._call("state"))
        return self

    def _change(self, op: str, **args):
        raise InspectorError(f"{op}: {READ_ONLY}")

    def open(self, *a, **k) -> None:
        raise InspectorError(f"open: {READ_ONLY}")

    def recipe(self) -> dict:
        raise InspectorError(f"recipe: {READ_ONLY}; its comparison's settings make it again")


__all__ = ["BEAM_REFUSED", "RemoteBeam", "RemoteSearch"]
