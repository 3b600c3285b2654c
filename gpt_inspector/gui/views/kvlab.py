"""KV cache lab panel: run a cache policy beside the full cache and watch what it costs, step by step.

``KVLabPanel`` only displays; ``create_panel(window)`` runs the lab (two sessions: the reference
and the policy run, built from the shown session's model and prompt) on the worker thread, so
the GUI thread never runs the model; on a remote engine's session the engine runs it
(``RemoteSession.remote_kvlab``) and only the steps shown come back; Show policy run then shows its
policy run read there (``remote.run_view.RemotePolicyRun``). What comes back is a ``LabView``:
copies, never the lab. Stop ends a Run after its current step (the steps made stay).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QLabel,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTableWidgetItem,
    QWidget,
)

from ...core.errors import Cancelled, InspectorError
from ...core.kvlab.registry import NAMES as POLICIES  # the registry imports no torch: neither does the panel
from ...core.kvlab.registry import QUANT, rule
from .common import FlowLayout, PanelJob, group, report_error, table, vbox, wrapped_label

PANEL_TITLE = "KV cache lab"
PANEL_AREA = "qkv"  # a tab of the Q/K/V dock: the KV cache view beside it shows what the policy evicted
WIDE = 640  # px: from this width the KL plot and the bytes table sit side by side
PROBE = "cache probe"  # the probe's progress notes, told from a Run's by this name
# the schedule picker's items: what it shows, what the policy takes (core.kvlab.serving)
SHOWN = "KV lab policy run"  # the policy run's name in the window's run switcher
SCHEDULES = (("every step", "step"), ("prefill only", "prefill"), ("every 2 steps", 2), ("every 4 steps", 4),
             ("every 8 steps", 8), ("append-only", "append"))  # fmt: skip


@dataclass(frozen=True)
class LabView:
    """What the panel shows of a lab after a run or a step (owned copies)."""

    policy: str
    free_running: bool
    steps: tuple  # LabStep records (the lab never changes one after it is made)
    first_divergence: int | None
    parted_at: int | None
    finished: str | None = None  # why no step can follow (EOS, the context), as the lab says

    @classmethod
    def of(cls, lab) -> LabView:
        return cls(lab.policy.describe(), lab.free_running, tuple(lab.history), lab.first_divergence,
                   lab.parted_at if lab.free_running else None, lab.finished)  # fmt: skip

    def first(self, n: int) -> LabView:
        """The view after the lab's first ``n`` steps (a step back in the window undid the rest)."""
        steps = self.steps[:n]
        first = next((s.index for s in steps if not s.agree), None)
        parted = next((s.index for s in steps if s.policy_token != s.reference_token), None)
        return LabView(self.policy, self.free_running, steps, first, parted if self.free_running else None)


