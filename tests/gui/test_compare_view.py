"""The comparison panel renders a Comparison offscreen; it never runs the model itself."""

from __future__ import annotations

import pytest
import torch
from PySide6.QtCore import Qt

from gpt_inspector.core.errors import InspectorError
from gpt_inspector.core.live import Live

pytest.importorskip("pytestqt")

from gpt_inspector.core.beams import BeamView  # noqa: E402
from gpt_inspector.core.compare import Comparison, compare  # noqa: E402
from gpt_inspector.gui.views.compare import AFTER, PARTS, SAME, ComparePanel, create_panel  # noqa: E402


@pytest.fixture(scope="module")
def result(tiny_lm):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return compare(
            tiny_lm("gpt2"), "She eats an apple", max_new_tokens=6, num_beams=3, num_return_sequences=2,
            sample=True, temperature=1.5, seed=1,
        )  # fmt: skip
    finally:
        torch.set_num_threads(n)


def test_panel_shows_outputs_diff_probs_and_tree(qtbot, result):
    panel = ComparePanel()
    qtbot.addWidget(panel)
    panel.resize(900, 600)
    panel.show()
    panel.show_result(result)
    t = panel.table
    assert panel.row_names == ["greedy", "beam 1", "beam 2", "sample"]
    assert t.rowCount() == 4
    assert t.columnCount() == max(len(r["tokens"]) for r in [result.greedy, *result.beams, result.sampled])
    p = result.prompt_length
    assert t.horizontalHeaderItem(0).text() == str(p)
    # cells: token label and its probability
    g = result.greedy
    assert t.item(0, 0).text() == f"{g['tokens'][0]}\n{g['probs'][0]:.2f}"
    assert all(panel.cell_state(0, c) == SAME for c in range(len(g["tokens"])))
    # where each output parts from greedy is marked, once
    for row, out in enumerate([*result.beams, result.sampled], start=1):
        states = [panel.cell_state(row, c) for c in range(len(out["tokens"]))]
        div = out["diverges_at"]
        if div is None or div - p >= len(out["tokens"]):
            assert PARTS not in states
        else:
            assert states.index(PARTS) == div - p and states.count(PARTS) == 1
            assert all(s == SAME for s in states[: div - p])
    sampled = result.sampled
    assert sampled["diverges_at"] is not None  # T=1.5 on a random net: the sample wanders off
    assert AFTER in [panel.cell_state(3, c) for c in range(len(sampled["tokens"]))] or (
        sampled["diverges_at"] - p == len(sampled["tokens"]) - 1
    )
    # the tree: one item per node, pruned ones grey, the returned paths marked
    tree = result.beam_tree
    items = panel.tree.node_items
    assert set(items) == {n["id"] for n in tree}
    assert {items[n["id"]].data(0) for n in tree} == {n["status"] for n in tree}
    pruned = [n for n in tree if n["status"] == "pruned"]
    assert pruned and all(items[n["id"]].pen().style().name == "DashLine" for n in pruned)
    assert "prune" not in {items[n["id"]].data(0) for n in tree if n["returned"] is not None}
    assert "score" in panel.summary.text() and "beam 1" in panel.summary.text()
    assert not panel.grab().isNull()


def test_tree_layout_keeps_children_in_rank_order():
    nodes = [
        {"id": 0, "parent": None, "step": -1, "rank": 0},
        {"id": 1, "parent": 0, "step": 0, "rank": 0},
        {"id": 2, "parent": 0, "step": 0, "rank": 1},
        {"id": 3, "parent": 1, "step": 1, "rank": 1},
        {"id": 4, "parent": 1, "step": 1, "rank": 0},
    ]
    from gpt_inspector.gui.views.compare import BeamTreeView

    pos = BeamTreeView.layout(nodes)
    assert pos[4][1] < pos[3][1] < pos[2][1]  # rank order top to bottom
    assert pos[1][1] == (pos[3][1] + pos[4][1]) / 2 and pos[0][0] < pos[1][0] < pos[3][0]


