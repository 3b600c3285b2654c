"""File > Export…: save the attention heatmap on screen (or a grid of heads) as PNG, SVG or PDF.

The figure is a matplotlib figure from ``gpt_inspector.figures``. For attention it is built on the
worker thread, which owns the session: ``export_view(window, layer, head, kind)`` and
``export_grid(window, layer_or_None, kind)`` post the job through ``window.run_in_worker`` and open
the dialog (a preview, the file, the PNG scale) when the figure comes back, so this thread never
reads the live session. For one head the dialog offers "Full resolution" (every cell unpooled,
``figures.fullres``); that file is built and written by a second worker job once the dialog
closes, since its cells are computed from the session again. ``export_matrix`` draws a matrix the
window already holds (a snapshot's K or V cache) right here. Errors are reported in a message box.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QPixmap
from PySide6.QtWidgets import (
    QApplication,
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPushButton,
    QScrollArea,
    QWidget,
)

from .. import figures
from ..core import outfile
from ..core.attention import KIND_LABELS
from ..core.errors import InspectorError, StepFailed
from ..figures import fullres
from .views.common import hbox, vbox

FILTERS = {".png": "PNG image (*.png)", ".svg": "SVG image (*.svg)", ".pdf": "PDF document (*.pdf)"}
PREVIEW_DPI = 100.0

# _show's answer when the full-resolution file is written later, by a worker job that reports itself
_LATER = object()

# the folder of the last export, so a series of exports lands together (this process only)
_last_dir: Path | None = None


class ExportDialog(QDialog):
    """A preview of one figure, and where and how to save it; shows the resulting image size."""

    def __init__(self, parent: QWidget | None, figure, default_name: str, scale: float, what: str,
                 preview: bytes | None = None, full_resolution: bool | None = None):  # fmt: skip
        super().__init__(parent)
        self.figure = figure
        self.setWindowTitle("Export image")
        self.setMinimumWidth(520)
        self._browsed: str | None = None

        if preview is None:
            preview = figures.to_bytes(figure, "png", PREVIEW_DPI)
        pixmap = QPixmap()
        pixmap.loadFromData(preview, "PNG")
        self.preview = QLabel()
        self.preview.setPixmap(pixmap)
        self.preview.setAlignment(Qt.AlignmentFlag.AlignCenter)
        scroll = QScrollArea()
        scroll.setWidget(self.preview)
        scroll.setWidgetResizable(True)
        scroll.setMinimumSize(min(pixmap.width() + 24, 760), min(pixmap.height() + 24, 520))

        self.path_edit = QLineEdit(str((_last_dir or Path.home()) / default_name))
        row = hbox(None, (self.path_edit, 1), QPushButton("Browse…", clicked=self._browse))

        self.format_box = QComboBox()
        for text, suffix in (("PNG (bitmap)", ".png"), ("SVG (vector)", ".svg"), ("PDF (vector)", ".pdf")):
            self.format_box.addItem(text, suffix)
        self.scale_spin = QDoubleSpinBox(minimum=0.5, maximum=8.0, singleStep=0.5, decimals=2, suffix=" ×", value=scale,
                                         toolTip="PNG pixels per unit: 1 is 100 dpi; 2 suits high-DPI screens and print")  # fmt: skip
        self.size_label = QLabel()
        # None: not offered (grids, matrices); one head's cells can all be drawn, at any T
        self.full_box = None
        if full_resolution is not None:
            self.full_box = QCheckBox("Full resolution: every cell, unpooled", checked=bool(full_resolution),
                                      toolTip="Draw each query × key cell as itself: whole pixels per cell in a PNG (the "
                                      "image grows with the context), the full matrix embedded in an SVG or PDF. "
                                      f"Past {fullres.MAX_CELLS:,} positions it pools and says the block size.")  # fmt: skip

        form = QFormLayout()
        form.addRow("File:", row)
        form.addRow("Format:", self.format_box)
        form.addRow("Scale:", self.scale_spin)
        if self.full_box is not None:
            form.addRow("Cells:", self.full_box)
        form.addRow("Size:", self.size_label)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Save | QDialogButtonBox.StandardButton.Cancel,
                                   accepted=self.accept, rejected=self.reject)  # fmt: skip
        vbox(self, QLabel(what), (scroll, 1), form, buttons)

        self.format_box.currentIndexChanged.connect(self._format_changed)
        self.path_edit.textChanged.connect(self._path_changed)
        self.scale_spin.valueChanged.connect(self._update)
        if self.full_box is not None:
            self.full_box.toggled.connect(self._update)
        self._path_changed(self.path_edit.text())

    # ------------------------------------------------------------------ state
    def suffix(self) -> str:
        return self.format_box.currentData()

    def path(self) -> Path:
        """The path to write: the typed one, given the chosen format's suffix if it has none."""
        text = self.path_edit.text().strip()
        try:
            p = outfile.expand(text)
        except InspectorError:  # ~nosuchuser: kept as typed; the export says why it cannot write there
            p = Path(text)
        return p if p.suffix else p.with_suffix(self.suffix())

    def dpi(self) -> float:
        return self.scale_spin.value() * figures.DPI

    def full_resolution(self) -> bool:
        return self.full_box is not None and self.full_box.isChecked()

    def set_path(self, path) -> None:
        self.path_edit.setText(str(path))

    # ------------------------------------------------------------------ reactions
    def _browse(self) -> None:
        chosen, selected = QFileDialog.getSaveFileName(
            self, "Export image", str(self.path()), ";;".join(FILTERS.values()), FILTERS[self.suffix()]
        )
        if not chosen:
            return
        p = Path(chosen)
        if p.suffix.lower() not in FILTERS:
            p = p.with_suffix(next((s for s, f in FILTERS.items() if f == selected), self.suffix()))
        self._browsed = str(p)  # the file dialog has already asked about overwriting this one
        self.set_path(p)

    def _format_changed(self) -> None:
        p = Path(self.path_edit.text().strip())
        if p.suffix.lower() in FILTERS and p.suffix.lower() != self.suffix():
            self.set_path(p.with_suffix(self.suffix()))
        self._update()

    def _path_changed(self, text: str) -> None:
        s = Path(text.strip()).suffix.lower()
        if s in FILTERS and s != self.suffix():
            self.format_box.setCurrentIndex(self.format_box.findData(s))
        self._update()

    def _update(self) -> None:
        png = self.suffix() == ".png"
        self.scale_spin.setEnabled(png)
        if png and self.full_resolution():
            b, n, p = fullres.png_layout(len(self.figure.row_labels), self.dpi())
            pooled = f", pooled {b}×{b}" if b > 1 else ""
            self.size_label.setText(f"heatmap {n * p} × {n * p} pixels ({p}×{p} per cell{pooled}) plus labels")
        elif png:
            w, h = figures.pixel_size(self.figure, self.dpi())
            self.size_label.setText(f"{w} × {h} pixels")
        else:
            w, h = self.figure.get_size_inches()
            self.size_label.setText(f"{w:.1f} × {h:.1f} in (vector, scales freely)")

    def accept(self) -> None:
        p = self.path()
        if p.suffix.lower() not in FILTERS:
            QMessageBox.warning(self, "Export image", f"Save as .png, .svg or .pdf, not {p.suffix}.")
            return
        if p.exists() and str(p) != self._browsed:
            answer = QMessageBox.question(self, "Export image", f"{p.name} exists. Replace it?")
            if answer != QMessageBox.StandardButton.Yes:
                return
        super().accept()


