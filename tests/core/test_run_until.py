"""Run rules and editing decisions, without Qt: the window's worker only calls these."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from gpt_inspector import MaskEdit, Session
from gpt_inspector.core.breakpoints import Breakpoints, Progress, Stopped, finish, run_until
from gpt_inspector.core.edits import restart_starts_new_session, toggle_cells
from gpt_inspector.core.errors import InspectorError


@dataclass
class FakeSession:
    """Steps through scripted (text, prob, entropy) choices; EOS when the text is "<eos>"."""

    script: list = field(default_factory=lambda: [("a", 0.9, 0.5)] * 50)
    context_length: int = 20
    steps_done: list = field(default_factory=list)
    finished: str | None = None

    @property
    def lm(self):
        return SimpleNamespace(context_length=self.context_length)

    @property
    def n_steps(self) -> int:
        return len(self.steps_done)

    def step(self):
        text, prob, ent = self.script[self.n_steps]
        st = SimpleNamespace(index=self.n_steps, token_text=text, prob=prob, entropy=ent)
        self.steps_done.append(st)
        self.finished = "eos" if text == "<eos>" else None
        return st

    def step_back(self):
        self.steps_done.pop()
        self.finished = None


def _drive(run):
    events = []
    return events, finish(run, events.append)


def test_runs_max_steps_and_yields_after_each():
    s = FakeSession()
    events, stop = _drive(run_until(s, max_steps=5))
    assert [(e.done, e.planned) for e in events] == [(i, 5) for i in range(1, 6)]
    assert all(e.step is not None for e in events)
    assert stop == Stopped("count", "ran 5 steps", 5) and s.n_steps == 5


def test_without_max_steps_it_runs_to_the_context_length():
    s = FakeSession(context_length=7)
    _, stop = _drive(run_until(s))
    assert s.n_steps == 7 and stop.kind == "count"


def test_a_breakpoint_stops_after_the_step_that_hit_it():
    s = FakeSession(script=[("a", 0.9, 0.1), ("b", 0.9, 0.1), ("c.", 0.9, 0.1), ("d", 0.9, 0.1)])
    events, stop = _drive(run_until(s, max_steps=4, breakpoints=Breakpoints(token_text=".")))
    assert s.n_steps == 3 and len(events) == 3
    assert stop.kind == "breakpoint" and stop.reason.startswith("breakpoint at step 3: token 'c.'")
    s = FakeSession(script=[("a", 0.9, 0.1), ("b", 0.2, 4.0)] * 3)
    assert (
        finish(run_until(s, max_steps=6, breakpoints=Breakpoints(prob_below=0.5))).reason
        == "breakpoint at step 2: p=0.200 < 0.5"
    )
    s = FakeSession(script=[("a", 0.9, 0.1), ("b", 0.2, 4.0)] * 3)
    assert "entropy 4.000 > 3" in finish(run_until(s, max_steps=6, breakpoints=Breakpoints(entropy_above=3.0))).reason
    assert not Breakpoints().active and Breakpoints(prob_below=0.0).active


def test_eos_ends_a_run_and_a_finished_session_takes_no_step():
    s = FakeSession(script=[("a", 0.9, 0.1), ("<eos>", 0.9, 0.1)])
    stop = finish(run_until(s, max_steps=10))
    assert s.n_steps == 2 and stop == Stopped("finished", "end of text (EOS)", 2)
    stop = finish(run_until(s, max_steps=10))
    assert s.n_steps == 2 and stop.kind == "finished" and stop.done == 0


def test_cancel_pauses_between_steps():
    s = FakeSession()
    run = run_until(s, max_steps=10, cancelled=lambda: s.n_steps >= 3)
    stop = finish(run)
    assert stop == Stopped("paused", "paused", 3) and s.n_steps == 3


def test_target_steps_forward_or_back():
    s = FakeSession()
    events, stop = _drive(run_until(s, target=6))
    assert s.n_steps == 6 and stop == Stopped("target", "reached step 6", 6)
    assert events[-1] == Progress(6, 6, s.steps_done[-1])
    events, stop = _drive(run_until(s, target=2))
    assert s.n_steps == 2 and stop.reason == "reached step 2"
    assert [(e.done, e.planned, e.step) for e in events] == [(1, 4, None), (2, 4, None), (3, 4, None), (4, 4, None)]
    assert finish(run_until(s, target=2)).done == 0


def test_bad_counts_are_refused():
    s = FakeSession()
    with pytest.raises(InspectorError, match="max_steps"):
        finish(run_until(s, max_steps=False))  # what QAction.triggered(checked=False) once passed
    with pytest.raises(InspectorError, match="target"):
        finish(run_until(s, target=-1))
    assert s.n_steps == 0


def test_run_until_on_a_real_session_matches_session_run(tiny_lm):
    lm = tiny_lm("gpt2")
    a, b = Session(lm, "She eats an apple"), Session(lm, "She eats an apple")
    stop = finish(run_until(a, max_steps=4))
    b.run(4)
    assert a.tokens == b.tokens and stop.done == a.n_steps
    finish(run_until(a, target=1))
    assert a.tokens == b.tokens[: len(a.tokens)] and a.n_steps == 1


# ---------------------------------------------------------------------- editing decisions
def test_toggle_blocks_then_unblocks_the_same_cell():
    edits = toggle_cells([], [(3, 1)], layer=1, head=2)
    assert edits == [MaskEdit(3, 1, 1, 2)]
    assert toggle_cells(edits, [(3, 1)], layer=1, head=2) == []


def test_toggle_scopes_and_the_causal_diagonal():
    assert toggle_cells([], [(3, 0), (3, 5), (2, 2)], 1, 2, "layer") == [
        MaskEdit(3, 0, 1, None),
        MaskEdit(2, 2, 1, None),
    ]
    assert toggle_cells([], [(3, 0)], 1, 2, "all") == [MaskEdit(3, 0, None, None)]
    assert toggle_cells([MaskEdit(1, 0)], [(0, 4)], 0, 0) == [MaskEdit(1, 0)]  # nothing below the diagonal
    with pytest.raises(InspectorError, match="scope"):
        toggle_cells([], [(1, 0)], 0, 0, "model")


def test_a_drag_follows_its_first_cell_and_keeps_other_scopes():
    other = MaskEdit(4, 0, 0, None)  # a layer-wide edit: a head-scope drag leaves it alone
    start_free = toggle_cells([other, MaskEdit(4, 2, 0, 1)], [(4, 1), (4, 2), (4, 2), (4, 3)], 0, 1)
    assert start_free == [other, MaskEdit(4, 2, 0, 1), MaskEdit(4, 1, 0, 1), MaskEdit(4, 3, 0, 1)]
    start_blocked = toggle_cells(start_free, [(4, 2), (4, 3), (4, 0)], 0, 1)
    assert start_blocked == [other, MaskEdit(4, 1, 0, 1)]
    assert toggle_cells(start_blocked, [(4, 1)], 0, 1, block=True) == start_blocked  # already blocked


def test_restart_keeps_the_session_unless_prompt_or_seed_changed():
    cur = SimpleNamespace(prompt="Hi there", seed=3)
    assert not restart_starts_new_session(cur, None)
    assert not restart_starts_new_session(cur, SimpleNamespace(prompt="Hi there", seed=3, temperature=2.0))
    assert restart_starts_new_session(cur, SimpleNamespace(prompt="Hi", seed=3))
    assert restart_starts_new_session(cur, SimpleNamespace(prompt="Hi there", seed=4))
