"""The window driving a real ``gpt-inspector serve`` process (``gpt-inspector --connect URL``), by keys
and clicks: what it shows is what a local session on the same checkpoint shows, bit for bit; only
new rows cross the wire after a step; a dropped link is said within seconds and the window
reconnects to the same session."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pytestqt")

from keys import click_cell, press, wait  # noqa: E402
from PySide6.QtCore import Qt  # noqa: E402

import gpt_inspector as gi  # noqa: E402
from gpt_inspector.core.edits import HeadEdit  # noqa: E402
from gpt_inspector.gui import _pyside_fix  # noqa: E402
from gpt_inspector.remote.client import RemoteSession  # noqa: E402

_pyside_fix.install()

PROMPT = "She eats an apple. He reads"


@pytest.fixture(autouse=True)
def no_dialogs(monkeypatch, tmp_path):
    """Message boxes recorded, not opened; settings in a temp file, never the user's."""
    from PySide6.QtWidgets import QMessageBox

    monkeypatch.setenv("GPT_INSPECTOR_SETTINGS", str(tmp_path / "settings.ini"))
    seen = []
    for name in ("warning", "critical", "information", "question"):
        monkeypatch.setattr(QMessageBox, name, lambda parent, title, text, *a, **k: seen.append((title, text)))
    return seen


@pytest.fixture
def window(qtbot):
    """``window(url)``: a window driving the engine at ``url`` on a fresh session of PROMPT, as
    ``gpt-inspector --connect URL --prompt PROMPT`` opens it."""
    from gpt_inspector.gui.main_window import MainWindow

    made = []

    def make(url):
        r = RemoteSession(url, timeout=20)
        r.open(PROMPT)
        win = MainWindow(restore_layout=False)
        qtbot.addWidget(win)
        win.resize(1400, 900)
        win.show()
        win.show_source(r)
        made.append((win, r))
        wait(qtbot, win)
        return win, r

    yield make
    for win, r in made:
        win.worker.stop()
        r.close()


def same_as_local(snap, local_vm):
    """Every number ``snap`` (the remote window's) shows equals what a local view model builds."""
    loc = local_vm.build(snap.selection)
    assert snap.T == loc.T and snap.tokens.token_ids == loc.tokens.token_ids
    assert snap.tokens.labels == loc.tokens.labels and snap.tokens.token_probs == loc.tokens.token_probs
    a, b = snap.tokens.step, loc.tokens.step
    assert (a.token_id, a.prob, a.entropy, a.top) == (b.token_id, b.prob, b.entropy, list(b.top))
    assert [(x.label, x.top, x.kept) for x in a.stages] == [(x.label, x.top, x.kept) for x in b.stages]
    arrays = {
        "matrix": (snap.scores.matrix, loc.scores.matrix),
        "allowed": (snap.scores.allowed, loc.scores.allowed),
        "head_rows": (snap.query_row.head_rows, loc.query_row.head_rows),
        "query_allowed": (snap.query_row.query_allowed, loc.query_row.query_allowed),
        "q": (snap.qkv.q, loc.qkv.q),
        "k": (snap.qkv.k, loc.qkv.k),
        "v": (snap.qkv.v, loc.qkv.v),
        "kv_k": (snap.kv.kv_k, loc.kv.kv_k),
        "kv_v": (snap.kv.kv_v, loc.kv.kv_v),
        "thumbs": (snap.overview.thumbs, loc.overview.thumbs),
    }
    for name, (x, y) in arrays.items():
        assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True), name
    assert snap.scores.levels == loc.scores.levels
    assert (snap.kv.kv_bytes, snap.kv.kv_kept, snap.kv.kv_positions) == (loc.kv.kv_bytes, loc.kv.kv_kept,
                                                                          loc.kv.kv_positions)  # fmt: skip
    assert snap.kv.kv_history == loc.kv.kv_history
    assert snap.mask.mask_edits == loc.mask.mask_edits and snap.mask.head_edits == loc.mask.head_edits
    ra, rb = snap.mask.mask_report, loc.mask.mask_report  # how the last edit moved the next-token distribution
    assert (ra is None) == (rb is None)
    if ra is not None:
        assert (
            ra.rows == rb.rows
            and ra.total_variation == rb.total_variation
            and ra.earliest_position == rb.earliest_position
        )
        assert np.array_equal(ra.after, rb.after) and ra.recomputed == rb.recomputed


