"""A long mask-edit recompute reports its progress in the status bar, and Pause (Esc) cancels it,
leaving the session exactly as it was."""

from __future__ import annotations

import threading

import torch


def test_mask_edit_shows_progress_and_pause_cancels_it(make_window, wait_idle, qtbot, monkeypatch):
    from gpt_inspector.core import recompute

    monkeypatch.setattr(recompute, "RECOMPUTE_CHUNK", 2)
    win = make_window()
    win.run(8)
    wait_idle(win)
    state = {}
    win.run_in_worker(lambda s: state.update(before=(list(s.tokens), s.current.probs.clone(), s.mask_edits)))
    wait_idle(win)

    held, release = threading.Event(), threading.Event()

    def hold_second_chunk(session):  # the recompute's 2nd chunk waits until the pause is in: no race
        orig, calls = session._forward, []

        def forward(ids, keep):
            calls.append(len(ids))
            if len(calls) == 2:
                held.set()
                release.wait(20)
            return orig(ids, keep)

        session._forward = forward

    win.run_in_worker(hold_second_chunk)
    wait_idle(win)
    win.edit_cells([(1, 0)], scope="layer")
    qtbot.waitUntil(held.is_set, timeout=20000)
    qtbot.waitUntil(lambda: win.st_progress.isVisible() and win.st_progress.value() == 2, timeout=5000)
    assert "Recomputing" in win.st_busy.text() or "2 /" in win.st_busy.text()
    assert win.acts.pause.isEnabled() and not win.acts.step.isEnabled()
    win.acts.pause.trigger()
    release.set()
    wait_idle(win)
    assert "cancelled" in win.statusBar().currentMessage()
    win.run_in_worker(lambda s: state.update(after=(list(s.tokens), s.current.probs.clone(), s.mask_edits)))
    wait_idle(win)
    (t0, p0, e0), (t1, p1, e1) = state["before"], state["after"]
    assert t0 == t1 and e0 == e1 == []
    assert torch.equal(p0, p1)
    assert win.errors == []
    # without a pause the same edit goes through
    win.edit_cells([(1, 0)], scope="layer")
    wait_idle(win)
    win.run_in_worker(lambda s: state.update(done=s.mask_edits))
    wait_idle(win)
    assert len(state["done"]) == 1