class _FakeWindow:
    """Stands in for MainWindow: records the jobs and shown sources instead of using a worker thread."""

    def __init__(self):
        self.jobs = []
        self.shown = []
        self.names = []

    def run_in_worker(self, fn, callback=None):
        self.jobs.append((fn, callback))
        return len(self.jobs)

    def show_source(self, obj, name=None):
        self.shown.append(obj)
        self.names.append(name)


def test_create_panel_runs_through_the_worker(qtbot, tiny_lm, result):
    win = _FakeWindow()
    panel = create_panel(win)
    qtbot.addWidget(panel)
    panel.beams.setValue(3)
    panel.returns.setValue(2)
    panel.new_tokens.setValue(2)
    panel.run_button.click()
    assert len(win.jobs) == 1 and not panel.run_button.isEnabled()
    fn, callback = win.jobs[0]

    class _Session:  # what the worker would pass: the live session
        lm = tiny_lm("gpt2")
        prompt_ids = [5, 6, 7]
        live = Live()  # every capability

    class _Trace:  # a source with no model: its live refuses, in one line
        live = Live.nothing("it has no model; load the model and re-run the prompt")

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = fn(_Session())
    finally:
        torch.set_num_threads(n)
    assert isinstance(out, Comparison)
    assert out.prompt_ids == [5, 6, 7] and len(out.beams) == 2 and out.settings["num_beams"] == 3
    callback(out, None)
    assert panel.run_button.isEnabled() and panel.table.rowCount() == 3
    # Inspect beam hands that beam to the window: no file, no second window
    assert panel.inspect_button.isEnabled() and panel.inspect_pick.count() == 2
    panel.inspect_pick.setCurrentIndex(1)
    panel.inspect_button.click()
    assert len(win.shown) == 1 and isinstance(win.shown[0], BeamView) and win.names == ["Beam 2"]
    assert win.shown[0].tokens == out.beams[1]["token_ids"][: out.beams[1]["length"]]
    assert len(win.jobs) == 1  # nothing ran on the worker for it
    with pytest.raises(InspectorError, match="comparing decodings needs a live session: it has no model"):
        fn(_Trace())
    callback(None, ValueError("no model loaded"))
    assert "no model loaded" in panel.summary.text()


def test_docked_in_the_window_and_fed_by_its_worker(qtbot, make_window):
    """The real window docks the panel and runs the comparison on its worker thread."""
    win = make_window("gpt2", "She eats an apple")
    panels = win.findChildren(ComparePanel)
    assert len(panels) == 1
    panel = panels[0]
    panel.beams.setValue(2)
    panel.returns.setValue(2)
    panel.new_tokens.setValue(3)
    panel.run_button.click()
    qtbot.waitUntil(lambda: panel.result is not None, timeout=20000)
    assert panel.table.rowCount() == 3 and panel.result.settings["num_beams"] == 2
    assert panel.run_button.isEnabled()


def test_controls_fit_a_narrow_dock(qtbot, result):
    """Docked at ~430 px the controls wrap onto rows and the Compare button stays on screen."""
    panel = ComparePanel()
    qtbot.addWidget(panel)
    assert panel.minimumSizeHint().width() <= 430
    panel.resize(430, 520)
    panel.show()
    qtbot.waitExposed(panel)
    for w in (panel.run_button, panel.seed, panel.early, panel.inspect_button):
        assert w.isVisible()
        r = w.geometry().translated(w.parentWidget().mapTo(panel, w.parentWidget().rect().topLeft()))
        assert panel.rect().contains(r), (w, r)
    assert panel.run_button.y() > panel.beams.mapTo(panel, panel.beams.rect().topLeft()).y()  # wrapped
    panel.show_result(result)  # results do not widen it either
    assert panel.minimumSizeHint().width() <= 430 and panel.width() == 430
    # a wide bottom dock keeps them on one line, leaving the height to the table and tree
    panel.resize(1400, 520)

    def one_line():
        tops = {w.mapTo(panel, w.rect().topLeft()).y() for w in (panel.beams, panel.seed, panel.run_button)}
        assert max(tops) - min(tops) < panel.run_button.height()

    qtbot.waitUntil(one_line, timeout=3000)