def _show(parent, figure, default_name: str, scale: float, what: str, preview: bytes | None = None,
          full=None) -> Path | None:  # fmt: skip
    """Ask where to save ``figure`` and write it there, then close it; the written path, or None.

    ``full(path, dpi)``, if given, offers full resolution; chosen, it is called instead of writing
    ``figure`` and the answer is ``_LATER``.
    """
    try:
        dialog = ExportDialog(parent, figure, default_name, scale, what, preview,
                              full_resolution=None if full is None else False)  # fmt: skip
    except InspectorError as e:
        figures.close(figure)
        QMessageBox.warning(parent, "Export image", str(e))
        return None
    try:
        if dialog.exec() != QDialog.DialogCode.Accepted:
            return None
        path, dpi = dialog.path(), dialog.dpi()
        if full is not None and dialog.full_resolution():
            full(path, dpi)
            return _LATER
        QApplication.setOverrideCursor(Qt.CursorShape.WaitCursor)
        error = None
        try:
            written = figures.save(figure, path, dpi)
        except InspectorError as e:
            error = str(e)
        except MemoryError:
            error = "Not enough memory for this image; lower the scale or use SVG or PDF."
        finally:
            QApplication.restoreOverrideCursor()  # before any message box
        if error is not None:
            QMessageBox.warning(parent, "Export image", error)
            return None
        _exported(parent, f"Exported {what}", written)
        return written
    finally:
        figures.close(figure)


def _exported(window, what: str, path: Path) -> None:
    """The next export starts in ``path``'s folder; the status bar says where the file went (the
    dialog closed: without a word the user cannot tell a save from a cancel)."""
    global _last_dir
    _last_dir = path.parent
    bar = getattr(window, "statusBar", None)
    if callable(bar):
        bar().showMessage(f"{what} to {path}", 15000)


def _report(window, error: BaseException) -> None:
    """The user's to fix (or a window without an error dialog): a message box; else the window's internal error."""
    if isinstance(error, (InspectorError, StepFailed)) or not hasattr(window, "show_error"):
        QMessageBox.warning(window, "Export image", str(error))
    else:
        window.show_error("Export failed", str(error), "internal")


