"""The debugger window end to end: every view follows the engine, and the GUI thread never runs it."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from keys import press
from PySide6.QtCore import QPointF, Qt, QThread, QTimer
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QLabel, QMessageBox

from gpt_inspector import MaskEdit, Session
from gpt_inspector.gui.worker import ModelSpec

PROMPT = "She eats an apple. He reads"


def _view_state(win):
    """What each view currently displays (copied), to compare before/after."""
    s = win.snapshot
    return {
        "tokens": (win.token_strip.count(), list(win.token_strip.labels), list(win.token_strip.probs)),
        "matrix": None if win.score_matrix.image.image is None else win.score_matrix.image.image.copy(),
        "overview": None if win.overview.last_image is None else win.overview.last_image.copy(),
        "softmax": [c.getData()[1].copy() for c in win.softmax_rows.curves],
        "k": win.qkv.kimg.image.copy(),
        "kv_k": win.kv_cache.kimg.image.copy(),
        "kv_v": win.kv_cache.vimg.image.copy(),
        "kv_hist": win.kv_cache.hcurve.getData()[1].copy(),
        "next": (list(win.next_token.top_ids), list(win.next_token.probs), win.next_token.chosen),
        "step": s.step,
        "T": s.T,
    }


def _assert_same_state(a, b):
    assert a["tokens"] == b["tokens"]
    np.testing.assert_array_equal(a["matrix"], b["matrix"])  # NaN == NaN here
    np.testing.assert_allclose(a["overview"], b["overview"], atol=1e-6)
    for x, y in zip(a["softmax"], b["softmax"]):
        np.testing.assert_array_equal(x, y)
    for key in ("k", "kv_k", "kv_v", "kv_hist"):
        np.testing.assert_array_equal(a[key], b[key])
    assert a["next"] == b["next"]
    # step back recomputes the step it returns to under the decoding in force: a new Step, the same numbers
    sa, sb = a["step"], b["step"]
    same = ("index", "position", "token_id", "token_text", "top", "entropy", "forced", "finish_reason", "label")
    assert [getattr(sa, f) for f in same] == [getattr(sb, f) for f in same]
    assert torch.equal(sa.logits, sb.logits) and torch.equal(sa.probs, sb.probs)
    assert a["T"] == b["T"]


def test_stepping_updates_every_view(make_window, wait_idle, tiny_lm):
    win = make_window()
    assert win.snapshot.T == 0 and win.score_matrix.image.image is None
    ref = Session(tiny_lm("gpt2"), PROMPT)
    win.select(layer=1, head=2)
    for _ in range(3):
        win.step()
        snap = wait_idle(win)
        ref.step()
        t = ref.cache_length
        assert snap.T == t
        assert win.token_strip.count() == len(ref.tokens) == t + 1
        assert win.score_matrix.image.image.shape == (t, t)
        np.testing.assert_allclose(np.nan_to_num(win.score_matrix.image.image), ref.attention(1, 2, "probs"), atol=1e-6)
        nb = snap.thumb_bins
        assert win.overview.last_image.shape == (ref.n_layers * nb, ref.n_heads * nb)
        assert [len(c.getData()[1]) for c in win.softmax_rows.curves] == [t] * ref.n_heads
        np.testing.assert_allclose(win.softmax_rows.curves[2].getData()[1], ref.attention(1, 2, "probs")[-1], atol=1e-6)
        q, k, v = ref.qkv(1)
        np.testing.assert_array_equal(win.qkv.kimg.image, k[2])
        np.testing.assert_array_equal(win.qkv.vimg.image, v[2])
        assert win.kv_cache.kimg.image.shape == (t, ref.n_kv_heads * ref.head_dim)
        assert len(win.kv_cache.hcurve.getData()[1]) == ref.n_steps
        assert snap.kv_bytes == tuple(ref.kv_cache_bytes(i) for i in range(ref.n_layers))
        assert win.next_token.chosen == ref.current.token_id
        assert win.next_token.top_ids == [e.token_id for e in ref.current.top]
        assert win.snapshot.step.entropy == pytest.approx(ref.current.entropy)
    assert "step 3" in win.st_step.text() and f"positions {ref.cache_length}" in win.st_positions.text()
    # every raw stage of the matrix is the engine's own
    for kind in ("raw", "scores", "masked_scores"):
        win.select(kind=kind)
        snap = wait_idle(win)
        want = ref.attention(1, 2, kind)
        got = win.score_matrix.image.image
        if kind == "masked_scores":
            assert np.array_equal(np.isnan(got), ~ref.allowed(1, 2))
            want = np.where(ref.allowed(1, 2), want, np.nan)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_clicking_a_mask_cell_recomputes_like_the_engine(make_window, wait_idle, tiny_lm, qtbot, click_tab):
    win = make_window()
    win.run(3)
    snap = wait_idle(win)
    t = snap.T
    layer, head = 0, 1
    win.select(layer=layer, head=head)
    wait_idle(win)
    win.score_matrix.set_edit_mode(True)
    view = win.score_matrix
    # a real mouse click on cell (query t-1, key 1)
    scene_pt = view.image.mapToScene(QPointF(1.5, t - 0.5))
    pt = view.glw.mapFromScene(scene_pt)
    with qtbot.waitSignal(view.cells_edited, timeout=3000) as sig:
        QTest.mouseClick(view.glw.viewport(), Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, pt)
    assert sig.args[0] == [(t - 1, 1)] and sig.args[1] == "head"
    snap = wait_idle(win)
    edit = MaskEdit(t - 1, 1, layer, head)
    assert snap.mask_edits == (edit,)
    ref = Session(tiny_lm("gpt2"), PROMPT)
    ref.run(3)
    report = ref.set_mask_edits([edit])
    assert [(e.token_id, e.prob, e.logit) for e in snap.step.top] == [
        (e.token_id, e.prob, e.logit) for e in ref.current.top
    ]
    assert snap.mask_report.total_variation == pytest.approx(report.total_variation)
    assert report.total_variation > 0
    np.testing.assert_array_equal(snap.mask_report.after, report.after.numpy())
    assert np.isnan(view.image.image[t - 1, 1])  # the blocked cell shows in the masked colour
    click_tab(win, "Mask edits")  # the list is on a tab behind "Next token"
    assert win.mask_editor.list.count() == 1 and win.mask_editor.table.rowCount() > 0
    # cells above the diagonal are ignored, nothing is sent
    with qtbot.assertNotEmitted(view.cells_edited):
        view.edit_cells([(1, 3)])
    # clicking the same cell again unblocks it
    view.edit_cells([(t - 1, 1)])
    snap = wait_idle(win)
    assert snap.mask_edits == ()
    ref.clear_mask_edits()
    assert [e.prob for e in snap.step.top] == [e.prob for e in ref.current.top]


def test_temperature_changes_the_distribution_shown(make_window, wait_idle, qtbot, tiny_lm):
    win = make_window()
    win.step()
    wait_idle(win)
    token = win.next_token.chosen
    win.session_panel.temperature.setValue(1.0)
    qtbot.waitUntil(lambda: win.snapshot.decoding["temperature"] == 1.0, timeout=5000)
    p1 = list(win.next_token.probs)
    win.session_panel.temp_slider.setValue(200)  # the slider drives the spin box
    qtbot.waitUntil(lambda: win.snapshot.decoding["temperature"] == 2.0, timeout=5000)
    p2 = list(win.next_token.probs)
    assert p2[0] < p1[0]  # hotter: flatter
    assert win.next_token.chosen == token  # no re-decision without asking
    ref = Session(tiny_lm("gpt2"), PROMPT, temperature=2.0)
    ref.step()
    assert p2 == pytest.approx([e.prob for e in ref.current.top], abs=1e-7)
    assert win.snapshot.step.entropy == pytest.approx(ref.current.entropy, rel=1e-6)
    assert "temperature 2" in win.next_token.decoding.text()


def test_step_back_restores_every_view(make_window, wait_idle):
    win = make_window(temperature=0.8, seed=3)
    win.run(4)
    wait_idle(win)
    before = _view_state(win)
    win.step()
    after = wait_idle(win)
    assert after.T == before["T"] + 1
    win.step_back()
    wait_idle(win)
    _assert_same_state(before, _view_state(win))
    # and a restart goes back to nothing processed
    win.restart()
    snap = wait_idle(win)
    assert snap.T == 0 and snap.n_steps == 0 and win.score_matrix.image.image is None


def test_event_loop_keeps_running_during_a_long_run(make_window, wait_idle, qtbot):
    import threading
    import time

    win = make_window()
    ticks = []  # what the GUI thread saw on each timer tick: (running, pause enabled, step enabled)
    timer = QTimer()
    timer.timeout.connect(lambda: ticks.append((win.running, win.acts.pause.isEnabled(), win.acts.step.isEnabled())))
    timer.start(10)

    paused = threading.Event()

    def slow(session):  # make every step take a while, on the worker thread
        orig = session.step

        def step():
            time.sleep(0.02)
            st = orig()
            if st.finish_reason == "eos":  # keep going: this test is about a long run
                st = session.force_token(5)
            if session.n_steps >= 12:  # hold the run here until the pause is in: no race with a busy machine
                paused.wait(20)
            return st

        session.step = step

    win.run_in_worker(slow)
    wait_idle(win)
    win.run(30)
    qtbot.waitUntil(lambda: win.st_progress.value() >= 10, timeout=20000)  # the status bar counts steps
    win.pause()
    paused.set()
    snap = wait_idle(win)
    timer.stop()
    during = [t for t in ticks if t[0]]
    assert len(during) >= 5  # the timer fired again and again while the run was going
    assert all(pause and not step for _, pause, step in during)
    assert 10 <= snap.n_steps < 30
    assert win.last_stop_reason == "paused"
    assert not win.st_progress.isVisible()


def test_breakpoints_and_run_to(make_window, wait_idle):
    win = make_window()
    bp = win.breakpoints_panel
    bp.on_prob.setChecked(True)
    bp.prob.setValue(1.0)  # every token is below p = 1: stop after the first step
    win.run(10)
    snap = wait_idle(win)
    assert snap.n_steps == 1 and win.last_stop_reason.startswith("breakpoint at step 1")
    bp.on_prob.setChecked(False)
    win.run_to(6)
    assert wait_idle(win).n_steps == 6
    win.run_to(2)
    assert wait_idle(win).n_steps == 2


def test_a_bad_model_path_shows_a_dialog_and_the_window_survives(make_window, wait_idle, monkeypatch, tmp_path):
    win = make_window()
    shown = []
    for name in ("warning", "critical", "information"):
        monkeypatch.setattr(QMessageBox, name, lambda parent, title, text, *a, **k: shown.append((title, text)))
    win.load_model(ModelSpec(str(tmp_path / "no-such-model")))
    wait_idle(win)
    assert len(shown) == 1 and "does not exist" in shown[0][1]
    assert win.errors[-1] == shown[0]
    win.step()  # the old session is still there and steps
    assert wait_idle(win).T > 0
    # a step that fails inside the worker is reported the same way
    win.run_in_worker(lambda s: setattr(s, "finished", "eos"))
    win.step()
    wait_idle(win)
    assert len(shown) == 2 and "finished" in shown[1][1]


def test_loading_a_model_through_the_worker(qtbot, tiny_dir, wait_idle):
    from gpt_inspector.gui.main_window import MainWindow
    from gpt_inspector.gui.worker import SessionSpec

    win = MainWindow(restore_layout=False)
    qtbot.addWidget(win)
    busy = []
    win.worker.busy.connect(busy.append)
    win.load_model(ModelSpec(str(tiny_dir["llama"]), device="cpu"), SessionSpec("One two three", 0.0, None, None, 0))
    snap = wait_idle(win)
    assert any(b.startswith("Loading") for b in busy)
    assert snap.n_kv_heads == 2 and snap.n_heads == 4 and snap.prompt_len > 0
    assert win.session_panel.model.itemText(1) == str(tiny_dir["llama"])  # remembered as recent
    win.step()
    snap = wait_idle(win)
    assert snap.kv_k.shape == (snap.T, 2 * snap.head_dim)
    win.close()


def test_the_worker_never_runs_on_the_gui_thread(make_window, wait_idle):
    win = make_window()
    win.run(2)
    win.step_back()
    win.edit_cells([(3, 0)], scope="layer")
    results = []
    gui = QApplication.instance().thread()
    win.run_in_worker(lambda s: (QThread.currentThread() is not gui, threading.get_ident()),
                      lambda r, e: results.append(r))  # fmt: skip
    wait_idle(win)
    assert results and results[0][0] is True
    assert threading.get_ident() not in win.worker.thread_idents
    assert win.worker.thread_idents == {results[0][1]}


def test_trace_opens_read_only(make_window, reopened_as_trace):
    win = make_window()
    live, snap = reopened_as_trace(win, steps=3)
    assert snap.read_only and live.n_steps == 3 and snap.T == live.T and snap.labels == live.labels
    np.testing.assert_allclose(np.nan_to_num(snap.matrix), np.nan_to_num(live.matrix), atol=1e-6)
    np.testing.assert_allclose(snap.thumbs, live.thumbs, atol=1e-6)
    assert not win.acts.step.isEnabled() and not win.acts.run.isEnabled()
    assert win.acts.save.isEnabled()  # a run of its own now: saved again elsewhere, as any run that can be
    assert not win.score_matrix.edit_button.isEnabled()
    assert "read-only" in win.windowTitle()


def test_export_builds_the_figure_on_the_worker(make_window, wait_idle, monkeypatch, qtbot):
    import threading

    import gpt_inspector.gui.export_dialog as ed

    win = make_window()
    win.step()
    wait_idle(win)
    shown = []
    threads = []
    real_head = ed.figures.head_figure

    def head_figure(source, *a, **kw):
        threads.append(threading.get_ident())
        return real_head(source, *a, **kw)

    monkeypatch.setattr(ed.figures, "head_figure", head_figure)
    monkeypatch.setattr(
        ed,
        "_show",
        lambda parent, fig, name, scale, what, preview=None, full=None: shown.append((fig.heading, name, preview[:4])),
    )
    win.select(layer=1, head=3, kind="scores")
    wait_idle(win)
    win.export_view()
    win.step()  # never held back: it queues behind the export on the worker
    qtbot.waitUntil(lambda: len(shown) == 1, timeout=20000)
    assert threads and threads[0] != threading.get_ident()
    heading, name, magic = shown[0]
    assert "layer 1 · head 3 · scores (scaled) · step 1" in heading and name == "attention-L1-H3-scores.png"
    assert magic == b"\x89PNG"
    assert wait_idle(win).n_steps == 2
    win.overview.export_requested.emit(None)
    qtbot.waitUntil(lambda: len(shown) == 2, timeout=20000)
    assert shown[1][1] == "attention-all-layers-scores.png" and "all 2 layers" in shown[1][0]


def test_panel_hook_and_layout_persistence(qtbot, make_window, wait_idle):
    from gpt_inspector.gui.main_window import MainWindow

    win = make_window()
    seen = []
    panel = QLabel("plugin")
    panel.set_snapshot = lambda s: seen.append(s.T)
    dock = win.add_panel("My panel", panel, "right")
    win.snapshot_changed.connect(lambda s: seen.append(s.T))
    sel = []
    win.selection_changed.connect(lambda *a: sel.append(a))
    win.step()
    wait_idle(win)
    assert seen[-1] > 0
    win.select(layer=1)
    assert sel[-1] == (1, 0, -1)
    assert dock.objectName() == "panel_my_panel"
    win.docks["qkv"].hide()
    win.save_layout()
    other = MainWindow()
    qtbot.addWidget(other)
    assert other.docks["qkv"].isHidden() and not other.docks["scores"].isHidden()
    other.close()


def test_screenshot_automation(tiny_dir, tmp_path, qtbot):
    from gpt_inspector.gui import app

    out = tmp_path / "shot.png"
    args = SimpleNamespace(model=str(tiny_dir["gpt2"]), device="cpu", dtype=None, allow_pickle=False,
                           trust_remote_code=False, prompt="One two three", steps=3, screenshot=str(out))  # fmt: skip
    assert app.run(args) == 0
    assert out.stat().st_size > 10_000
    bad = SimpleNamespace(**{**vars(args), "model": str(tmp_path / "missing")})
    assert app.run(bad) == 2


def test_tools_run_the_probe_and_math_check_panels_in_the_worker(make_window, wait_idle):
    win = make_window()
    win.run(2)
    wait_idle(win)
    titles = [a.text() for a in win.tools_menu.actions()]
    next(a for a in win.tools_menu.actions() if a.text().startswith("Check the math of the selected")).trigger()
    wait_idle(win)
    assert win.mathcheck_panel.check is not None and not win.errors
    next(a for a in win.tools_menu.actions() if a.text().startswith("Probe")).trigger()
    wait_idle(win)
    assert win.probe_panel.result is not None and not win.errors
    assert "Check the math of every head" in titles


def test_dragging_over_cells_blocks_them_all_in_the_chosen_scope(make_window, wait_idle, tiny_lm):
    win = make_window()
    win.run(2)
    t = wait_idle(win).T
    view = win.score_matrix
    view.scope.setCurrentIndex(view.scope.findData("layer"))
    view.set_edit_mode(True)
    assert not view.vb.state["mouseEnabled"][0]  # no panning while editing
    # along the last row, then one jump up key 1's column to query 0, where key 1 is above the diagonal
    path = [QPointF(0.5, t - 0.5), QPointF(1.5, t - 0.5), QPointF(1.6, t - 0.4), QPointF(1.5, 0.5)]
    for i, p in enumerate(path):
        view._drag(p, i == 0, i == len(path) - 1)
    snap = wait_idle(win)
    # every cell the pointer crossed between two events, the future one left out
    want = [MaskEdit(t - 1, 0, layer=0, head=None)] + [MaskEdit(q, 1, layer=0, head=None) for q in range(t - 1, 0, -1)]
    assert list(snap.mask_edits) == want
    ref = Session(tiny_lm("gpt2"), PROMPT)
    ref.run(2)
    ref.set_mask_edits(want)
    assert [e.prob for e in snap.step.top] == [e.prob for e in ref.current.top]
    # every head of layer 0 shows the block, layer 1 does not
    win.select(layer=0, head=3)
    assert np.isnan(wait_idle(win).matrix[t - 1, :2]).all()
    win.select(layer=1)
    assert not np.isnan(wait_idle(win).matrix[t - 1, :2]).any()
    win.mask_editor.edits_replaced.emit([])  # "Clear all"
    assert wait_idle(win).mask_edits == ()


def test_the_cache_size_plot_counts_whole_steps_from_zero(make_window, wait_idle, qtbot):
    # a lone first point once auto-ranged to ±0.2 steps, labelled "(x0.001)"; ticks are whole steps
    win = make_window()
    plot = win.kv_cache.hplot
    for n in (1, 2, 5):
        while win.snapshot.n_steps < n:
            press(qtbot, win, Qt.Key.Key_F10)
            wait_idle(win)
        (x0, x1), (y0, y1) = plot.viewRange()
        last, top = max(1, n - 1), max(win.snapshot.kv_history)
        # from 0 to the next 1-2-5 bound past the data (steps, bytes), with a little padding
        assert -0.3 < x0 <= 0 and last <= x1 <= 2.5 * last + 0.3
        assert -0.1 * y1 < y0 <= 0 < top <= y1 <= 2.7 * top
        assert plot.getAxis("bottom").labelString().count("x0.") == 0
        ticks = [v for _, vals in plot.getAxis("bottom").tickValues(x0, x1, 200) for v in vals]
        assert ticks and all(float(v).is_integer() for v in ticks)


def test_screenshot_onto_a_full_disk_keeps_the_old_one(tiny_dir, tmp_path, qtbot, monkeypatch, capsys):
    from writing import full_disk

    from gpt_inspector.gui import app

    (tmp_path / "out").mkdir()  # settings.ini lives in tmp_path itself
    tmp_path = tmp_path / "out"
    out = tmp_path / "shot.png"
    out.write_bytes(b"\x89PNG old screenshot " * 300)
    old = out.read_bytes()
    args = SimpleNamespace(model=str(tiny_dir["gpt2"]), device="cpu", dtype=None, allow_pickle=False,
                           trust_remote_code=False, prompt="One two three", steps=1, screenshot=str(out))  # fmt: skip
    with full_disk(tmp_path, monkeypatch, after=8192):
        assert app.run(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err, err
    assert out.read_bytes() == old and os.listdir(tmp_path) == ["shot.png"]


def test_saving_a_trace_onto_a_fifo_or_folder_is_a_dialog_in_words(make_window, wait_idle, tmp_path):
    win = make_window()
    win.run(1)
    wait_idle(win)
    tmp_path = tmp_path / "out"  # the window's autosave and settings live in tmp_path itself
    tmp_path.mkdir()
    os.mkfifo(tmp_path / "pipe.safetensors")
    (tmp_path / "d.safetensors").mkdir()
    for name, words in (("pipe.safetensors", "pipe"), ("d.safetensors", "folder")):
        n = len(win.errors)
        win.save_trace(str(tmp_path / name))
        wait_idle(win)
        assert len(win.errors) == n + 1 and words in win.errors[-1][1] and "\n" not in win.errors[-1][1], win.errors
    assert sorted(os.listdir(tmp_path)) == ["d.safetensors", "pipe.safetensors"]


def test_the_next_token_panel_says_in_words_what_greedy_shows(make_window, wait_idle, qtbot):
    win = make_window()
    press(qtbot, win, Qt.Key.Key_F10)
    wait_idle(win)
    label = win.next_token.decoding
    greedy = "greedy: the top token is taken; probabilities shown at T = 1"
    assert label.text() == greedy
    assert label.isVisible() and label.fontMetrics().horizontalAdvance(greedy) <= label.width(), label.width()
    # the chosen bar is the most probable at T = 1: what "the top token is taken" promises
    nt = win.next_token
    assert nt.chosen == nt.top_ids[0] and nt.probs[0] == max(nt.probs)
    spin = win.session_panel.temperature
    qtbot.mouseDClick(spin.lineEdit(), Qt.MouseButton.LeftButton)
    qtbot.keyClick(spin.lineEdit(), Qt.Key.Key_A, Qt.KeyboardModifier.ControlModifier)
    qtbot.keyClicks(spin.lineEdit(), "0.8")
    qtbot.keyClick(spin.lineEdit(), Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: label.text().startswith("temperature 0.8"), timeout=5000)
    assert "greedy" not in label.text()
