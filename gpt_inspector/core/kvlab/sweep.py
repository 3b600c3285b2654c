"""A sweep: every (policy, budget) over a list of prompts, teacher-forced, to draw the frontier of
cache bytes against fidelity (KL) and against privacy (prompt tokens the cache probe recovers).

One full-cache reference runs per prompt and every lab of that prompt reads it. With ``jobs=1``
the work runs in this process; with ``jobs=N`` the (prompt, policy, budget) labs run in N worker
processes (spawned, each loading the model the same way and using cores // N torch threads),
each keeping its current prompt's reference; the rows come back in the same order with the same
numbers.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import InspectorError
from ..session import Session
from . import registry
from .lab import KVLab
from .policy import make

TABLE_FORMAT = "gpt-inspector-kvlab-sweep/1"


@dataclass
class SweepRow:
    policy: str
    budget: int | None
    prompt: int  # index into the prompts
    steps: int
    mean_kl: float
    max_kl: float
    agreement: float
    first_divergence: int | None
    bytes_policy: int
    bytes_full: int
    prompt_tokens: int
    probe_held: int | None = None
    probe_recovered: int | None = None
    seconds: float = 0.0
    bytes_paged: int | None = None  # as a paged cache of the policy's page size allocates them
    bytes_full_paged: int | None = None

    @property
    def bytes_ratio(self) -> float:
        return self.bytes_policy / self.bytes_full if self.bytes_full else 1.0

    def to_json(self) -> dict:
        return {**self.__dict__, "bytes_ratio": self.bytes_ratio}


@dataclass
class SweepResult:
    model_name: str
    steps: int
    prompts: list[str]
    rows: list[SweepRow] = field(default_factory=list)
    options: dict = field(default_factory=dict)
    # (policy, budget) -> the needle check (``needle``), where the sweep ran it
    needles: dict = field(default_factory=dict)

    def points(self) -> list[dict]:
        """One point per (policy, budget): means over the prompts."""
        groups: dict[tuple, list[SweepRow]] = {}
        for r in self.rows:
            groups.setdefault((r.policy, r.budget), []).append(r)
        out = []
        for (policy, budget), rows in groups.items():
            probed = [r for r in rows if r.probe_recovered is not None]
            out.append({
                "policy": policy, "budget": budget, "prompts": len(rows),
                **{k: float(np.mean([getattr(r, k) for r in rows])) for k in ("bytes_ratio", "bytes_policy", "mean_kl", "agreement")},
                "recovered_fraction": (float(sum(r.probe_recovered or 0 for r in probed) / sum(r.prompt_tokens for r in probed))
                                       if probed else None),
                **self._needle_point(policy, budget),
            })  # fmt: skip
        return out

    def _needle_point(self, policy: str, budget) -> dict:
        got = self.needles.get((policy, budget))
        if got is None:
            return {}
        return {"needle_found": got.found / len(got.cases), "needle_same": got.same / len(got.cases),
                "needle_reference_found": got.reference_found / len(got.cases)}  # fmt: skip

    def to_json(self) -> dict:
        out = {"format": TABLE_FORMAT, "model": self.model_name, "steps": self.steps, "prompts": self.prompts,
               "options": {k: v for k, v in self.options.items() if k != "layer_budgets"},
               "points": self.points(), "rows": [r.to_json() for r in self.rows]}  # fmt: skip
        if self.needles:
            out["needle"] = [{"budget": b, **r.to_json()} for (_, b), r in self.needles.items()]
        return out


def plan(policies: Sequence[str], budgets: Sequence[int | None]) -> list[tuple[str, int | None]]:
    """(policy, budget) pairs: each eviction policy at every budget, each quantization once."""
    if not policies:
        raise InspectorError("no policies to sweep")
    out: list[tuple[str, int | None]] = []
    for name in policies:
        if not registry.takes_budget(name):
            out.append((name, None))
        else:
            if not budgets:
                raise InspectorError(f"{name} needs budgets to sweep")
            out.extend((name, b) for b in budgets)
    return out


def check_jobs(jobs, what: str = "jobs") -> int:
    """``jobs`` as a number of worker processes: 1 to the machine's core count."""
    cores = os.cpu_count() or 1
    if isinstance(jobs, bool) or not isinstance(jobs, (int, np.integer)) or not 1 <= jobs <= cores:
        raise InspectorError(f"{what} must be a whole number from 1 to {cores} (this machine's cores), got {jobs!r}")
    return int(jobs)


def load_spec(lm) -> dict:
    """How a worker process loads ``lm`` again: its folder or hub id, device and dtype."""
    return {"name_or_path": lm.name, "device": str(lm.device), "dtype": str(lm.dtype).removeprefix("torch.")}


