"""The link to a real ``gpt-inspector serve`` process drops while a panel's job runs on the engine (a KV lab
Run, a comparison) or while a beam inspected over it is shown: the window's band says so within seconds
(never the panel's error), the panels keep what they showed, the window reconnects to the same session
when the engine can be reached again, and the next Run gives the numbers the first one gave, which are
a local run's on the same checkpoint. The drops are made by a relay on loopback between the window and
the engine: a pulled cable (bytes swallowed, sockets open), or a cut link with the port then closed."""

# ruff: noqa: F811  (the fixtures imported from the other remote tests are redefined as test arguments)

from __future__ import annotations

import time

import pytest

from gpt_inspector.core.compare import compare
from gpt_inspector.core.kvlab import KVLab, make

pytest.importorskip("pytestqt")

from keys import press, wait  # noqa: E402
from PySide6.QtCore import Qt  # noqa: E402
from test_remote_labs import _no_seconds, _same_steps, _type  # noqa: E402
from test_remote_window import no_dialogs, same_as_local, window  # noqa: E402, F401  (fixtures)

SEEN_S = 8  # a pulled cable is said within this (the client's pings give up after about 5 s)


def _lost_within(qtbot, win, seconds: float) -> None:
    t0 = time.monotonic()
    qtbot.waitUntil(win.link_bar.isVisible, timeout=int(seconds * 1000) + 2000)
    assert time.monotonic() - t0 < seconds
    assert "LINK LOST" in win.link_label.text() and win.st_link.text() == "engine: LINK LOST"


def _back(qtbot, win) -> None:
    qtbot.waitUntil(lambda: not win.link_bar.isVisible(), timeout=30000)
    assert win.st_link.text() == "engine: connected" and "Reconnected" in win.statusBar().currentMessage()


def _lab_shown(panel) -> tuple:
    """What the KV lab panel shows: the KL curve, the bytes table, the bytes line."""
    x, y = panel.kl_curve.getData()
    cells = [[panel.table.item(i, j).text() for j in range(panel.table.columnCount())]
             for i in range(panel.table.rowCount())]  # fmt: skip
    return list(x), list(y), cells, panel.bytes_label.text()


def _stepped(qtbot, win, n: int):
    """Step ``n`` times with F10, as a user does (the reconnect then rebuilds a session that has stepped)."""
    for _ in range(n):
        press(qtbot, win, Qt.Key.Key_F10)
    qtbot.waitUntil(lambda: win.snapshot is not None and win.snapshot.n_steps == n, timeout=30000)
    return wait(qtbot, win)


def test_a_link_pulled_during_a_kv_lab_run_is_the_windows_band_and_the_next_run_is_the_first_ones(
    server, window, proxy, local_lm, qtbot, no_dialogs
):
    link = proxy(server.port)
    win, r = window(link.url(server.url))
    before = _stepped(qtbot, win, 2)
    panel = win.kvlab_panel
    win.raise_panel(panel)
    qtbot.waitUntil(panel.run_button.isEnabled, timeout=10000)
    _type(qtbot, panel.budget, "4")
    _type(qtbot, panel.steps, "24")
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.view is not None and not panel.job.running, timeout=60000)
    first, kept, status = panel.view, _lab_shown(panel), panel.status.text()
    assert len(first.steps) == 24 and "24 steps" in status

    link.trip = link.stalled.set  # the cable is pulled while the engine runs the lab
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    _lost_within(qtbot, win, SEEN_S)
    qtbot.waitUntil(lambda: not panel.job.running, timeout=10000)
    assert link.trip is None  # the drop came while the engine ran the job
    # no dialog: the band says it; the panel shows the lab it showed, and says why the Run did not come back
    assert not no_dialogs and not win.errors
    assert panel.view is first and _lab_shown(panel) == kept
    assert panel.status.text().startswith(status) and "link to the engine dropped" in panel.status.text()
    assert panel.run_button.isEnabled() and panel.step_button.isEnabled()
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)  # Run while it is down: the same, no dialog
    qtbot.waitUntil(lambda: not panel.job.running, timeout=20000)
    assert not no_dialogs and not win.errors and _lab_shown(panel) == kept
    assert win.snapshot is before  # the window kept what it showed too

    link.stalled.clear()
    link.cut()  # the engine sees the old link end; the window's next attempt gets through
    _back(qtbot, win)
    snap = wait(qtbot, win)
    assert snap.n_steps == 2 and snap.tokens.token_ids == before.tokens.token_ids  # the same session
    assert panel.view is first and _lab_shown(panel) == kept  # the reconnect kept the lab shown

    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)  # Run again: the first Run's numbers
    qtbot.waitUntil(lambda: panel.view is not first and not panel.job.running, timeout=60000)
    _same_steps(panel.view.steps, first.steps)
    assert _lab_shown(panel) == kept and panel.status.text() == status
    local = KVLab(local_lm, policy=make("h2o", 4, **panel.options()), prompt_ids=list(r.prompt_ids))
    local.run_steps(24)
    _same_steps(panel.view.steps, local.history)
    assert not no_dialogs and not win.errors


