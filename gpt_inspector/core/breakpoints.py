"""Running a session until something worth a look: a step count, a target step, a breakpoint, a pause.

``run_until`` is a generator so that any front end (the window's worker, a script, a notebook)
decides what to do between steps (publish a snapshot, update a progress bar, check a cancel
flag) while the stop rules live in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

from . import validate

FINISHED = {"eos": "end of text (EOS)", "context": "context is full"}


@dataclass(frozen=True)
class Breakpoints:
    """Conditions checked after every step of a run; ``None`` disables a condition."""

    token_text: str | None = None  # the chosen token's text contains this
    prob_below: float | None = None
    entropy_above: float | None = None

    def check(self, step) -> str | None:
        if self.token_text and self.token_text in step.token_text:
            return f"token {step.token_text!r} matches {self.token_text!r}"
        if self.prob_below is not None and step.prob < self.prob_below:
            return f"p={step.prob:.3f} < {self.prob_below:g}"
        if self.entropy_above is not None and step.entropy > self.entropy_above:
            return f"entropy {step.entropy:.3f} > {self.entropy_above:g}"
        return None

    @property
    def active(self) -> bool:
        return bool(self.token_text) or self.prob_below is not None or self.entropy_above is not None


@dataclass(frozen=True)
class Progress:
    """Yielded after every step (or step back) of a run."""

    done: int  # steps (or steps back) taken so far
    planned: int  # at most this many in all
    step: object | None = None  # the Step just taken; None after a step back


@dataclass(frozen=True)
class Stopped:
    """Why a run ended: ``kind`` is one of paused, breakpoint, finished, target, count."""

    kind: str
    reason: str  # one line for a status bar
    done: int


def run_until(session, *, max_steps: int | None = None, target: int | None = None,
              breakpoints: Breakpoints | None = None,
              cancelled: Callable[[], bool] = lambda: False) -> Generator[Progress, None, Stopped]:  # fmt: skip
    """Step (or step back, towards ``target``) and yield a :class:`Progress` after each step.

    Without ``target`` it steps ``max_steps`` times (default: the context length), stopping early
    at EOS, a full context, a breakpoint or when ``cancelled()`` says so. With ``target`` it steps
    back or forward until ``session.n_steps == target``. The generator's return value (see
    :func:`finish`) is a :class:`Stopped`.
    """
    if target is not None:
        target = validate.integer("target step", target, 0)
    if max_steps is not None:
        max_steps = validate.integer("max_steps", max_steps, 0)
    done = 0
    if target is not None and session.n_steps > target:
        planned = session.n_steps - target
        while session.n_steps > target:
            if cancelled():
                return Stopped("paused", "paused", done)
            session.step_back()
            done += 1
            yield Progress(done, planned)
        return Stopped("target", f"reached step {session.n_steps}", done)
    if target is not None:
        planned = target - session.n_steps
    else:
        planned = max_steps if max_steps is not None else session.context_length
    while done < planned:
        if cancelled():
            return Stopped("paused", "paused", done)
        if session.finished:
            break
        st = session.step()
        done += 1
        yield Progress(done, planned, st)
        hit = breakpoints.check(st) if breakpoints is not None else None
        if hit:
            return Stopped("breakpoint", f"breakpoint at step {st.index + 1}: {hit}", done)
    if session.finished:
        return Stopped("finished", FINISHED.get(session.finished, session.finished), done)
    if target is not None:
        return Stopped("target", f"reached step {session.n_steps}", done)
    return Stopped("count", f"ran {done} steps", done)


def finish(run: Generator[Progress, None, Stopped], each: Callable[[Progress], None] = lambda p: None) -> Stopped:
    """Drive ``run`` to its end, calling ``each(progress)`` between steps; return why it stopped."""
    while True:
        try:
            each(next(run))
        except StopIteration as stop:
            return stop.value