def test_the_window_on_a_remote_engine_shows_the_local_sessions_numbers(server, window, local_lm, qtbot, no_dialogs,
                                                                       monkeypatch):  # fmt: skip
    from gpt_inspector.gui import worker as worker_mod
    from gpt_inspector.gui.viewdata import ViewModel

    # a view model extends its matrices by the rows each build adds, and a batch of rows may round
    # differently from one row: the local reference builds after every step as the window does
    monkeypatch.setattr(worker_mod, "PUBLISH_INTERVAL", 0.0)
    win, r = window(server.url)
    host = server.url.split("//")[1].split("/")[0]
    assert f"on engine {host}" in win.windowTitle() and "llama" in win.windowTitle()
    assert host in win.st_run.text() and host in win.st_device.text()
    assert win.session_panel.prompt.toPlainText() == PROMPT  # the engine's session, in the controls
    s = gi.Session(local_lm, PROMPT)
    vm = ViewModel(s)
    vm.build(win.selection)

    def local(*changes):
        for change in changes:
            change()
            vm.build(win.selection)

    for _ in range(2):
        press(qtbot, win, Qt.Key.Key_F10)
        snap = wait(qtbot, win)
        local(s.step)
    assert snap.n_steps == 2 and win.st_step.text() == "step 2"
    same_as_local(snap, vm)

    press(qtbot, win, Qt.Key.Key_BracketRight)  # the next head, then the next layer
    wait(qtbot, win)
    press(qtbot, win, Qt.Key.Key_PageDown)
    snap = wait(qtbot, win)
    assert (snap.selection.layer, snap.selection.head) == (1, 1)
    same_as_local(snap, vm)

    win.session_panel.max_steps.setValue(3)  # Run (F5) for three steps
    press(qtbot, win, Qt.Key.Key_F5)
    snap = wait(qtbot, win)
    local(s.step, s.step, s.step)
    assert snap.n_steps == 5
    same_as_local(snap, vm)

    press(qtbot, win, Qt.Key.Key_F10, Qt.KeyboardModifier.ShiftModifier)  # step back
    snap = wait(qtbot, win)
    local(s.step_back)
    assert snap.n_steps == 4
    same_as_local(snap, vm)

    qtbot.mouseClick(win.score_matrix.edit_button, Qt.MouseButton.LeftButton)  # block a cell by clicking it
    click_cell(qtbot, win, 5, 2)
    snap = wait(qtbot, win)
    assert [(e.query, e.key) for e in snap.mask_edits] == [(5, 2)] and not snap.scores.allowed[5, 2]
    local(lambda: s.set_mask_edits(list(snap.mask_edits)))
    same_as_local(snap, vm)

    press(qtbot, win, Qt.Key.Key_K, Qt.KeyboardModifier.ControlModifier)  # knock out the selected head
    snap = wait(qtbot, win)
    assert [e for e, _ in snap.mask.head_edits] == [HeadEdit(1, 1)]
    local(lambda: s.set_head_edits([HeadEdit(1, 1)]))
    same_as_local(snap, vm)

    t = win.session_panel.temperature  # live decoding: the distribution follows, no model run
    t.selectAll()
    qtbot.keyClicks(t, "0.8")
    qtbot.waitUntil(lambda: "temperature 0.8" in win.next_token.decoding.text(), timeout=10000)
    snap = wait(qtbot, win)
    d = snap.tokens.decoding
    local(lambda: s.set_decoding(temperature=0.8, top_k=d.get("top_k"), top_p=d.get("top_p")))
    same_as_local(snap, vm)
    assert r.tokens == s.tokens and not no_dialogs and not win.errors


def test_after_a_step_only_the_new_rows_cross_the_wire(server, window, qtbot):
    win, r = window(server.url)
    press(qtbot, win, Qt.Key.Key_F10)
    press(qtbot, win, Qt.Key.Key_F10)
    wait(qtbot, win)
    sent = []
    call = r._call_t

    def logged(op, **args):
        sent.append((op, args))
        return call(op, **args)

    r._call_t = logged
    t0 = r.cache_length
    press(qtbot, win, Qt.Key.Key_F10)
    snap = wait(qtbot, win)
    t = snap.T
    assert t == t0 + 1 and sent[0][0] == "step"
    # the step's reply carried the reads the last repaint made, moved on by one position: one round trip
    # for the repaint (the autosave's "recipe", a second after a change, is not the repaint's and may land here)
    assert [op for op, _ in sent if op != "recipe"] == ["step"] and len(sent[0][1]["then"]) == 5, sent
    for op, args in sent[1:]:
        assert op not in ("attention", "trace", "distribution"), op  # never a whole matrix, a file or (V,)
        if "p0" in args:  # q, K, V, rows, bins, blocks: only positions the step added
            assert args["p0"] >= t0, (op, args)
    assert r.step_bytes < 20_000  # a step of the tiny model and its repaint: a few kB, not the whole cache
    assert r.step_bytes == r.bytes_sent + r.bytes_received - r._change_mark