def test_tree_is_fitted_and_legible_after_a_comparison(qtbot, result):
    from gpt_inspector.gui.views.compare_tree import _MIN_SCALE

    panel = ComparePanel()
    qtbot.addWidget(panel)
    panel.resize(1200, 700)
    panel.show()
    qtbot.waitExposed(panel)
    panel.show_result(result)
    assert panel.trees.currentIndex() == 0  # a sample came: the fan-out tree in front
    bar = panel.trees.tabBar()
    qtbot.mouseClick(bar, Qt.MouseButton.LeftButton, pos=bar.tabRect(1).center())  # the user picks the beam tree
    assert panel.trees.currentIndex() == 1
    tree = panel.tree
    qtbot.waitUntil(lambda: tree.isVisible() and tree.viewport().width() > 100, timeout=3000)
    vp = tree.viewport().rect()
    # fitted to the tree's final size: as large as fits, never shrunk below legible, never magnified
    scene = tree.sceneRect()
    want = max(_MIN_SCALE, min(1.0, vp.width() / scene.width(), vp.height() / scene.height()))
    assert tree.zoom == pytest.approx(want, rel=1e-3)
    label = next(iter(tree.node_items.values())).childItems()[0]
    assert label.boundingRect().height() * tree.zoom >= 8  # pixels on screen
    # the best beam's path is in view
    best = [i for n, i in tree.node_items.items() if result.beam_tree[n]["returned"] == 0]
    shown = tree.mapToScene(vp).boundingRect()
    assert any(shown.contains(i.sceneBoundingRect().center()) for i in best)
    # the dock growing refits; a user's zoom is left alone
    panel.resize(1200, 1000)
    qtbot.waitUntil(lambda: tree.viewport().height() > vp.height(), timeout=3000)

    def refitted():
        vp = tree.viewport().rect()
        assert tree.zoom == pytest.approx(
            max(_MIN_SCALE, min(1.0, vp.width() / scene.width(), vp.height() / scene.height())), rel=1e-3
        )

    qtbot.waitUntil(refitted, timeout=3000)
    want, grown = tree.zoom, tree.viewport().height()
    tree.scale(2, 2)
    tree._auto_fit = False  # what a wheel turn does
    panel.resize(1200, 700)
    qtbot.waitUntil(lambda: tree.viewport().height() < grown, timeout=3000)
    assert tree.zoom == pytest.approx(2 * want, rel=1e-3)


def test_inspect_beam_shows_the_beam_in_the_main_window(qtbot, make_window, wait_idle, hf_eager, monkeypatch):
    """Inspect beam 2: the main window shows that beam read-only, with its attention."""
    import numpy as np
    from PySide6.QtWidgets import QApplication, QMessageBox

    for name in ("warning", "critical"):  # a modal dialog would hang an offscreen test: record instead
        monkeypatch.setattr(QMessageBox, name, lambda *a, **k: None)
    win = make_window("llama", "She eats an apple")
    wait_idle(win)
    panel = win.findChildren(ComparePanel)[0]
    panel.beams.setValue(3)
    panel.returns.setValue(2)
    panel.new_tokens.setValue(4)
    panel.run_button.click()
    qtbot.waitUntil(lambda: panel.result is not None, timeout=20000)
    assert panel.inspect_button.isEnabled() and panel.inspect_pick.count() == 2
    panel.inspect_pick.setCurrentIndex(1)
    panel.inspect_button.click()
    beam = panel.result.beams[1]
    tokens = beam["token_ids"][: beam["length"]]
    snap = wait_idle(win)
    assert not win.errors, win.errors
    assert list(snap.token_ids) == tokens
    assert snap.read_only and win.read_only
    # no second window: the main window itself shows the beam
    assert [w for w in QApplication.topLevelWidgets() if isinstance(w, type(win)) and w.isVisible()] == [win]
    # the beam's attention is what HF eager computes for that sequence
    with torch.no_grad():
        ref = hf_eager("llama")(torch.tensor([list(snap.token_ids[: snap.T])]), output_attentions=True).attentions
    sel = snap.selection
    np.testing.assert_allclose(np.nan_to_num(snap.matrix), ref[sel.layer][0, sel.head].numpy(), atol=1e-5)


