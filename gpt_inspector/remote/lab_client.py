"""The client's half of the KV cache lab and compare on the engine (``labs`` is the engine's).

``RemoteLabs`` is mixed into ``client.RemoteSession``: ``remote_kvlab(...)`` starts a lab on the
engine and returns a ``RemoteLab``, which the window's lab panel and ``gpt-inspector kv-lab
--connect`` read as they read a ``KVLab`` (``history`` of ``LabStep``, ``step``, ``step_back``,
``probe``, ``summary``); ``remote_compare(...)`` returns a ``Comparison`` whose search stays on the
engine (``beam_client.RemoteSearch``: an inspected beam is read there). A long job's progress notes reach ``progress`` as
they come; ``cancelled`` is asked every ``POLL_S`` while it runs, and once it says True the engine
is told to stop (a lab run keeps the steps it made; anything else ends with ``Cancelled``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import fields
from types import SimpleNamespace

import torch

from ..core.errors import Cancelled, InspectorError
from . import wire

POLL_S = 0.1  # how often a waiting client asks ``cancelled``


class RemoteLabs:
    """The lab and compare over the link (see the module docstring)."""

    # the client's
    _conn: object
    _next_id: int
    bytes_sent: int
    bytes_received: int
    requests: int
    model_name: str
    _cancel_sent = False

    def _call_t(self, op: str, _job=None, **args) -> tuple[object, list[torch.Tensor]]:
        raise NotImplementedError

    def _require(self) -> None:
        raise NotImplementedError

    def _await_reply(self, rid: int, progress, cancelled) -> tuple[str, int | None]:
        """(the job's reply header, the id of a cancel whose answer is still to come): called by
        ``_call_t`` under its lock, with the request sent; notes go to ``progress`` meanwhile."""
        conn = self._conn
        cid, acked = None, True
        self._cancel_sent = False
        while True:
            try:
                data = conn.recv(timeout=POLL_S)  # type: ignore[attr-defined]
            except TimeoutError:
                data = None
            if data is not None:
                self.bytes_received += len(data.encode()) if isinstance(data, str) else len(data)
                note = wire.check_note(data, rid)
                if note is None:
                    if cid is not None and not acked and _id_of(data) == cid:
                        wire.check_reply(data, cid)  # the engine took the cancel; the job's reply follows
                        acked = True
                        continue
                    return data, None if acked else cid
                if progress is not None:
                    progress(*note)
            if cid is None and cancelled is not None and cancelled():
                self._next_id += 1
                cid, acked = self._next_id, False
                msg = wire.request("cancel", cid, {})
                self.requests += 1
                conn.send(msg)  # type: ignore[attr-defined]
                self.bytes_sent += len(msg.encode())
                self._cancel_sent = True

    def _read_ack(self, cid: int) -> None:
        """The answer to a cancel the engine read after its job had ended (it comes after the job's reply)."""
        data = self._conn.recv()  # type: ignore[attr-defined]
        self.bytes_received += len(data.encode()) if isinstance(data, str) else len(data)
        wire.check_reply(data, cid)

    def _job(self, op: str, progress=None, cancelled=None, **args) -> tuple[object, list[torch.Tensor]]:
        try:
            return self._call_t(op, _job=(progress, cancelled), **args)
        except Cancelled:
            raise
        except InspectorError as e:
            if self._cancel_sent and "cancelled" in str(e):
                raise Cancelled(str(e)) from None
            raise

    # ------------------------------------------------------------------ compare
    def remote_compare(self, progress: Callable[[str, int, int], None] | None = None,
                       cancelled: Callable[[], bool] | None = None, **settings):  # fmt: skip
        """``core.compare.compare`` on the engine's session's prompt, with ``compare``'s keyword
        arguments (``assistant``: a draft model's folder on the engine's machine); its ``search`` reads the engine's (``beam_client``)."""
        from ..core import decoding
        from ..core.compare import Comparison

        self._require()
        if settings.get("assistant") is not None and not isinstance(settings["assistant"], str):
            raise InspectorError("over the link the assistant model is the folder of a draft on the engine's machine")
        early = settings.pop("early_stopping", False)
        args = {k: v for k, v in settings.items() if v is not None}
        args["early_stopping"] = {False: "false", True: "true"}.get(early, str(early))  # type: ignore[call-overload]
        if args.get("samples", int(bool(args.pop("sample", False)))):
            args.setdefault("samples", 1)
            for t in args.get("temperatures", [args.get("temperature", 1.0)]):  # compare's own words, before sending
                decoding.validate(t, args.get("top_k"), args.get("top_p"))
        else:
            args.pop("temperatures", None)  # unused without samples (and maybe no numbers JSON allows)
        if "temperatures" in args:
            args["temperatures"] = [float(t) for t in args["temperatures"]]
        out: dict = self._job("compare", progress, cancelled, **args)[0]  # type: ignore[assignment]
        names = {f.name for f in fields(Comparison)} - {"search"}
        keep = {k: out[k] for k in names if k in out}
        from .beam_client import RemoteSearch

        search = RemoteSearch(self, out["compare"], len(out["beams"]))  # type: ignore[arg-type]  # the beams stay there
        return Comparison(**{"sampled": None, "samples": [], "warnings": [], "chat": None, "assisted": None, **keep,
                             "search": search})  # fmt: skip

    # ------------------------------------------------------------------ the KV cache lab
    def remote_kvlab(self, policy: str, budget: int | None = None, steps: int = 8, free_running: bool = False,
                     options: dict | None = None, progress=None, cancelled=None) -> RemoteLab:  # fmt: skip
        """A KV lab run on the engine from its session's prompt, decoding and seed, ``steps`` steps on."""
        self._require()
        opts = dict(options or {})
        if opts.get("schedule") is not None:
            opts["schedule"] = str(opts["schedule"])
        if opts.get("layer_budgets"):
            opts["layer_budgets"] = [[int(k), *(v if isinstance(v, (list, tuple)) else [v])]
                                     for k, v in opts["layer_budgets"].items()]  # fmt: skip
        head, tensors = self._job("kvlab_run", progress, cancelled, policy=str(policy), budget=budget,
                                  steps=int(steps), free_running=bool(free_running), options=opts or None)  # fmt: skip
        lab = RemoteLab(self.link)  # type: ignore[attr-defined]  # the lab's own ops name no run
        lab._take(head, tensors)  # type: ignore[arg-type]
        return lab

    def remote_sweep(self, prompts: list[str], pairs: list[tuple[str, int | None]], steps: int, probe: bool = True,
                     options: dict | None = None, progress: Callable[[int, int, str], None] | None = None):  # fmt: skip
        """``core.kvlab.sweep.sweep`` on the engine's model, lab after lab (its needle check and
        workers excepted): each prompt opens a fresh greedy session there (seed 0, as the sweep's
        reference), each (policy, budget) runs ``steps`` teacher-forced steps and, with ``probe``,
        the cache probe. A ``SweepResult`` whose rows are the local sweep's numbers."""
        import time

        from ..core.kvlab import registry
        from ..core.kvlab.sweep import SweepResult, SweepRow, build_policy

        options = dict(options or {})
        prompts = list(prompts)
        if not prompts:
            raise InspectorError("no prompts to sweep")
        for name, budget in pairs:  # refused here, in one line, before the engine runs anything
            build_policy(name, budget, options)
        result = SweepResult(self.model_name, int(steps), prompts, options=options)
        total, done = len(prompts) * len(pairs), 0
        for pi, prompt in enumerate(prompts):
            self.open(prompt)  # type: ignore[attr-defined]  # the client's: the engine's session is this prompt's
            n_prompt = len(self.prompt_ids)  # type: ignore[attr-defined]
            for name, budget in pairs:
                t0 = time.perf_counter()
                keys = registry.options(name)  # each policy gets the options it takes, as build_policy gives them
                opts = {k: v for k, v in options.items() if k in keys and v is not None}
                lab = self.remote_kvlab(name, budget, int(steps), False, opts)
                sm = lab.summary()
                row = SweepRow(name, budget, pi, sm["steps"], sm["mean_kl"], sm["max_kl"], sm["agreement"],
                               sm["first_divergence"], sm["bytes_policy"], sm["bytes_full"], n_prompt,
                               bytes_paged=sm["bytes_paged"], bytes_full_paged=sm["bytes_full_paged"])  # fmt: skip
                if probe:
                    pr = lab.probe()
                    row.probe_held, row.probe_recovered = pr.held, pr.recovered
                row.seconds = time.perf_counter() - t0
                result.rows.append(row)
                done += 1
                if progress is not None:
                    progress(done, total, f"{name}{'' if budget is None else f' budget {budget}'}, prompt {pi + 1}")
        return result


class RemoteLab:
    """A KV lab that runs on the engine, as ``KVLab``'s readers see one (see the module docstring).
    Its runs stay there: ``run`` and ``reference`` are None here."""

    run = reference = None

    def __init__(self, client: RemoteLabs):
        self._client = client
        self.lm = SimpleNamespace(name=client.model_name)  # what a figure's heading names
        self.history: list = []
        self.id = -1
        self.stopped = False  # the last Run was cancelled before its last step
        self._run = None  # the policy run's mirror, once Show policy run asked for it

    def policy_run(self):
        """The lab's policy run on the engine as a run source here (Show policy run): a
        ``run_view.RemotePolicyRun``, one per lab, so that showing it again shows the same run."""
        from .run_view import RemotePolicyRun

        if self._run is None:
            self._run = RemotePolicyRun(self._client, self.id, self.policy.describe(), self.policy.kind)  # type: ignore[arg-type]
        return self._run

    def _take(self, d: dict, tensors: list[torch.Tensor]) -> None:
        from .labs import lab_step

        lost = tensors[0].numpy() if tensors else None  # (n, L, H)
        if lost is None or lost.shape[0] != len(d["steps"]):
            raise InspectorError("the engine sent a malformed KV lab reply")
        self.id = d["lab"]
        self.policy = SimpleNamespace(describe=lambda text=d["policy"]: text, kind=d["kind"])
        self.free_running, self.finished, self.stopped = d["free_running"], d["finished"], d["stopped"]
        self._summary = d["summary"]
        self.history = self.history[: d["steps_from"]] + [lab_step(x, lost[i]) for i, x in enumerate(d["steps"])]
        if len(self.history) != d["n_steps"]:
            raise InspectorError("the KV lab here is out of step with the engine's: press Run")
        if self._run is not None and "run" in d:  # a lab step or back moved the policy run a window may show
            self._run.follow(d["run"])

    def _do(self, op: str, progress=None, cancelled=None):
        return self._client._job(op, progress, cancelled, lab=self.id)

    @property
    def first_divergence(self) -> int | None:
        return self._summary["first_divergence"]

    @property
    def parted_at(self) -> int | None:
        return self._summary["parted_at"]

    def summary(self) -> dict:
        return dict(self._summary)

    def step(self):
        self._take(*self._client._call_t("kvlab_step", lab=self.id))  # type: ignore[arg-type]
        return self.history[-1]

    def steps(self, n: int):
        for _ in range(int(n)):
            if self.finished:
                return
            yield self.step()

    def step_back(self):
        if not self.history:
            raise InspectorError("nothing to step back: the lab is at its prompt (no lab step has run)")
        last = self.history[-1]
        self._take(*self._client._call_t("kvlab_back", lab=self.id))  # type: ignore[arg-type]
        return last

    def probe(self, progress=None, cancelled=None):
        """The cache probe on layer 0 of the policy's cache, run on the engine: a ``PrivacyResult``."""
        from ..core.kvlab.lab import PrivacyResult
        from ..core.probe import PositionProbe

        step = None if progress is None else (lambda _what, done, total: progress(done, total))
        r: dict = self._do("kvlab_probe", step, cancelled)[0]  # type: ignore[assignment]
        return PrivacyResult(r["prompt_tokens"], r["held"], r["recovered"], r["text"],
                             [PositionProbe(**p) for p in r["positions"]])  # fmt: skip

    def final_rows(self) -> dict:
        """``kvlab.lab.final_rows`` of the engine's lab: its evicted rows or its rows' quantization error."""
        return self._client._call_t("kvlab_rows", lab=self.id)[0]  # type: ignore[return-value]


def _id_of(data) -> object:
    try:
        head = json.loads(data) if isinstance(data, str) else None
    except ValueError:
        return None
    return head.get("id") if isinstance(head, dict) else None


__all__ = ["POLL_S", "RemoteLab", "RemoteLabs"]
