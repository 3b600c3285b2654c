"""A sweep: every (policy, budget) over a list of prompts, teacher-forced, to draw the frontier of
cache bytes against fidelity (KL) and against privacy (prompt tokens the cache probe recovers).

One full-cache reference runs per prompt and every lab of that prompt reads it. Work runs in
this process; torch uses the cores it is given for each forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import InspectorError
from ..session import Session
from .lab import KVLab
from .policies import QUANT, make

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
                "bytes_ratio": float(np.mean([r.bytes_ratio for r in rows])),
                "bytes_policy": float(np.mean([r.bytes_policy for r in rows])),
                "mean_kl": float(np.mean([r.mean_kl for r in rows])),
                "agreement": float(np.mean([r.agreement for r in rows])),
                "recovered_fraction": (float(sum(r.probe_recovered for r in probed) / sum(r.prompt_tokens for r in probed))
                                       if probed else None),
            })  # fmt: skip
        return out

    def to_json(self) -> dict:
        return {"format": TABLE_FORMAT, "model": self.model_name, "steps": self.steps, "prompts": self.prompts,
                "points": self.points(), "rows": [r.to_json() for r in self.rows]}  # fmt: skip


def plan(policies: Sequence[str], budgets: Sequence[int | None]) -> list[tuple[str, int | None]]:
    """(policy, budget) pairs: each eviction policy at every budget, each quantization once."""
    if not policies:
        raise InspectorError("no policies to sweep")
    out = []
    for name in policies:
        if name in QUANT:
            out.append((name, None))
        else:
            if not budgets:
                raise InspectorError(f"{name} needs budgets to sweep")
            out.extend((name, b) for b in budgets)
    return out


def sweep(lm, prompts: Sequence[str], pairs: Sequence[tuple[str, int | None]], steps: int, *, probe: bool = True,
          options: dict | None = None, progress: Callable[[int, int, str], None] | None = None) -> SweepResult:  # fmt: skip
    """Run every (policy, budget) pair over every prompt for ``steps`` teacher-forced steps.

    ``options`` go to every policy that takes them (sinks, recent, window for eviction; group,
    residual for quantization). ``progress(done, total, what)`` after each lab; raising from it
    (or Ctrl+C) stops the sweep, and nothing partial is returned.
    """
    options = dict(options or {})
    prompts = list(prompts)
    if not prompts:
        raise InspectorError("no prompts to sweep")
    # every policy is built (and checked against the model) before the first forward
    for name, budget in pairs:
        build_policy(name, budget, options).bind(lm.n_layers, lm.n_heads, lm.n_kv_heads, lm.head_dim, lm.context_length, 4)
    result = SweepResult(lm.name, int(steps), prompts)
    total, done = len(prompts) * len(pairs), 0
    for pi, prompt in enumerate(prompts):
        reference = Session(lm, prompt)
        for name, budget in pairs:
            t0 = time.perf_counter()
            lab = KVLab(lm, prompt, build_policy(name, budget, options), reference=reference)
            lab.run_steps(steps)
            s = lab.summary()
            row = SweepRow(name, budget, pi, s["steps"], s["mean_kl"], s["max_kl"], s["agreement"],
                           s["first_divergence"], s["bytes_policy"], s["bytes_full"], lab.run.prompt_length)  # fmt: skip
            if probe:
                pr = lab.probe()
                row.probe_held, row.probe_recovered = pr.held, pr.recovered
            row.seconds = time.perf_counter() - t0
            result.rows.append(row)
            done += 1
            if progress is not None:
                progress(done, total, f"{name}{'' if budget is None else f' budget {budget}'}, prompt {pi + 1}")
    return result


def build_policy(name: str, budget: int | None, options: dict | None = None):
    """``make(name, budget, ...)`` with the options that policy takes (the rest are ignored)."""
    options = options or {}
    keys = ("group", "residual", "scheme") if name in QUANT else ("sinks", "recent", "window", "kernel", "layer_budgets")
    return make(name, budget, **{k: v for k, v in options.items() if k in keys and v is not None})