def test_a_link_cut_during_a_comparison_with_the_port_closed_keeps_it_and_compares_again_when_back(
    server, window, proxy, local_lm, qtbot, no_dialogs
):
    link = proxy(server.port)
    win, r = window(link.url(server.url))
    _stepped(qtbot, win, 2)
    panel = win.compare_panel
    win.raise_panel(panel)
    qtbot.waitUntil(panel.run_button.isEnabled, timeout=10000)
    _type(qtbot, panel.beams, "3")
    _type(qtbot, panel.new_tokens, "12")
    _type(qtbot, panel.samples, "2")
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.result is not None and not panel.job.running, timeout=60000)
    first, summary = panel.result, panel.summary.text()
    cells = [panel.table.item(i, j).text() for i in range(panel.table.rowCount()) for j in range(4)]

    link.trip = link.block  # the link is cut while the engine compares, and the engine stays unreachable
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    _lost_within(qtbot, win, 3)  # a closed link is said at once
    qtbot.waitUntil(lambda: not panel.job.running, timeout=10000)
    assert link.trip is None and not no_dialogs and not win.errors
    assert panel.result is first and panel.summary.text().startswith(summary)
    assert "link to the engine dropped" in panel.summary.text()
    assert [panel.table.item(i, j).text() for i in range(panel.table.rowCount()) for j in range(4)] == cells
    assert panel.run_button.isEnabled() and panel.inspect_button.isEnabled()
    assert win.link_bar.isVisible()  # nothing listens: still down

    link.unblock()
    _back(qtbot, win)
    assert panel.result is first and panel.summary.text().startswith(summary)  # the reconnect kept it
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.result is not first and not panel.job.running, timeout=60000)
    assert _no_seconds(panel.result.to_json()) == _no_seconds(first.to_json())
    assert panel.summary.text() == summary
    want = compare(local_lm, prompt_ids=list(r.prompt_ids), **panel.settings())
    assert _no_seconds(panel.result.to_json()) == _no_seconds(want.to_json())
    assert not no_dialogs and not win.errors


def test_an_idle_drop_while_a_beam_is_shown_is_said_within_seconds_and_the_beam_comes_back(
    server, window, proxy, local_lm, qtbot, no_dialogs
):
    import gpt_inspector as gi
    from gpt_inspector.gui.viewdata import ViewModel

    link = proxy(server.port)
    win, r = window(link.url(server.url))
    _stepped(qtbot, win, 1)
    panel = win.compare_panel
    win.raise_panel(panel)
    qtbot.waitUntil(panel.run_button.isEnabled, timeout=10000)
    _type(qtbot, panel.beams, "3")
    _type(qtbot, panel.new_tokens, "4")
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.result is not None and not panel.job.running, timeout=60000)
    first = panel.result
    qtbot.mouseClick(panel.inspect_button, Qt.MouseButton.LeftButton)  # beam 1, a run of its own
    qtbot.waitUntil(lambda: "Beam 1" in win.windowTitle(), timeout=30000)
    shown = wait(qtbot, win)
    assert shown.read_only

    link.stalled.set()  # the cable is pulled while the beam is on screen and nothing is asked of the engine
    _lost_within(qtbot, win, SEEN_S)
    assert not no_dialogs and not win.errors and win.snapshot is shown and "Beam 1" in win.windowTitle()
    link.stalled.clear()
    link.cut()
    _back(qtbot, win)
    snap = wait(qtbot, win)
    assert "Beam 1" in win.windowTitle() and panel.result is first  # the beam still shown, the comparison kept
    local = compare(local_lm, prompt_ids=list(r.prompt_ids), **panel.settings())
    vm = ViewModel(local.beam_view(0))
    same_as_local(snap, vm)  # read from the engine again: the local Inspect's numbers
    win.score_matrix.setFocus()
    press(qtbot, win, Qt.Key.Key_BracketRight)  # the next head: a read over the re-made link
    snap = wait(qtbot, win)
    assert snap.selection.head == 1
    same_as_local(snap, vm)

    press(qtbot, win, Qt.Key.Key_Tab, Qt.KeyboardModifier.ControlModifier)  # back to the live session: it steps
    qtbot.waitUntil(lambda: win.snapshot is not None and not win.snapshot.read_only, timeout=30000)
    press(qtbot, win, Qt.Key.Key_F10)
    qtbot.waitUntil(lambda: win.snapshot is not None and win.snapshot.n_steps == 2, timeout=30000)
    s = gi.Session(local_lm, r.prompt)
    s.run(2)
    assert list(wait(qtbot, win).tokens.token_ids) == s.tokens
    assert not no_dialogs and not win.errors


