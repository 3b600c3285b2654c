"""Compare's "Inspect beam" in a window on a remote engine (a real ``serve`` process): the engine keeps
its last comparison and answers the inspected beam's reads from it; every number the window shows is
a local Inspect's of the same comparison on the same checkpoint."""

from __future__ import annotations

import pytest

from gpt_inspector.core.compare import compare
from gpt_inspector.core.errors import InspectorError

pytest.importorskip("pytestqt")

from PySide6.QtCore import Qt  # noqa: E402
from test_remote_labs import _type  # noqa: E402
from test_remote_window import PROMPT, no_dialogs, press, same_as_local, wait, window  # noqa: E402, F401  (fixtures)

SETTINGS = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 4}


def test_inspect_beam_over_the_link_shows_the_local_inspects_numbers(server, window, local_lm, qtbot, no_dialogs):  # noqa: F811 (the fixtures imported above)
    from gpt_inspector.gui.viewdata import ViewModel

    win, r = window(server.url)
    panel = win.compare_panel
    win.raise_panel(panel)
    qtbot.waitUntil(panel.run_button.isEnabled, timeout=10000)
    _type(qtbot, panel.beams, "3")
    _type(qtbot, panel.returns, "2")
    _type(qtbot, panel.new_tokens, "4")
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.result is not None and not panel.job.running, timeout=60000)
    assert panel.inspect_button.isEnabled() and panel.inspect_pick.count() == 2
    local = compare(local_lm, prompt_ids=list(r.prompt_ids), **SETTINGS)

    panel.inspect_pick.setFocus()
    qtbot.keyClick(panel.inspect_pick, Qt.Key.Key_Down)  # beam 2
    assert panel.inspect_pick.currentIndex() == 1
    qtbot.mouseClick(panel.inspect_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "Beam 2" in win.windowTitle(), timeout=30000)
    snap = wait(qtbot, win)
    assert snap.read_only and "read-only" in win.windowTitle() and not win.acts.step.isEnabled()
    beam = local.beam_view(1)
    assert list(snap.tokens.token_ids) == beam.tokens and beam.tokens != local.beam_view(0).tokens
    vm = ViewModel(beam)
    same_as_local(snap, vm)

    win.score_matrix.setFocus()
    press(qtbot, win, Qt.Key.Key_BracketRight)  # the next head, then the next layer: read from the beam
    wait(qtbot, win)
    press(qtbot, win, Qt.Key.Key_PageDown)
    snap = wait(qtbot, win)
    assert (snap.selection.layer, snap.selection.head) == (1, 1)
    same_as_local(snap, vm)

    # Ctrl+Tab: back to the live session, which the beam's reads left as it was; it steps on
    press(qtbot, win, Qt.Key.Key_Tab, Qt.KeyboardModifier.ControlModifier)
    back = wait(qtbot, win)
    assert not back.read_only and back.n_steps == 0 and list(back.tokens.token_ids) == list(r.prompt_ids)
    press(qtbot, win, Qt.Key.Key_F10)
    qtbot.waitUntil(lambda: win.snapshot is not None and win.snapshot.n_steps == 1, timeout=30000)
    assert not no_dialogs and not win.errors


def test_a_later_comparison_replaces_the_beams_kept_on_the_engine(server):
    import gpt_inspector as gi

    with gi.connect(server.url, prompt=PROMPT) as r:
        first = r.remote_compare(**SETTINGS)
        beam = first.beam_view(0)
        assert beam.live.why_not("step") and beam.read_only and beam.tokens == first.beams[0]["token_ids"]
        with pytest.raises(InspectorError, match="read-only"):
            beam.step()
        with pytest.raises(InspectorError, match=r"beam must be in \[0, 2\)"):
            first.beam_view(2)
        r.remote_compare(**SETTINGS)
        with pytest.raises(InspectorError, match="no longer on the engine"):
            first.beam_view(1)
        with pytest.raises(InspectorError, match="no longer on the engine"):
            beam.attention_rows(0, 0, 3)
        assert r.n_steps == 0 and r.step().index == 0  # the session itself is as it was
