"""A beam of a comparison that ran on the engine, inspected from here (Compare's "Inspect beam").

The engine keeps its last comparison (``labs.LabOps.beam_view``); ``RemoteSearch`` stands in for
its ``BeamSearch`` in the ``Comparison`` that ``remote_compare`` returns, and its
``result_view(r)`` is a ``RemoteBeam``: a read-only ``RemoteSession`` on the same link whose every
read names the beam (``run_view.RemoteRunView``, ``wire.BEAM_OPS``), so the engine answers it from
the beam's records, as a local ``BeamView`` would, and only what the views ask for comes back.
"""

from __future__ import annotations

import torch

from ..core.errors import InspectorError
from ..core.live import Live
from .client import RemoteSession
from .run_view import RemoteRunView

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


class RemoteSearch:
    """What a remote ``Comparison`` holds in place of its search: the way to its beams on the engine."""

    remote = True  # its beams are read over the link: made on a worker thread, never on the GUI thread

    def __init__(self, client: RemoteSession, compare_id: int, n_beams: int):
        self.client, self.id, self.n_beams = client.link, compare_id, n_beams

    def result_view(self, r: int) -> RemoteBeam:
        if not 0 <= r < self.n_beams:
            raise InspectorError(f"beam must be in [0, {self.n_beams}), got {r}")
        return RemoteBeam(self.client, self.id, r)


class RemoteBeam(RemoteRunView):
    """Returned beam ``r`` of the engine's comparison ``compare_id``, read as a ``RemoteSession`` is
    read; it shares its client's link (and its lock) and changes nothing."""

    read_only = True

    def __init__(self, client: RemoteSession, compare_id: int, r: int):
        self._beam = [int(compare_id), int(r)]
        super().__init__(client, "beam", self._beam)

    def _refuse(self, op: str) -> InspectorError:
        return InspectorError(f"{op}: {READ_ONLY}")

    def _call_t(self, op: str, _job=None, **args) -> tuple[object, list[torch.Tensor]]:
        if _job is not None:
            raise self._refuse(op)
        return super()._call_t(op, **args)

    @property
    def live(self) -> Live:
        return Live({**self.refused, **BEAM_REFUSED})

    @property
    def source_name(self) -> str:
        return f"beam {self._beam[1] + 1} of a beam search on {self.where}"

    def _change(self, op: str, **args):
        raise self._refuse(op)

    def recipe(self) -> dict:
        raise InspectorError(f"recipe: {READ_ONLY}; its comparison's settings make it again")


__all__ = ["BEAM_REFUSED", "RemoteBeam", "RemoteSearch"]
