"""The sweep in N worker processes: the same rows in the same order with the same numbers as in
this process; progress after every lab; a cancel terminates the workers and returns nothing."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from gpt_inspector.core import InspectorError
from gpt_inspector.core.kvlab.sweep import check_jobs, plan, sweep

PROMPTS = ["She eats an apple. He reads a book.", "One two three four five six"]


def _numbers(rows):
    return [{k: v for k, v in r.to_json().items() if k != "seconds"} for r in rows]


def test_jobs_2_gives_jobs_1s_rows_in_order(tiny_lm):
    lm = tiny_lm("llama")
    pairs = plan(["h2o", "streaming", "int4"], [4, 9])
    one = sweep(lm, PROMPTS, pairs, 3, options={"residual": 2, "group": 4})
    seen = []
    two = sweep(lm, PROMPTS, pairs, 3, options={"residual": 2, "group": 4}, jobs=2,
                progress=lambda done, total, what: seen.append((done, total, what)))  # fmt: skip
    assert len(one.rows) == 10 and _numbers(two.rows) == _numbers(one.rows)  # same order, same numbers
    assert any(r.mean_kl > 0 for r in one.rows) and all(r.probe_recovered is not None for r in two.rows)
    assert [d for d, _, _ in seen] == list(range(1, 11)) and {t for _, t, _ in seen} == {10}
    assert two.points() == one.points() and two.to_json()["rows"][0]["seconds"] > 0
    assert not multiprocessing.active_children()  # the workers are gone


def test_a_cancel_terminates_the_workers_and_returns_nothing(tiny_lm, monkeypatch):
    import multiprocessing.pool

    terminated = []
    real = multiprocessing.pool.Pool.terminate
    monkeypatch.setattr(multiprocessing.pool.Pool, "terminate", lambda self: terminated.append(1) or real(self))
    lm = tiny_lm("gpt2")
    pairs = plan(["h2o"], [4, 6, 8, 10])

    def stop(done, total, what):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sweep(lm, PROMPTS, pairs, 3, probe=False, jobs=2, progress=stop)
    assert terminated and not multiprocessing.active_children()  # killed, not left to finish their labs


def test_a_dead_worker_stops_the_sweep_in_one_line(tiny_lm):
    import signal
    import threading

    lm = tiny_lm("gpt2")
    pairs = plan(["h2o"], [4, 5, 6, 7, 8, 9, 10, 11])
    killed = []

    def kill_a_worker(done, total, what):
        if not killed:  # the other labs are running now: the killed worker takes its lab with it
            victim = multiprocessing.active_children()[0]
            os.kill(victim.pid, signal.SIGKILL)
            killed.append(victim.pid)

    outcome = []

    def run():
        try:
            sweep(lm, PROMPTS, pairs, 6, probe=False, jobs=2, progress=kill_a_worker)
            outcome.append("finished")
        except InspectorError as e:
            outcome.append(e)

    t = threading.Thread(target=run, daemon=True)  # without the watch the pool waits forever
    t.start()
    t.join(timeout=120)
    assert killed and outcome, "the sweep still waits for the dead worker's lab"
    e = outcome[0]
    assert isinstance(e, InspectorError) and "worker process died (killed by signal 9" in str(e)
    assert "\n" not in str(e) and not multiprocessing.active_children()  # the rest terminated


@pytest.mark.parametrize("jobs", [0, -1, (os.cpu_count() or 1) + 1, 1.5, True, "2"])
def test_bad_jobs_are_refused_before_any_work(jobs, tiny_lm):
    with pytest.raises(InspectorError, match="jobs must be a whole number from 1 to"):
        sweep(tiny_lm("gpt2"), PROMPTS, plan(["h2o"], [4]), 2, jobs=jobs)
    assert check_jobs(1) == 1