def sweep(lm, prompts: Sequence[str], pairs: Sequence[tuple[str, int | None]], steps: int, *, probe: bool = True,
          options: dict | None = None, progress: Callable[[int, int, str], None] | None = None, jobs: int = 1,
          load: dict | None = None, needle: bool = False) -> SweepResult:  # fmt: skip
    """Run every (policy, budget) pair over every prompt for ``steps`` teacher-forced steps.

    ``options`` go to every policy that takes them (sinks, recent, window for eviction; group,
    residual for quantization). ``progress(done, total, what)`` after each lab; raising from it
    (or Ctrl+C) stops the sweep (and its workers), and nothing partial is returned.
    ``jobs``: worker processes (1: this one); each loads the model with ``load_model(**load)``
    (default ``load_spec(lm)``: lm's folder or hub id, device and dtype). ``needle``: also run the
    needle check (``needle.CASES``) once per (policy, budget), in this process, after the labs.
    """
    options = dict(options or {})
    prompts = list(prompts)
    jobs = check_jobs(jobs)
    if not prompts:
        raise InspectorError("no prompts to sweep")
    # every policy is built (and checked against the model) before the first forward
    for name, budget in pairs:
        build_policy(name, budget, options).bind(
            lm.n_layers, lm.n_heads, lm.n_kv_heads, lm.head_dim, lm.context_length, 4
        )
    result = SweepResult(lm.name, int(steps), prompts, options=options)
    tasks = [(pi, name, budget) for pi in range(len(prompts)) for name, budget in pairs]
    total = len(tasks)
    work = [(i, prompts[pi], pi, name, budget, steps, probe, options) for i, (pi, name, budget) in enumerate(tasks)]
    rows: list[SweepRow | None] = [None] * total
    pool = None
    if jobs == 1 or total == 1:  # in this process, the labs one after the other as a worker runs them
        state = {"lm": lm, "reference": None}
        got = ((w[0], _row(state, *w[1:])) for w in work)
    else:
        import multiprocessing

        load = dict(load) if load is not None else load_spec(lm)
        ctx = multiprocessing.get_context("spawn")  # a fork would copy torch's thread pools and the caller's state
        threads = max(1, (os.cpu_count() or 1) // jobs)
        pool = ctx.Pool(jobs, initializer=_worker_init, initargs=(load, threads))
        got = _watched(pool, pool.imap_unordered(_worker_row, work))
    finished = False
    try:
        for done, (i, row) in enumerate(got, start=1):
            rows[i] = row
            if progress is not None:
                pi, name, budget = tasks[i]
                progress(done, total, f"{name}{'' if budget is None else f' budget {budget}'}, prompt {pi + 1}")
        finished = True
    finally:
        if pool is not None:
            if finished:
                pool.close()
            else:  # Ctrl+C, a cancel from progress() or a worker's error: stop every worker now
                pool.terminate()
            pool.join()
    result.rows.extend(r for r in rows if r is not None)  # every one, once the loop finished
    if needle:
        from . import needle as needles

        for i, (name, budget) in enumerate(pairs, start=1):
            result.needles[name, budget] = needles.check(lm, functools.partial(build_policy, name, budget, options),
                                                         name=name)  # fmt: skip
            if progress is not None:
                progress(i, len(pairs), f"needle check: {name}{'' if budget is None else f' budget {budget}'}")
    return result


def _row(state: dict, prompt: str, pi: int, name: str, budget, steps: int, probe: bool, options: dict) -> SweepRow:
    """One lab's row; ``state``: the model ("lm") and the reference kept while the prompt stays the same."""
    lm, reference = state["lm"], state["reference"]
    if reference is None or reference.prompt != prompt:
        reference = state["reference"] = Session(lm, prompt)
    t0 = time.perf_counter()
    lab = KVLab(lm, prompt, build_policy(name, budget, options), reference=reference)
    lab.run_steps(steps)
    s = lab.summary()
    row = SweepRow(name, budget, pi, s["steps"], s["mean_kl"], s["max_kl"], s["agreement"],
                   s["first_divergence"], s["bytes_policy"], s["bytes_full"], lab.run.prompt_length,
                   bytes_paged=s["bytes_paged"], bytes_full_paged=s["bytes_full_paged"])  # fmt: skip
    if probe:
        pr = lab.probe()
        row.probe_held, row.probe_recovered = pr.held, pr.recovered
    row.seconds = time.perf_counter() - t0
    return row


def _watched(pool, results):
    """``results`` as they come, stopping in one line when a worker dies (killed, out of memory): the
    pool starts a new worker but never hands out the dead one's task again, and would wait forever."""
    import multiprocessing

    workers = list(pool._pool)  # the pool offers no public view of its processes
    while True:
        try:
            yield results.next(timeout=0.5)
        except StopIteration:
            return
        except multiprocessing.TimeoutError:
            pass
        dead = next((w for w in workers if w.exitcode is not None), None)
        if dead is not None:
            code = dead.exitcode
            how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
            raise InspectorError(f"a sweep worker process died ({how}; out of memory?); the sweep stopped")


# -- worker processes (jobs > 1): the model once per worker, the current prompt's reference kept
_WORKER: dict = {}


def _worker_init(load: dict, threads: int) -> None:
    import signal

    import torch

    from ..models import load_model

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the parent's to handle: it terminates the pool
    torch.set_num_threads(threads)
    _WORKER["lm"] = load_model(**load)
    _WORKER["reference"] = None


def _worker_row(task) -> tuple[int, SweepRow]:
    i, *args = task
    return i, _row(_WORKER, *args)


def build_policy(name: str, budget: int | None, options: dict | None = None):
    """``make(name, budget, ...)`` with the options that policy takes (``registry.options``; the rest are ignored)."""
    options = options or {}
    keys = registry.options(name)
    return make(name, budget, **{k: v for k, v in options.items() if k in keys and v is not None})