class KVLabPanel(QWidget):
    """Policy controls, the per-step KL / top-1 plot with the first divergence marked, bytes per layer."""

    run_requested = Signal()
    step_requested = Signal()
    back_requested = Signal()
    probe_requested = Signal()
    show_requested = Signal()
    progressed = Signal(str, int, int)  # what runs, steps done, planned: emitted on the worker, shown here

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.view: LabView | None = None
        # GUI thread only: the lab (its sessions belong to the worker; the reference is handed to jobs),
        # the panel's job, and the source ids around "Show in window" that the panel follows
        self.lab = None
        self.job: PanelJob | None = None
        self.shown_from: int | None = None  # the window's source before it showed the policy run
        self.shown_id: int | None = None  # the policy run's source id once the window shows it
        self.following = False  # the policy run was handed to the window
        self.policy = QComboBox(
            toolTip="Eviction (streaming … keynorm) or quantization (int8 … fp8-e5m2) of the KV cache"
        )
        self.policy.addItems(POLICIES)
        for i, name in enumerate(POLICIES):  # each item's rule as its tooltip; the chosen one's below the picker
            self.policy.setItemData(i, rule(name), Qt.ItemDataRole.ToolTipRole)
        self.rule = wrapped_label("", rich=False)
        self.policy.currentTextChanged.connect(lambda name: self.rule.setText(rule(name)))
        self.policy.setCurrentText("h2o")
        self.budget = QSpinBox(minimum=0, maximum=1_000_000, value=32, specialValueText="unlimited",
                               toolTip="Cache entries kept per KV head (eviction policies); 0 = unlimited")  # fmt: skip
        self.steps = QSpinBox(minimum=1, maximum=4096, value=16, toolTip="Lab steps per Run")
        self.schedule = QComboBox(toolTip="When the cache is cut to the budget: after every step, after the prompt "
                                  "only, every N steps (growing by N - 1 in between), or never (append-only: just "
                                  "the accounting)")  # fmt: skip
        self.schedule.addItems([text for text, _ in SCHEDULES])
        self.page = QSpinBox(minimum=1, maximum=1024, value=1, specialValueText="entries",
                             toolTip="Evict whole pages of this many positions (ranked by their entries' mean score), "
                                     "as a paged cache allocates them; bytes are shown in pages beside")  # fmt: skip
        self.shared = QCheckBox("AdaKV", toolTip="A layer's KV heads share their budgets, allocated by score (each "
                                "keeps a safeguard of 20% of its own)")  # fmt: skip
        self.free = QCheckBox(
            "free-running", toolTip="The policy run chooses its own tokens (default: it is fed the reference's)"
        )
        self.run_button = QPushButton("Run", toolTip="Start a lab from this session's prompt and run the steps")
        self.run_button.clicked.connect(self.run_requested)
        # read by the job on the worker between two lab steps (a remote one: sent to the engine)
        self.stop = threading.Event()
        self.stop_button = QPushButton("Stop", enabled=False, toolTip="End the Run after its current step: the "
                                       "steps made so far stay, and Step goes on from them; or cancel the cache probe")  # fmt: skip
        self.stop_button.clicked.connect(self.stop.set)
        # the other buttons act on a lab: off until Run made one
        self.step_button = QPushButton("Step", toolTip="One more lab step", enabled=False)
        self.step_button.clicked.connect(self.step_requested)
        self.back_button = QPushButton("Back", enabled=False, toolTip="Undo the last lab step exactly: both runs and "
                                       "the policy's own state (scores, evictions, quantized rows)")  # fmt: skip
        self.back_button.clicked.connect(self.back_requested)
        self.probe_button = QPushButton("Probe cache", enabled=False,
                                        toolTip="Run the cache probe on layer 0 of the policy's cache: prompt tokens recovered")  # fmt: skip
        self.probe_button.clicked.connect(self.probe_requested)
        self.show_button = QPushButton("Show policy run", enabled=False, toolTip="Show the policy run in the window: evicted "
                                       "entries are masked columns in the score matrix, the KV cache shows what attention read (the lab ends there)")  # fmt: skip
        self.show_button.clicked.connect(self.show_requested)
        self.policy.currentTextChanged.connect(self._policy_changed)
        self.status = wrapped_label("pick a policy and a budget, then Run: the lab steps it beside the full cache")
        self.bytes_label = QLabel("")
        self.privacy_label = QLabel("")

        # a short axis title: a long one was clipped to its middle letters on a plot ~150 px tall
        self.plot = pg.PlotWidget(labels={"bottom": "step", "left": "KL, nats"})
        self.plot.setToolTip("KL(reference ‖ policy) per step, in nats; ✗ where the policy's top-1 token differs")
        self.plot.setMinimumHeight(140)
        self.plot.addLegend(offset=(-10, 10))
        self.kl_curve = self.plot.plot([], [], pen=pg.mkPen((66, 133, 244), width=2), symbol="o", symbolSize=5,
                                       name="KL")  # fmt: skip
        self.miss = self.plot.plot([], [], pen=None, symbol="x", symbolSize=9, symbolPen=pg.mkPen((219, 68, 55), width=2),
                                   name="top-1 differs")  # fmt: skip
        self.divergence = pg.InfiniteLine(angle=90, pen=pg.mkPen((219, 68, 55), width=1, style=Qt.PenStyle.DashLine))
        self.divergence.setVisible(False)
        self.plot.addItem(self.divergence)

        self.table = table(["layer", "policy bytes", "full bytes", "evicted", "max lost mass"])
        self.table.setMinimumHeight(110)

        # the panel is a tab of the Q/K/V dock (~300-450 px wide): the controls wrap, Run stays in reach
        top = FlowLayout(spacing=6)
        for w in (group(QLabel("policy"), self.policy), group(QLabel("budget"), self.budget),
                  group(QLabel("evict"), self.schedule), group(QLabel("page"), self.page), self.shared,
                  group(QLabel("steps"), self.steps), self.free, self.run_button, self.stop_button, self.step_button,
                  self.back_button,
                  self.probe_button, self.show_button):  # fmt: skip
            top.addWidget(w)
        self.split = QSplitter(Qt.Horizontal)
        self.split.addWidget(self.plot)
        self.split.addWidget(self.table)
        vbox(self, top, self.rule, self.status, self.bytes_label, self.privacy_label, (self.split, 1))

    def resizeEvent(self, ev) -> None:  # noqa: N802 (Qt)
        super().resizeEvent(ev)
        # side by side only where both get a readable width; in the narrow Q/K/V dock the plot sits
        # above the table and the dock scrolls, rather than squeezing the plot to a strip
        want = Qt.Orientation.Horizontal if self.width() >= WIDE else Qt.Orientation.Vertical
        if self.split.orientation() != want:
            self.split.setOrientation(want)

    def _policy_changed(self, name: str) -> None:
        for w in (self.budget, self.schedule, self.page, self.shared):  # eviction's knobs
            w.setEnabled(name not in QUANT)

    def settings(self) -> tuple[str, int | None, int, bool]:
        name = self.policy.currentText()
        budget = None if name in QUANT or self.budget.value() == 0 else self.budget.value()
        return name, budget, self.steps.value(), self.free.isChecked()

    def options(self) -> dict:
        """The eviction policy's serving options (schedule, page, share); none for a quantization."""
        if self.policy.currentText() in QUANT:
            return {}
        return {"schedule": SCHEDULES[self.schedule.currentIndex()][1], "page": self.page.value(),
                "share": "layer" if self.shared.isChecked() else "head"}  # fmt: skip

    def set_busy(self, busy: bool, text: str = "") -> None:
        for b in (self.run_button, self.step_button, self.back_button, self.probe_button, self.show_button):
            b.setEnabled(not busy and (b is self.run_button or self.view is not None))
        self.stop_button.setEnabled(busy)
        if busy:
            self.status.setText(text)

    def clear(self, text: str) -> None:
        self.view = None
        self.kl_curve.setData([], [])
        self.miss.setData([], [])
        self.divergence.setVisible(False)
        self.table.setRowCount(0)
        self.bytes_label.setText("")
        self.privacy_label.setText("")
        self.status.setText(text)
        self.set_busy(False)

    def show_view(self, v: LabView) -> None:
        self.view = v
        self.set_busy(False)
        steps = v.steps
        if not steps:
            self.clear("the lab is at its prompt: Step runs its first step")
            self.view = v
            self.set_busy(False)
            return
        idx = np.array([s.index + 1 for s in steps], dtype=float)  # steps count from 1, as in the window
        kl = np.array([s.kl for s in steps], dtype=float)
        self.kl_curve.setData(idx, kl)
        bad = np.array([not s.agree for s in steps])
        self.miss.setData(idx[bad], kl[bad])
        k = v.first_divergence
        self.divergence.setVisible(k is not None)
        if k is not None:
            self.divergence.setPos(k + 1)
        last = steps[-1]
        fd = "none yet" if k is None else f"step {k + 1}"
        parted = "" if not v.free_running else (
            "; the texts have not parted" if v.parted_at is None else f"; the texts part at step {v.parted_at + 1}")  # fmt: skip
        # a run that ended early (EOS) said nothing: it looked like a lab that ran fewer steps than asked
        parted += f"; finished after step {last.index + 1} ({v.finished}): no step can follow" if v.finished else ""
        self.status.setText(f"{v.policy}, {'free-running' if v.free_running else 'teacher-forced'}: {len(steps)} steps, "
                            f"mean KL {kl.mean():.3e}, top-1 agreement {np.mean([s.agree for s in steps]):.0%}, "
                            f"first divergence {fd}{parted}")  # fmt: skip
        pol, full, kept = sum(last.bytes_policy), sum(last.bytes_full), sum(last.bytes_kept)
        # the full cache is the model's own (sliding-window layers: their window); the inspector keeps every position
        paged = "" if last.page == 1 or last.bytes_paged is None else (
            f"; in pages of {last.page}: {sum(last.bytes_paged):,} of {sum(last.bytes_full_paged or []):,}")  # fmt: skip
        self.bytes_label.setText(f"cache after step {last.index + 1}: {pol:,} of {full:,} bytes ({pol / full:.1%})"
                                 + (f"; kept for inspection {kept:,}" if kept > full else "") + paged)  # fmt: skip
        self.table.setRowCount(len(last.bytes_policy))
        lost = last.lost_mass
        kept_per_layer = last.bytes_kept or last.bytes_full
        for layer, (bp, bf, bk) in enumerate(zip(last.bytes_policy, last.bytes_full, kept_per_layer)):
            mass = "n/a" if np.isnan(lost[layer]).any() else f"{float(lost[layer].max()):.3f}"
            full_text = f"{bf:,}" + (f" (kept {bk:,})" if bk > bf else "")
            cells = [str(layer), f"{bp:,}", full_text, str(last.evicted_now[layer]), mass]
            for j, text in enumerate(cells):
                self.table.setItem(layer, j, QTableWidgetItem(text))

    def show_progress(self, name: str, done: int, planned: int) -> None:
        if name == PROBE:
            self.status.setText(f"probing the policy's cache for the prompt: forward pass {done} of {planned}…")
        else:
            self.status.setText(f"running {name}: step {done} of {planned}…")

    def show_privacy(self, r) -> None:
        self.set_busy(False)
        self.privacy_label.setText(f"cache probe, layer 0 of the policy's cache: {r.recovered} of {r.prompt_tokens} "
                                   f"prompt tokens recovered ({r.held} still held)")  # fmt: skip


