"""Probe and math-check panels render offscreen from results computed elsewhere."""

from __future__ import annotations

import pytest
import torch
from PySide6.QtCore import Qt

pytest.importorskip("pytestqt")

import gpt_inspector as gi  # noqa: E402
from gpt_inspector.core.mathcheck import check, check_all  # noqa: E402
from gpt_inspector.core.probe import probe_cache, probe_session  # noqa: E402
from gpt_inspector.gui.views.mathcheck import MathCheckPanel  # noqa: E402
from gpt_inspector.gui.views.probe import COLUMNS, ProbePanel  # noqa: E402


@pytest.fixture(scope="module")
def session(tiny_lm):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model; threads only add OpenMP spinning on a busy machine
    s = gi.Session(tiny_lm("llama"), "The cat sat on the mat")
    s.run(3)
    yield s
    torch.set_num_threads(n)


def _texts(table, col):
    return [table.item(r, col).text() for r in range(table.rowCount())]


def test_probe_panel_table_and_summary(qtbot, session):
    panel = ProbePanel()
    qtbot.addWidget(panel)
    panel.resize(700, 500)
    panel.show()
    result = probe_session(session, layers=(0, 1))
    panel.show_result(result)
    t = panel.table
    assert t.columnCount() == len(COLUMNS) and t.rowCount() == session.cache_length
    assert _texts(t, 0) == [str(i) for i in range(session.cache_length)]
    assert _texts(t, 1) == session.token_labels(session.processed_tokens)
    assert _texts(t, 2) == _texts(t, 1)
    assert set(_texts(t, 5)) == {"✓"}
    assert f"recovered {session.cache_length}/{session.cache_length}" in panel.summary.text()
    assert not panel.layer_box.isHidden() and panel.layer_box.count() == 2
    panel.layer_box.setCurrentIndex(1)
    assert "layer 1 (cache)" in panel.summary.text()
    assert not panel.grab().isNull()
    panel.clear()
    assert panel.table.rowCount() == 0 and panel.layer_box.count() == 0


def test_probe_panel_without_truth_and_with_a_miss(qtbot, session):
    panel = ProbePanel()
    qtbot.addWidget(panel)
    _, k, v = session.qkv(0)
    k = k.copy()
    k[:, 2] = 0.5  # not any token's key
    panel.show_result(probe_cache(session.lm, {0: (k, v)}))
    assert panel.layer_box.isHidden()
    assert _texts(panel.table, 1)[0] == ""  # truth unknown
    marks = _texts(panel.table, 5)
    assert marks[2] == "✗" and marks.count("✓") == session.cache_length - 1
    assert not panel.grab().isNull()


def test_math_panel_match_and_mismatch(qtbot, session):
    panel = MathCheckPanel()
    qtbot.addWidget(panel)
    panel.resize(700, 600)
    panel.show()
    c = check(session, 1, 3, 4)
    panel.show_result(c)
    assert "softmax" in panel.formula.text() and f"{c.scaling:.6g}" in panel.formula.text()
    assert "match" in panel.verdict.text() and "MISMATCH" not in panel.verdict.text()
    assert panel.table.rowCount() == session.head_dim
    assert float(panel.table.item(0, 1).text()) == pytest.approx(c.recomputed[0], rel=1e-6)
    assert float(panel.table.item(0, 2).text()) == pytest.approx(c.model[0], rel=1e-6)
    assert not panel.grab().isNull()

    panel.show_report(check_all(session))
    assert not panel.heads.isHidden()
    assert panel.heads.rowCount() == session.n_layers and panel.heads.columnCount() == session.n_heads + 1

    kept = session.cache_length - 1 - session.head_output_start  # the recorder's row of the newest position
    with torch.inference_mode():
        session.recorder.out[1].t[0, 3, kept, 5] += 0.1
    try:
        bad = check(session, 1, 3)
        panel.show_result(bad)
        assert "MISMATCH" in panel.verdict.text()
        assert panel.table.item(5, 3).background().color().red() > 200
        report = check_all(session)
        panel.show_report(report)
        assert panel.heads.item(1, 4).background().color().red() > 200
        assert panel.heads.item(0, 1).background().style() == Qt.NoBrush  # untouched heads stay plain
        assert not panel.grab().isNull()
    finally:
        with torch.inference_mode():
            session.recorder.out[1].t[0, 3, kept, 5] -= 0.1
    panel.clear()
    assert panel.table.rowCount() == 0 and panel.heads.isHidden()
