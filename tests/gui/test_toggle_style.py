"""A toggle that is on must look on: checked stage buttons and Edit mask differ from unchecked ones."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

from gpt_inspector.core.attention import KIND_LABELS, KINDS
from gpt_inspector.gui.views.common import apply_theme
from gpt_inspector.gui.views.score_matrix import ScoreMatrix


@pytest.fixture(autouse=True)
def dark_theme(qapp):
    """The window's own theme (Fusion, dark palette): where checked and unchecked once looked alike."""
    style, palette = qapp.style().name(), QApplication.palette()
    apply_theme(qapp)
    yield
    qapp.setStyle(style)
    qapp.setPalette(palette)


def background(button):
    """The colour a few pixels inside the left edge, half-way down: the button's face, not its text."""
    img = button.grab().toImage()
    return img.pixelColor(4, img.height() // 2)


def distance(a, b) -> int:
    return abs(a.red() - b.red()) + abs(a.green() - b.green()) + abs(a.blue() - b.blue())


def test_checked_edit_mask_looks_different(qtbot):
    view = ScoreMatrix()
    qtbot.addWidget(view)
    view.resize(700, 500)
    view.show()
    off = background(view.edit_button)
    qtbot.mouseClick(view.edit_button, Qt.MouseButton.LeftButton)
    assert view.edit_button.isChecked()
    on = background(view.edit_button)
    assert distance(on, off) > 60, (on.name(), off.name())
    qtbot.mouseClick(view.edit_button, Qt.MouseButton.LeftButton)
    assert distance(background(view.edit_button), off) < 10


def test_the_selected_stage_stands_out_and_uses_the_cli_names(qtbot):
    view = ScoreMatrix()
    qtbot.addWidget(view)
    view.resize(700, 500)
    view.show()
    assert [view.kind_buttons[k].text() for k in KINDS] == [KIND_LABELS[k] for k in KINDS]
    assert view.kind_buttons["scores"].text() == "scores (scaled)"
    for kind in KINDS:  # each CLI word appears on its button
        assert kind in view.kind_buttons[kind].text()
    qtbot.mouseClick(view.kind_buttons["scores"], Qt.MouseButton.LeftButton)
    assert view.kind_buttons["scores"].isChecked()
    on = background(view.kind_buttons["scores"])
    for kind in ("raw", "masked_scores", "probs"):
        assert distance(on, background(view.kind_buttons[kind])) > 60