def create_panel(window) -> KVLabPanel:
    """Dock hook: the lab lives on the worker; Run starts it from the shown session's prompt."""
    panel = KVLabPanel()

    def failed(error) -> None:
        from ..remote_link import dropped_note  # here: a panel that never met an engine imports no client

        if isinstance(error, Cancelled):  # the user pressed Stop: said on the panel, no dialog
            panel.status.setText("the cache probe was stopped: the lab is as it was")
            return
        note = dropped_note(error)
        if note is not None:  # the window's band says so and reconnects: the lab shown stays, no dialog
            if panel.view is not None:
                panel.show_view(panel.view)  # its status line, which the job's progress wrote over
            panel.status.setText(f"{panel.status.text()}\n{note}".strip())
            return
        panel.status.setText(str(error))
        report_error(window, "Cannot run the KV cache lab", error)

    panel.job = PanelJob(window, panel.set_busy, failed)

    def run() -> None:
        name, budget, n, free = panel.settings()
        opts = panel.options()
        if not panel.job.running:
            panel.following = False  # a fresh lab: not the one shown in the window

        panel.stop.clear()

        def job(src):
            from ...core.kvlab import KVLab, make

            src.live.require("kvlab")
            if getattr(src, "engine", None) is not None:  # the engine runs it and sends the steps
                lab = src.remote_kvlab(name, budget, n, free, opts, progress=lambda _w, i, _n: panel.progressed.emit(
                    name, i, n), cancelled=panel.stop.is_set)  # fmt: skip
                return lab, LabView.of(lab)
            d = src.decoding
            lab = KVLab(src.lm, policy=make(name, budget, **opts), prompt_ids=list(src.prompt_ids), free_running=free,
                        temperature=d.temperature, top_k=d.top_k, top_p=d.top_p, seed=src.seed)  # fmt: skip
            for i, _ in enumerate(lab.steps(n), 1):
                panel.progressed.emit(name, i, n)  # queued to the GUI thread
                if i < n and panel.stop.is_set():
                    break
            return lab, LabView.of(lab)

        def done(result) -> None:
            panel.lab, view = result
            panel.show_view(view)

        panel.job.submit(job, done, f"running {name} for {n} steps beside the full cache…", stop=panel.stop.set)

    def on_lab(act, what: str, show=None, stop=None) -> None:
        """Run ``act(lab)`` on the worker, then ``show`` what it returned, or (no ``show``) the lab as it is."""
        lab = panel.lab  # read here, on the GUI thread; the job only uses it on the worker

        def job(_src):
            if lab is None:
                raise InspectorError("no lab yet: press Run first")
            out = act(lab)
            return out if show is not None else LabView.of(lab)

        panel.job.submit(job, show or panel.show_view, what, stop=stop)

    def show() -> None:
        lab = panel.lab
        if lab is None or panel.job.running:
            return
        # the worker owns the lab's sessions already; from here the window steps the policy run itself
        snap = window.snapshot
        panel.following, panel.shown_from, panel.shown_id = True, None if snap is None else snap.source_id, None
        said = "the policy run is shown in the window; its Step back undoes lab steps too"
        if lab.run is not None:
            window.show_source(lab.run, name=SHOWN)  # beside the live session, which stays
            panel.status.setText(said)
            return

        def shown(run) -> None:
            window.show_source(run, name=SHOWN)
            panel.status.setText(said)

        # on a remote engine the run stays there: its mirror reads the link, so it is made on the worker
        panel.job.submit(lambda _src: lab.policy_run(), shown, "opening the policy run on the engine…")

    def follow(snap) -> None:
        # the window's Step back on the shown policy run undoes lab steps (the lab follows its run's
        # events): show the steps that remain, read off the view already here, not the lab
        if panel.lab is None or snap is None or not panel.following:
            return
        if panel.shown_id is None and snap.source_id != panel.shown_from:
            panel.shown_id = snap.source_id
        v = panel.view
        if snap.source_id == panel.shown_id and v is not None and not panel.job.running and snap.n_steps < len(v.steps):
            panel.show_view(v.first(snap.n_steps))

    panel.show_requested.connect(show)
    panel.progressed.connect(panel.show_progress)  # a bound method: PySide runs a lambda on the emitting thread
    window.snapshot_changed.connect(follow)
    panel.run_requested.connect(run)
    panel.step_requested.connect(lambda: on_lab(lambda lab: lab.step(), "one more lab step…"))
    panel.back_requested.connect(lambda: on_lab(lambda lab: lab.step_back(), "stepping the lab back…"))

    def probe(lab):
        def note(done: int, total: int) -> None:
            panel.progressed.emit(PROBE, done, total)  # queued to the GUI thread

        if lab.run is None:  # on the engine: Stop is sent there, which ends the probe between two forwards
            return lab.probe(progress=note, cancelled=panel.stop.is_set)

        def progress(done: int, total: int) -> None:
            note(done, total)
            if panel.stop.is_set():
                raise Cancelled("the cache probe was stopped")

        return lab.probe(progress=progress)

    def probe_requested() -> None:
        if not panel.job.running:
            panel.stop.clear()  # a Stop meant for an earlier job does not end this one
        on_lab(probe, "probing the policy's cache for the prompt…", panel.show_privacy, panel.stop.set)

    panel.probe_requested.connect(probe_requested)
    return panel