def test_samples_at_temperatures_fan_out_from_greedy(qtbot, make_window):
    """The user asks for 2 samples at T 0.8 and 1.6: six rows, one fan-out tree, each divergence marked."""
    win = make_window("gpt2", "She eats an apple")
    panel = win.findChildren(ComparePanel)[0]
    panel.new_tokens.setValue(4)
    panel.samples.setFocus()
    panel.samples.selectAll()
    qtbot.keyClicks(panel.samples, "2")
    assert panel.temperatures.isEnabled() and panel.seed.isEnabled()
    panel.temperatures.selectAll()
    qtbot.keyClicks(panel.temperatures, "0.8, 1.6")
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.result is not None, timeout=30000)
    r = panel.result
    assert [(s["seed"], s["temperature"]) for s in r.samples] == [(0, 0.8), (1, 0.8), (0, 1.6), (1, 1.6)]
    assert panel.row_names == ["greedy", "beam 1", "beam 2", "sample 1 · T 0.8", "sample 2 · T 0.8",
                               "sample 1 · T 1.6", "sample 2 · T 1.6"]  # fmt: skip
    assert panel.trees.currentIndex() == 0 and panel.fanout.isVisible()
    p = r.prompt_length
    items = panel.fanout.node_items
    assert set(items) == {n["id"] for n in r.fanout_tree}
    for row, out in enumerate(r.rows):
        states = [panel.cell_state(row, c) for c in range(len(out["tokens"]))]
        div = out.get("diverges_at")
        parts = [n for n in r.fanout_tree if row in n["parts"]]
        if div is None or div - p >= len(out["tokens"]):
            assert PARTS not in states and not parts
        else:  # the table cell and the tree node where it leaves greedy, both marked
            assert states.index(PARTS) == div - p and items[parts[0]["id"]].data(0) == "parts"
    assert any(n["parts"] for n in r.fanout_tree)  # T 1.6 on a random net leaves greedy somewhere
    tip = items[r.fanout_tree[1]["id"]].toolTip()
    assert "greedy: p = " in tip


def test_an_assisted_row_beside_greedy(qtbot, make_window):
    """Prompt lookup with 3 tokens a round: an "assisted" row whose tokens are greedy's, in the table and the tree."""
    win = make_window("gpt2", "She eats an apple. She eats an apple. She eats")
    panel = win.findChildren(ComparePanel)[0]
    panel.new_tokens.setValue(4)
    panel.lookup.setFocus()
    panel.lookup.selectAll()
    qtbot.keyClicks(panel.lookup, "3")
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.result is not None, timeout=30000)
    r = panel.result
    assert panel.row_names[-1] == "assisted" and r.rows[-1]["kind"] == "assisted"
    assert r.rows[-1]["token_ids"] == r.greedy["token_ids"] and r.rows[-1].get("diverges_at") is None
    assert r.assisted is not None and r.assisted["assisted"]["mode"] == "prompt lookup"
    last = len(r.rows) - 1  # the assisted row walks greedy's path through the fan-out tree, node for node
    assert [n["id"] for n in r.fanout_tree if last in n["rows"]] == [n["id"] for n in r.fanout_tree if 0 in n["rows"]]


def test_stop_ends_a_long_comparison_and_compare_runs_again(make_window, qtbot, no_dialogs):
    win = make_window()
    panel = win.compare_panel
    win.raise_panel(panel)
    qtbot.waitUntil(panel.run_button.isEnabled, timeout=10000)
    panel.new_tokens.setValue(30)
    panel.samples.setValue(64)  # 64 samples at 16 temperatures of 30 tokens: minutes, unless stopped
    panel.temperatures.setText(", ".join(f"{0.5 + i / 10:g}" for i in range(16)))
    assert not panel.stop_button.isEnabled()
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "sample: token" in panel.summary.text(), timeout=60000)  # its progress, as it runs
    qtbot.mouseClick(panel.stop_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not panel.job.running, timeout=20000)
    assert "stopped" in panel.summary.text() and panel.result is None and not panel.stop_button.isEnabled()
    panel.samples.setValue(0)
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.result is not None and not panel.job.running, timeout=60000)
    assert panel.inspect_button.isEnabled() and not no_dialogs  # a local comparison's beams can be inspected
