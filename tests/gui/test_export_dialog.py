"""File > Export…: the dialog previews a matplotlib figure and writes PNG, SVG or PDF."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "figures"))
from keys import press  # noqa: E402
from known_source import KnownSource  # noqa: E402
from PySide6.QtWidgets import QWidget  # noqa: E402

from gpt_inspector import figures  # noqa: E402


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


def test_full_resolution_box_writes_every_cell_for_one_head_only(qtbot, known, tmp_path, monkeypatch):
    import base64
    import io

    from matplotlib.image import imread
    from PySide6.QtWidgets import QDialog, QMessageBox

    from gpt_inspector.gui import export_dialog as ed

    monkeypatch.setattr(QMessageBox, "warning", lambda *a, **k: pytest.fail(a[2]))
    boxes, sizes, jobs = [], [], []
    target = {"path": tmp_path / "full.svg"}

    def fake_exec(self):
        qtbot.addWidget(self)
        boxes.append(self.full_box)
        self.set_path(target["path"].with_suffix(".png"))
        if self.full_box is not None:
            assert not self.full_box.isChecked()  # pooled stays the default
            self.full_box.click()
            sizes.append(self.size_label.text())
        self.set_path(target["path"])
        return QDialog.DialogCode.Accepted

    monkeypatch.setattr(ed.ExportDialog, "exec", fake_exec)
    win, done = FakeWindow(known), []
    qtbot.addWidget(win)
    real = win.run_in_worker
    win.run_in_worker = lambda fn, cb=None: jobs.append(fn) or real(fn, cb)
    ed.export_view(win, 0, 1, "probs", on_done=done.append)
    t = known.cache_length
    # the figure for the preview, then the full-resolution file: both on the worker
    assert done == [tmp_path / "full.svg"] and len(jobs) == 2 and boxes[0] is not None
    assert sizes == ["heatmap 396 × 396 pixels (66×66 per cell) plus labels"]  # 2 inches at 200 dpi, 6 cells
    svg = ET.parse(done[0]).getroot()
    image = next(e for e in svg.iter("{http://www.w3.org/2000/svg}image") if e.get("width") == str(t))
    data = base64.b64decode(image.get("{http://www.w3.org/1999/xlink}href").split(",", 1)[1])
    assert imread(io.BytesIO(data)).shape[:2] == (t, t)
    assert any("full resolution" in "".join(e.itertext()) for e in svg.iter("{http://www.w3.org/2000/svg}text"))

    target["path"] = tmp_path / "full.png"
    ed.export_view(win, 0, 1, "probs", on_done=done.append)
    fig = figures.head_figure(known, 0, 1, "probs", dpi=200, full_resolution=True)
    data = done[-1].read_bytes()
    assert int.from_bytes(data[16:20], "big") == figures.pixel_size(fig, 200)[0]

    ed.export_grid(win, None, "probs", on_done=done.append)
    assert boxes[-1] is None  # grids are always pooled: no box


def test_window_ctrl_e_full_resolution_writes_on_the_worker(shown, wait_idle, qtbot, monkeypatch, tmp_path, no_dialogs):
    """The real window: Ctrl+E, tick "Full resolution", save as SVG; the worker writes the T x T image."""
    import base64
    import io
    import threading

    from matplotlib.image import imread
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QDialog

    from gpt_inspector.figures import stream
    from gpt_inspector.gui import export_dialog as ed

    win = shown()
    press(qtbot, win, Qt.Key.Key_F10)
    snap = wait_idle(win)
    target, threads = tmp_path / "head.svg", []
    real = stream.write_head  # written in row bands, never the whole T x T at once
    monkeypatch.setattr(stream, "write_head", lambda *a, **k: threads.append(threading.get_ident()) or real(*a, **k))

    def accept(self):
        qtbot.addWidget(self)
        self.show()  # exec() would block: shown instead, so the click lands on the box
        qtbot.waitExposed(self)
        qtbot.mouseClick(self.full_box, Qt.MouseButton.LeftButton)
        assert self.full_box.isChecked()
        self.set_path(target)
        return QDialog.DialogCode.Accepted

    monkeypatch.setattr(ed.ExportDialog, "exec", accept)
    press(qtbot, win, Qt.Key.Key_E, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: "at full resolution" in win.statusBar().currentMessage() or bool(no_dialogs), timeout=20000)
    assert not no_dialogs, no_dialogs
    assert threads and threads[0] != threading.get_ident()  # model work off the GUI thread
    t = snap.T
    root = ET.parse(target).getroot()
    image = next(e for e in root.iter("{http://www.w3.org/2000/svg}image") if e.get("width") == str(t))
    data = base64.b64decode(image.get("{http://www.w3.org/1999/xlink}href").split(",", 1)[1])
    assert imread(io.BytesIO(data)).shape[:2] == (t, t)
    assert not win.errors


def test_export_that_cannot_be_written_says_why_in_a_dialog(qtbot, known, tmp_path, monkeypatch):
    import os

    from PySide6.QtWidgets import QDialog, QMessageBox
    from writing import full_disk

    from gpt_inspector.gui import export_dialog as ed

    warnings = []
    monkeypatch.setattr(QMessageBox, "warning", lambda *a, **k: warnings.append(a[2]))
    target = {}

    def fake_exec(self):
        qtbot.addWidget(self)
        self.set_path(target["path"])
        return QDialog.DialogCode.Accepted

    monkeypatch.setattr(ed.ExportDialog, "exec", fake_exec)
    win, done = FakeWindow(known), []
    qtbot.addWidget(win)
    old = b"\x89PNG old " * 700
    (tmp_path / "old.png").write_bytes(old)
    os.mkfifo(tmp_path / "pipe.png")
    (tmp_path / "link.png").symlink_to(tmp_path / "old.png")
    for name, words in (("pipe.png", "pipe"), ("link.png", "symbolic link"), ("old.png", "No space left")):
        target["path"] = tmp_path / name
        if name == "old.png":
            with full_disk(tmp_path, monkeypatch, after=1000):
                ed.export_view(win, 0, 1, "probs", on_done=done.append)
        else:
            ed.export_view(win, 0, 1, "probs", on_done=done.append)
        assert done[-1] is None and words in warnings[-1] and "\n" not in warnings[-1], warnings
    assert (tmp_path / "old.png").read_bytes() == old
    assert sorted(os.listdir(tmp_path)) == ["link.png", "old.png", "pipe.png"]


def test_the_matrix_export_button_says_what_export_writes(shown, wait_idle, qtbot, monkeypatch, no_dialogs):
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QToolButton

    import gpt_inspector.gui.export_dialog as ed

    win = shown()
    press(qtbot, win, Qt.Key.Key_F10)
    wait_idle(win)
    button = next(b for b in win.score_matrix.findChildren(QToolButton) if b.text() == "Export…")
    tip = button.toolTip()
    # the dialog it opens offers these files and no others (a CSV was once promised and never written)
    assert "CSV" not in tip.upper()
    assert all(ext[1:].upper() in tip for ext in ed.FILTERS)
    offered = []
    monkeypatch.setattr(ed, "_show", lambda parent, fig, name, scale, what, *a, **k: offered.append(name))
    qtbot.mouseClick(button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: bool(offered) or bool(no_dialogs), timeout=20000)
    assert not no_dialogs and offered[0].endswith(".png")