def test_when_the_engine_holds_another_session_after_the_drop_the_window_shows_it_and_the_panels_let_go(
    server, window, proxy, qtbot, no_dialogs
):
    from gpt_inspector.remote.client import RemoteSession

    link = proxy(server.port)
    win, r = window(link.url(server.url))
    _stepped(qtbot, win, 1)
    panel = win.kvlab_panel
    win.raise_panel(panel)
    qtbot.waitUntil(panel.run_button.isEnabled, timeout=10000)
    _type(qtbot, panel.steps, "2")
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.view is not None and not panel.job.running, timeout=60000)

    link.block()  # idle, the link cut and the engine unreachable from the window
    _lost_within(qtbot, win, 3)
    other = RemoteSession(server.url, timeout=20)  # meanwhile another client opens another prompt there
    other.open("A different prompt")
    other.close()
    link.unblock()
    _back(qtbot, win)
    qtbot.waitUntil(lambda: panel.view is None, timeout=10000)  # the lab was of the session the window showed
    assert "another session" in panel.status.text()
    snap = wait(qtbot, win)
    assert snap.n_steps == 0 and list(snap.tokens.token_ids) == other.prompt_ids
    assert win.session_panel.prompt.toPlainText() == "A different prompt"
    assert not no_dialogs and not win.errors


def test_a_cache_probe_that_meets_a_cut_link_is_said_in_the_status_bar_not_a_dialog(
    server, window, proxy, local_lm, qtbot, no_dialogs
):
    import gpt_inspector as gi
    from gpt_inspector.core.probe import probe_session

    # the panels whose errors are dialogs (cache probe, math check, assisted) share one report: a dropped
    # link is not one of their errors (the band says it; the status bar, unless the band's own words came
    # later), and the result shown stays
    link = proxy(server.port)
    win, r = window(link.url(server.url))
    _stepped(qtbot, win, 1)
    probe = win.probe_panel
    win.raise_panel(probe)
    qtbot.waitUntil(probe.probe_button.isEnabled, timeout=10000)
    qtbot.mouseClick(probe.probe_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: probe.result is not None and not probe.job.running, timeout=30000)
    first = probe.result
    local = gi.Session(local_lm, r.prompt)
    local.step()

    # the cable pulled just before Probe is pressed: the window cannot know yet (the pings give up after
    # about 5 s), so the probe's request goes out and its answer never comes back
    link.stalled.set()
    layers = probe.chosen_layers()
    item = probe.layers.item(1)  # another layer checked (Space on it): a probe not yet read, so a request
    qtbot.mouseClick(probe.layers.viewport(), Qt.MouseButton.LeftButton, pos=probe.layers.visualItemRect(item).center())
    qtbot.keyClick(probe.layers, Qt.Key.Key_Space)
    assert probe.chosen_layers() == sorted({*layers, 1}) != layers
    qtbot.mouseClick(probe.probe_button, Qt.MouseButton.LeftButton)
    assert probe.job.running
    _lost_within(qtbot, win, SEEN_S)
    qtbot.waitUntil(lambda: not probe.job.running, timeout=10000)
    assert not no_dialogs and not win.errors and probe.result is first

    link.stalled.clear()
    link.cut()
    _back(qtbot, win)
    qtbot.mouseClick(probe.probe_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: probe.result is not first and not probe.job.running, timeout=30000)
    got, want = probe.result.to_json(), probe_session(local, layers=probe.chosen_layers()).to_json()
    for x in (got, want):
        for layer in x["layers"]:
            layer.pop("seconds")
    assert got == want and len(got["layers"]) == 2  # the layers the dropped probe asked for, as a local probe
    assert not no_dialogs and not win.errors


def test_an_engine_restarted_behind_the_link_is_said_once_with_what_to_do_and_not_retried(
    serve, window, proxy, qtbot, no_dialogs
):
    # a restarted serve prints a fresh token: the window's URL can never get in again, and its session is gone
    first = serve()
    link = proxy(first.port)
    win, _ = window(link.url(first.url))
    before = _stepped(qtbot, win, 1)
    assert first.interrupt() == 0  # Ctrl+C on the server: it stops and saves its recipe
    _lost_within(qtbot, win, SEEN_S)
    again = serve()
    link.upstream = again.port  # the same address, as seen from the window, a new engine behind it
    qtbot.waitUntil(lambda: "restarted" in win.link_label.text(), timeout=15000)
    text = win.link_label.toolTip()  # the whole text (the band elides it to its width)
    assert "no longer takes this window's token" in text and "gpt-inspector --connect URL" in text
    assert (
        "Reconnecting" not in win.link_label.text()
        and win.link_bar.isVisible()
        and win.st_link.text() == "engine: LINK LOST"
    )
    tries = len(link.pairs)
    qtbot.wait(2000)  # four watch ticks: none knocks on the new engine's door again
    assert len(link.pairs) == tries
    assert win.snapshot is before and not no_dialogs and not win.errors  # the window keeps what it showed