def test_a_dropped_link_is_said_within_seconds_and_the_window_reconnects(server, window, proxy, local_lm, qtbot,
                                                                        no_dialogs):  # fmt: skip
    import time

    relay = proxy(server.port)
    win, r = window(relay.url(server.url))
    press(qtbot, win, Qt.Key.Key_F10)
    press(qtbot, win, Qt.Key.Key_F10)
    before = wait(qtbot, win)
    assert win.st_link.text() == "engine: connected" and not win.link_bar.isVisible()
    relay.stalled.set()  # the cable is pulled: nothing arrives, nothing says goodbye
    t0 = time.monotonic()
    qtbot.waitUntil(win.link_bar.isVisible, timeout=10000)
    assert time.monotonic() - t0 < 8
    assert "LINK LOST" in win.link_label.text() and win.st_link.text() == "engine: LINK LOST"
    press(qtbot, win, Qt.Key.Key_F10)  # a key pressed while it is down: no dialog, nothing lost
    wait(qtbot, win)
    assert win.snapshot is before and win.st_step.text() == "step 2"  # the window keeps what it showed
    relay.stalled.clear()
    relay.cut()  # the server sees the old link end; the next attempt gets through
    qtbot.waitUntil(lambda: not win.link_bar.isVisible(), timeout=20000)
    assert win.st_link.text() == "engine: connected" and "Reconnected" in win.statusBar().currentMessage()
    snap = wait(qtbot, win)
    assert snap.n_steps == 2 and snap.tokens.token_ids == before.tokens.token_ids  # the same session
    press(qtbot, win, Qt.Key.Key_F10)
    snap = wait(qtbot, win)
    s = gi.Session(local_lm, PROMPT)
    s.run(3)
    assert snap.tokens.token_ids == tuple(s.tokens)
    assert np.array_equal(
        snap.query_row.head_rows, s.attention_rows(0, s.cache_length - 1, s.cache_length)[:, 0].numpy()
    )
    assert not no_dialogs and not win.errors


def test_the_tools_in_a_remote_window_run_on_the_engine_or_say_why_not(server, window, local_lm, qtbot, no_dialogs,
                                                                       tmp_path):  # fmt: skip
    from gpt_inspector.core.lens import lens
    from gpt_inspector.core.mathcheck import check
    from gpt_inspector.core.probe import probe_session

    win, r = window(server.url)
    press(qtbot, win, Qt.Key.Key_3, Qt.KeyboardModifier.AltModifier)  # the Lens workspace: the panel in front
    qtbot.waitUntil(win.lens_panel.isVisible, timeout=5000)
    s, panel = gi.Session(local_lm, PROMPT), win.lens_panel
    for i in range(2):  # the panel follows the steps; once the lens is on, a step keeps what it reads
        press(qtbot, win, Qt.Key.Key_F10)
        qtbot.waitUntil(lambda i=i: panel.result is not None and panel.result.step == i, timeout=20000)
        s.step()
        want = lens(s)
        assert panel.result.to_json() == want.to_json()  # computed by the engine: the local numbers
    press(qtbot, win, Qt.Key.Key_M, Qt.KeyboardModifier.ControlModifier)  # check the selected head's math
    qtbot.waitUntil(lambda: win.mathcheck_panel.check is not None, timeout=20000)
    got, want = win.mathcheck_panel.check, check(s, 0, 0)
    assert np.array_equal(got.recomputed, want.recomputed) and np.array_equal(got.model, want.model) and got.ok
    probe = win.probe_panel  # the cache probe replays candidates through the engine's model, there
    win.raise_panel(probe)
    qtbot.waitUntil(probe.probe_button.isEnabled, timeout=10000)
    qtbot.mouseClick(probe.probe_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: probe.result is not None, timeout=30000)
    want = probe_session(s, layers=probe.chosen_layers()).to_json()
    got = probe.result.to_json()
    for x in (want, got):
        for layer in x["layers"]:
            layer.pop("seconds")
    assert got == want
    # the KV lab and Compare run on the engine too (test_remote_labs): their Run buttons are enabled
    assert win.kvlab_panel.run_button.isEnabled() and win.compare_panel.run_button.isEnabled()
    path = tmp_path / "run.safetensors"
    win.save_trace(str(path))  # File ▸ Save trace's action after its file dialog: the engine's file, saved here
    wait(qtbot, win)
    assert gi.load_trace(path).tokens == s.tokens
    assert not no_dialogs and not win.errors


def test_gpt_inspector_connect_opens_the_window_on_the_engine_or_refuses_in_one_line(server, local_lm, tmp_path,
                                                                                      monkeypatch, capsys):  # fmt: skip
    from gpt_inspector.cli import build_parser, main
    from gpt_inspector.gui import app
    from gpt_inspector.gui.main_window import MainWindow

    titles = []
    grab = MainWindow.grab
    monkeypatch.setattr(MainWindow, "grab", lambda win, *a: titles.append((win.windowTitle(), win.snapshot)) or
                        grab(win, *a))  # fmt: skip
    out = tmp_path / "shot.png"
    args = ["--connect", server.url, "--prompt", PROMPT, "--steps", "2", "--screenshot", str(out)]
    assert app.run(build_parser().parse_args(args)) == 0 and out.is_file()
    title, snap = titles[-1]
    s = gi.Session(local_lm, PROMPT)
    s.run(2)
    assert "on engine 127.0.0.1:" in title and snap.tokens.token_ids == tuple(s.tokens)  # the engine's session
    for url, words in ((server.url.split("?")[0] + "?token=wrong", "valid token is required"),
                       ("127.0.0.1:8765", "ws://HOST:PORT")):  # fmt: skip
        assert main(["--connect", url, "--screenshot", str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and "Traceback" not in err