def _in_worker(window, build, default_name: str, scale: float, what: str, on_done=None, full_write=None) -> int | None:
    """Build (and preview) the figure on the worker thread, then open the dialog on this one.

    ``build(source)`` runs where the session lives; ``on_done(path_or_None)`` follows the dialog.
    ``full_write(source, path, dpi)``, if given, writes the full-resolution file on the worker.
    Returns the worker call's serial (None if the window held it back).
    """

    def write_full(path, dpi) -> None:
        def written(result, error) -> None:
            if error is not None:
                _report(window, error)
                result = None
            else:
                _exported(window, f"Exported {what} at full resolution", result)
            if on_done is not None:
                on_done(result)

        window.run_in_worker(lambda source: full_write(source, path, dpi), written)

    def job(source):
        if source is None:
            raise InspectorError("nothing to export yet: load a model or open a trace")
        fig = build(source)
        try:
            # rendered here too: a whole-model grid takes a while, and this thread is not the GUI's
            return fig, figures.to_bytes(fig, "png", PREVIEW_DPI)
        except BaseException:
            figures.close(fig)
            raise

    def done(result, error) -> None:
        path = None
        if error is not None:
            _report(window, error)
        else:
            fig, preview = result
            path = _show(
                window, fig, default_name, scale, what, preview, full=None if full_write is None else write_full
            )
            if path is _LATER:  # write_full reports and calls on_done
                return
        if on_done is not None:
            on_done(path)

    return window.run_in_worker(job, done)


def export_view(window, layer: int, head: int, kind: str, *, on_done=None) -> int | None:
    """Export one head's matrix at stage ``kind``; the figure is built on ``window``'s worker."""
    from ..export import render_heatmap

    def write_full(source, path, dpi):
        return render_heatmap(source, layer, head, kind, path, scale=dpi / figures.DPI, full_resolution=True)

    scale = 2.0
    return _in_worker(
        window,
        lambda source: figures.head_figure(source, layer, head, kind, dpi=scale * figures.DPI),
        f"attention-L{layer}-H{head}-{kind}.png",
        scale,
        f"Layer {layer}, head {head}, {KIND_LABELS.get(kind, kind)}",
        on_done,
        write_full,
    )


def export_grid(window, layer: int | None, kind: str, *, on_done=None) -> int | None:
    """Export every head of ``layer``, or with None every layer x head, as one image."""
    name = f"attention-L{layer}-all-heads-{kind}.png" if layer is not None else f"attention-all-layers-{kind}.png"
    stage = KIND_LABELS.get(kind, kind)  # the CLI's word with its title, as on the stage buttons
    what = f"Layer {layer}, all heads, {stage}" if layer is not None else f"All layers × heads, {stage}"
    return _in_worker(window, lambda source: figures.grid_figure(source, layer, kind), name, 1.0, what, on_done)


def export_matrix(parent, matrix, row_labels, title: str, default_name: str, *, subtitle: str | None = None,
                  row_title: str = "position", col_title: str = "dimension", unverified: str | None = None) -> Path | None:  # fmt: skip
    """Export a 2-D matrix the window already holds (the K or V cache of a layer, say)."""
    try:
        fig = figures.matrix_figure(matrix, row_labels, None, title, subtitle or "", col_title, row_title=row_title)
        figures.mark_unverified(fig, unverified)
    except InspectorError as e:
        QMessageBox.warning(parent, "Export image", str(e))
        return None
    return _show(parent, fig, default_name, 2.0, title)


def export_lens(parent, result, model_name: str, unverified: str | None = None) -> Path | None:
    """Export a logit lens the panel already shows (a plain value: no session is read)."""
    fig = figures.lens_figure(result, model_name, unverified=unverified)
    return _show(parent, fig, f"lens-step{result.step + 1}.png", 2.0, fig.heading)


__all__ = ["ExportDialog", "export_grid", "export_lens", "export_matrix", "export_view"]


def export_kv(window, which: str) -> None:
    """The window's selected layer's K or V cache as an image, from its snapshot (the GUI thread's)."""
    snap = window.snapshot
    m = None if snap is None else (snap.kv_k if which == "k" else snap.kv_v)
    if m is None:
        QMessageBox.information(window, "Export", "Nothing cached yet: run a step first.")
        return
    layer, name = snap.selection.layer, which.upper()
    b = snap.kv_block  # past the exact limit a row is the mean of b positions, labelled by its first
    export_matrix(
        window, m, list(snap.labels[: snap.T : b]),
        f"{snap.model_name} · layer {layer} · {name} cache · step {snap.n_steps}",
        f"kv-L{layer}-{which}.png",
        subtitle=f"{snap.T} positions × {snap.n_kv_heads} KV heads × {snap.head_dim} dims ({snap.dtype})"
        + (f" · rows: means of {b} positions" if b > 1 else ""),
        col_title="KV head × dimension", unverified=snap.unverified,
    )  # fmt: skip
