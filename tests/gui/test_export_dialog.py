"""File > Export…: the dialog previews a matplotlib figure and writes PNG, SVG or PDF."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "figures"))
from known_source import KnownSource  # noqa: E402

from gpt_inspector import figures  # noqa: E402


from PySide6.QtWidgets import QWidget  # noqa: E402


class FakeWindow(QWidget):
    """Just the window API the export dialog uses; the "worker" runs the job at once."""

    def __init__(self, source):
        super().__init__()
        self.source, self.errors = source, []

    def run_in_worker(self, fn, callback=None):
        try:
            result, error = fn(self.source), None
        except Exception as e:
            result, error = None, e
        callback(result, error)
        return 1

    def show_error(self, title, message, kind):
        self.errors.append((title, message, kind))


@pytest.fixture
def known():
    return KnownSource()


def test_export_dialog_writes_the_chosen_file(qtbot, known, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QDialog, QMessageBox

    from gpt_inspector.gui import export_dialog as ed

    warnings = []
    monkeypatch.setattr(QMessageBox, "warning", lambda *a, **k: warnings.append(a[2]))
    target = {"path": tmp_path / "dlg.png", "scale": 1.5}
    previews = []

    def fake_exec(self):
        qtbot.addWidget(self)
        previews.append(self.preview.pixmap().width())
        self.set_path(target["path"])
        self.scale_spin.setValue(target["scale"])
        assert self.scale_spin.isEnabled() == (target["path"].suffix == ".png")
        return QDialog.DialogCode.Accepted

    monkeypatch.setattr(ed.ExportDialog, "exec", fake_exec)
    win, done = FakeWindow(known), []
    qtbot.addWidget(win)
    ed.export_view(win, 0, 1, "probs", on_done=done.append)
    assert done == [tmp_path / "dlg.png"] and not warnings and previews[0] > 100
    fig = figures.head_figure(known, 0, 1, "probs")
    data = done[0].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(data[16:20], "big") == figures.pixel_size(fig, 150)[0]

    target["path"] = tmp_path / "grid.svg"
    ed.export_grid(win, None, "masked_scores", on_done=done.append)
    assert done[-1] == tmp_path / "grid.svg"
    ET.parse(done[-1])

    target["path"] = tmp_path / "grid.pdf"
    ed.export_grid(win, 1, "probs", on_done=done.append)
    assert done[-1].read_bytes().startswith(b"%PDF-")

    # a bad layer is reported in a message box, and no dialog opens
    n = len(previews)
    ed.export_view(win, 9, 0, "probs", on_done=done.append)
    assert done[-1] is None and len(previews) == n
    assert warnings and "layer" in warnings[-1]


def test_export_dialog_format_follows_the_path(qtbot, known):
    from gpt_inspector.gui.export_dialog import ExportDialog

    d = ExportDialog(None, figures.head_figure(known, 0, 0, "probs"), "a.png", 2.0, "test")
    qtbot.addWidget(d)
    d.set_path("/tmp/x.svg")
    assert d.suffix() == ".svg" and not d.scale_spin.isEnabled()
    assert "vector" in d.size_label.text()
    d.set_path("/tmp/x.pdf")
    assert d.suffix() == ".pdf" and not d.scale_spin.isEnabled()
    d.format_box.setCurrentIndex(d.format_box.findData(".png"))
    assert d.path().name == "x.png" and d.scale_spin.isEnabled()
    assert "pixels" in d.size_label.text()
    d.set_path("/tmp/noext")
    assert d.path().suffix == ".png"
    assert not d.preview.pixmap().isNull()
