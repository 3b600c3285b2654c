"""The KV cache lab and compare, run on the engine: only what their panels show comes back.

Mixed into ``server.Engine`` like ``reads.ReadOps``. The lab lives here, beside the session it was
started from (one at a time, named by a number so that a client never steps a lab another Run
replaced); each reply carries the lab steps that changed (their per-layer bytes and counts as JSON,
the (n, L, H) lost attention mass as one float64 tensor), its summary, and where it stands; a Step or
Back also what it changed of the policy run, which a request naming it (``policy_run``, ``run_view``)
reads and steps as the session's requests do (Show policy run; ``op_policy_rows``: what the KV cache
view marks). Compare answers ``Comparison.to_json()``: every row, score, token id and text, and both
trees; the comparison stays here too (the last one, named by a number), so that a read naming one of
its beams (``wire.BEAM_OPS``, ``beam_view``) is answered from that beam as the session's reads are. A
draft model (``assistant``) is a folder on this machine, loaded here as ``session_ops`` loads one.

The long ones (``wire.JOB_OPS``) get a ``job`` from the server: ``job.progress(what, done, total)``
sends a note to the client and reads a cancel it sent meanwhile; ``job.cancelled()`` says whether
one came (or the engine is shutting down). A cancelled lab run keeps the steps it made; a
cancelled comparison ends with ``Cancelled``.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..core.errors import Cancelled, InspectorError
from .wire import RUN_SELECTORS

if TYPE_CHECKING:
    from ..core.beams import BeamView
    from ..core.compare import Comparison
    from ..core.kvlab import KVLab
    from ..core.session import Session

# LabStep's fields that travel as JSON (``lost_mass`` travels as a tensor)
STEP_FIELDS = ("index", "position", "reference_token", "policy_token", "fed_token", "kl", "agree", "bytes_policy",
               "bytes_full", "evicted_now", "reference_label", "policy_label", "bytes_kept", "bytes_paged",
               "bytes_full_paged", "page")  # fmt: skip
BEAM_GONE = (
    "that comparison is no longer on the engine (a later Compare replaced it, or the engine restarted): press Compare"
)
GONE = "that KV lab is no longer on the engine (a later Run replaced it, or the engine restarted): press Run"


class Job:
    """What a job op sees of the link when none is there (a direct call, a test): no notes, no cancel."""

    def progress(self, what: str, done: int, total: int) -> None:
        pass

    def cancelled(self) -> bool:
        return False


class LabOps:
    """The lab's and compare's ops (see the module docstring)."""

    lm: object
    lab: KVLab | None = None
    lab_id = 0
    comparison: Comparison | None = None  # the last one, kept for its beams (named by ``compare_id``)
    compare_id = 0
    _beams: dict[int, BeamView] = {}

    def _s(self) -> Session:  # server.Engine's
        raise NotImplementedError

    # ------------------------------------------------------------------ the KV cache lab
    def op_kvlab_run(self, policy, steps, budget=None, free_running=False, options=None, job=None):
        """A fresh lab from the session's prompt, decoding and seed (as the window's lab panel starts one)."""
        from ..core.kvlab import KVLab, make, registry
        from ..core.kvlab.serving import check_schedule

        job = job or Job()
        s = self._s()
        opts = {k: v for k, v in (options or {}).items() if v is not None}
        unused = [k for k in opts if k not in registry.options(policy)]
        if unused:
            raise InspectorError(f"{policy} is a {registry.kind(policy)} policy: it does not take {', '.join(unused)}")
        if "schedule" in opts:
            opts["schedule"] = check_schedule(opts["schedule"])
        if "layer_budgets" in opts:  # [layer, n] or [layer, n per KV head...]
            if any(len(x) < 2 for x in opts["layer_budgets"]):
                raise InspectorError("layer_budgets: each entry is [layer, budget] or [layer, budget per KV head...]")
            opts["layer_budgets"] = {x[0]: x[1] if len(x) == 2 else list(x[1:]) for x in opts["layer_budgets"]}
        d = s.decoding
        lab = KVLab(self.lm, policy=make(policy, budget, **opts), prompt_ids=list(s.prompt_ids),
                    free_running=free_running, temperature=d.temperature, top_k=d.top_k, top_p=d.top_p, seed=s.seed)  # fmt: skip
        self.lab, self.lab_id = lab, self.lab_id + 1
        job.progress(policy, 0, steps)
        stopped = False
        for i, _ in enumerate(lab.steps(steps), 1):
            job.progress(policy, i, steps)
            if i < steps and job.cancelled():  # the steps made so far stay: the lab goes on from them
                stopped = True
                break
        return self._lab_reply(0, stopped)

    def _lab(self, lab: int) -> KVLab:
        if self.lab is None or lab != self.lab_id:
            raise InspectorError(GONE)
        return self.lab

    def op_kvlab_step(self, lab):
        the = self._lab(lab)
        # the reply carries what the step did to the policy run too, for a window that shows it
        _, run = self._changing(lambda _: the.step(), s=the.run)  # type: ignore[attr-defined]
        return self._lab_reply(len(the.history) - 1, run=run)

    def op_kvlab_back(self, lab):
        the = self._lab(lab)
        _, run = self._changing(lambda _: the.step_back(), s=the.run)  # type: ignore[attr-defined]
        return self._lab_reply(len(the.history), run=run)

    def op_kvlab_probe(self, lab, job=None):
        job = job or Job()

        def progress(done, total):
            job.progress("cache probe", done, total)
            if job.cancelled():
                raise Cancelled("the cache probe was cancelled")

        r = self._lab(lab).probe(progress=progress)
        return {"prompt_tokens": r.prompt_tokens, "held": r.held, "recovered": r.recovered, "text": r.text,
                "positions": [asdict(p) for p in r.positions]}, []  # fmt: skip

    def op_kvlab_rows(self, lab):
        from ..core.kvlab.lab import final_rows

        return final_rows(self._lab(lab)), []

    def op_policy_rows(self, layer):
        """``kvlab.policy_rows`` of the policy run named: (evicted (Hkv, T) bool[, error (2, Hkv, T) float32])."""
        from ..core.kvlab import policy_rows

        s = self._s()
        rows = policy_rows(s, s.check_layer(layer))
        if rows is None:
            if s.kv_policy is None:
                raise InspectorError("policy_rows reads a KV lab's policy run: name it (policy_run)")
            return {"error": False}, [torch.zeros((s.n_kv_heads, 0), dtype=torch.bool)]  # nothing processed yet
        evicted, error = rows
        tensors = [torch.from_numpy(np.ascontiguousarray(evicted))]
        if error is not None:
            tensors.append(torch.from_numpy(np.ascontiguousarray(error)))
        return {"error": error is not None}, tensors

    def _lab_reply(
        self, steps_from: int, stopped: bool = False, run: dict | None = None
    ) -> tuple[dict, list[torch.Tensor]]:
        lab = self.lab
        assert lab is not None
        new = lab.history[steps_from:]
        lm = self.lm
        lost = np.stack([s.lost_mass for s in new]) if new else np.zeros((0, lm.n_layers, lm.n_heads))  # type: ignore[attr-defined]
        head = {"lab": self.lab_id, "policy": lab.policy.describe(), "kind": lab.policy.kind,
                "free_running": lab.free_running, "finished": lab.finished, "stopped": stopped,
                "n_steps": len(lab.history), "steps_from": steps_from,
                "steps": [{k: getattr(s, k) for k in STEP_FIELDS} for s in new], "summary": lab.summary(),
                **({} if run is None else {"run": run})}  # fmt: skip
        return head, [torch.from_numpy(np.ascontiguousarray(lost, dtype=np.float64))]  # (n, L, H)

    # ------------------------------------------------------------------ compare
    def op_compare(self, job=None, early_stopping="false", **settings):
        """``core.compare.compare`` on the session's prompt; its JSON (every row, score, token and tree)."""
        from ..core.compare import compare

        job = job or Job()
        total = settings.get("max_new_tokens") or 0

        def progress(what, step):
            job.progress(what, step + 1, total)
            if job.cancelled():
                raise Cancelled("the comparison was cancelled")

        early = {"false": False, "true": True}.get(early_stopping, "never")
        if settings.get("assistant") is not None:  # a folder on this machine, loaded here (session_ops)
            settings["assistant"] = self._draft(settings["assistant"])  # type: ignore[attr-defined]
        result = compare(self.lm, prompt_ids=list(self._s().prompt_ids), early_stopping=early, progress=progress,
                         **settings)  # fmt: skip
        # kept, like the lab, so that a returned beam can be inspected (read as the session is read)
        self.comparison, self.compare_id, self._beams = result, self.compare_id + 1, {}
        return {**result.to_json(), "compare": self.compare_id}, []

    def run_view(self, args: dict):
        """The run a request names in place of the session (popped from ``args``; ``wire.RUN_SELECTORS``):
        a returned beam of the last comparison, the last lab's policy run, or None (the session)."""
        named = {k: args.pop(k) for k in RUN_SELECTORS if k in args}
        if len(named) > 1:
            raise InspectorError(f"a request names one run: {' or '.join(RUN_SELECTORS)}, not both")
        if "beam" in named:
            return self.beam_view(named["beam"])
        if "policy_run" in named:
            return self._lab(named["policy_run"]).run
        return None

    def beam_view(self, beam: list[int]) -> BeamView:
        """Returned beam ``r`` of comparison ``c`` (``beam = [c, r]``), one view per beam: the reads
        that name it (``wire.BEAM_OPS``) read it instead of the session."""
        if len(beam) != 2:
            raise InspectorError("beam names a comparison and one of its beams: [comparison, beam]")
        c, r = beam
        if self.comparison is None or c != self.compare_id:
            raise InspectorError(BEAM_GONE)
        if not 0 <= r < len(self.comparison.beams):
            raise InspectorError(f"beam must be in [0, {len(self.comparison.beams)}), got {r}")
        if r not in self._beams:
            self._beams[r] = self.comparison.beam_view(r)
        return self._beams[r]


def lab_step(d: dict, lost: np.ndarray):
    """A ``LabStep`` from its JSON fields and its (L, H) lost mass: the engine's, field for field."""
    from ..core.kvlab.lab import LabStep

    names = {f.name for f in fields(LabStep)}
    if set(d) != set(STEP_FIELDS) or not set(STEP_FIELDS) < names:
        raise InspectorError("the engine sent a malformed KV lab step")
    return LabStep(**d, lost_mass=lost)
