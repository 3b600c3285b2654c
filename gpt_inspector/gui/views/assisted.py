"""Assisted decoding panel: a draft model or prompt lookup proposes, the live session (the target) verifies.

``AssistedPanel`` only displays; ``create_panel(window)`` keeps a ``core.assisted.Assisted`` over the
live session and runs its rounds on the worker thread (Start, Round, Back; Tools ▸ Assisted decoding:
next round, Ctrl+Shift+R), so every view shows the target's steps as the rounds add them. What comes
back is an ``AssistedView``: copies, never the run.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtGui import QColor
from PySide6.QtWidgets import QComboBox, QLineEdit, QPushButton, QSpinBox, QTableWidgetItem, QWidget

from ...core.errors import InspectorError
from ...core.kv_layout import human_bytes
from .common import FlowLayout, PanelJob, group, report_error, table, vbox, wrapped_label

PANEL_TITLE = "Assisted"  # short: its tab must fit beside others at 1366x768
PANEL_AREA = "bottom"
LOOKUP, DRAFT = "prompt lookup", "draft model"
ACCEPTED, REJECTED = QColor(52, 168, 83), QColor(219, 68, 55)
COLUMNS = ("round", "proposed", "accepted", "rejected", "target's token", "target KV", "draft KV")


@dataclass(frozen=True)
class AssistedView:
    """What the panel shows of a run (owned copies): the rounds, their tokens' labels, the totals."""

    mode: str
    rounds: tuple  # core.assisted.Round (frozen)
    labels: dict  # token id -> its readable label
    summary: dict
    finished: str | None

    @classmethod
    def of(cls, a) -> AssistedView:
        s = a.session
        ids = {t for r in a.rounds for t in (*r.proposed, *r.tokens)}
        fin = s.finished or ("max length" if a.ended else None)
        return cls(a.mode, tuple(a.rounds), {i: s.label(i) for i in ids}, a.summary(), fin)


class AssistedPanel(QWidget):
    """The proposer's controls, one row per round, the acceptance rate over the run."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.view: AssistedView | None = None
        self.run = None  # GUI thread holds it, the worker uses it (the session belongs to the worker)
        self.job: PanelJob | None = None
        self.mode = QComboBox(toolTip="Who proposes: prompt lookup (n-grams of the text so far) or a draft model")
        self.mode.addItems([LOOKUP, DRAFT])
        self.path = QLineEdit(placeholderText="draft model: hub id or folder (on a remote engine: its folder there)",
                              toolTip="The draft model, loaded as the target was; its vocabulary must be the target's")  # fmt: skip
        self.path.setEnabled(False)
        self.tokens = QSpinBox(minimum=1, maximum=64, value=5, toolTip="Tokens proposed per round "
                               "(prompt_lookup_num_tokens; a draft model's num_assistant_tokens)")  # fmt: skip
        self.max_new = QSpinBox(minimum=1, maximum=100_000, value=32, toolTip="max_new_tokens of the run")
        self.start_button = QPushButton("Start", toolTip="Restart the session at its prompt and assist its steps")
        self.round_button = QPushButton("Round", enabled=False, toolTip="Propose, verify in one forward of the "
                                        "target, keep the agreed tokens and crop the rest (Ctrl+Shift+R)")  # fmt: skip
        self.back_button = QPushButton("Back", enabled=False, toolTip="Undo the last round: its steps stepped back")
        self.mode.currentTextChanged.connect(lambda m: self.path.setEnabled(m == DRAFT))
        self.status = wrapped_label("pick prompt lookup or a draft model, then Start: each Round proposes tokens "
                                    "and the session's model verifies them in one forward")  # fmt: skip
        self.rate = wrapped_label("")
        self.table = table(COLUMNS)
        self.table.setToolTip("Per round: the tokens proposed, how many the target kept, those it rejected (cut from "
                              "both caches), its own token, and both KV caches' positions after verifying → after the crop")  # fmt: skip
        controls = QWidget()
        flow = FlowLayout(controls)
        for w in (group(self.mode), group(self.path), group(wrapped_label("tokens"), self.tokens),
                  group(wrapped_label("max new"), self.max_new), self.start_button, self.round_button, self.back_button):  # fmt: skip
            flow.addWidget(w)
        self.path.setMinimumWidth(180)
        vbox(self, controls, self.status, self.rate, (self.table, 1), margin=4)

    def settings(self) -> tuple[str, str, int, int]:
        return self.mode.currentText(), self.path.text().strip(), self.tokens.value(), self.max_new.value()

    def set_busy(self, busy: bool, text: str = "") -> None:
        for b in (self.start_button, self.round_button, self.back_button):
            b.setEnabled(not busy and (b is self.start_button or self.run is not None))
        if busy and text:
            self.status.setText(text)

    def clear(self, why: str = "") -> None:
        if self.run is None:
            why = ""  # nothing was run here: the first words stay
        self.run, self.view = None, None
        self.table.setRowCount(0)
        self.rate.setText("")
        self.set_busy(False)
        if why:
            self.status.setText(why)

    def show_view(self, v: AssistedView) -> None:
        self.view = v
        lab = v.labels

        def words(ids) -> str:
            return " · ".join(lab.get(i, str(i)) for i in ids) or "—"

        self.table.setRowCount(len(v.rounds))
        for row, r in enumerate(v.rounds):
            draft = "—" if r.draft_cache is None else f"{r.draft_cache_proposed} → {r.draft_cache}"
            cells = (str(r.index + 1), words(r.proposed), f"{r.accepted} of {len(r.proposed)}", words(r.rejected),
                     words(r.tokens[r.accepted :]) if len(r.tokens) > r.accepted else "—",
                     f"{r.target_cache_verified} → {r.target_cache}", draft)  # fmt: skip
            for col, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if col == 2 and r.proposed:
                    item.setForeground(ACCEPTED if r.accepted == len(r.proposed) else REJECTED)
                if col == 3 and r.rejected:
                    item.setForeground(REJECTED)
                self.table.setItem(row, col, item)
        if v.rounds:
            self.table.scrollToItem(self.table.item(len(v.rounds) - 1, 0))
        s = v.summary
        rate = "—" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.0%}"
        last = v.rounds[-1] if v.rounds else None
        kv = ""
        if last is not None:
            kv = f" · target KV cache {last.target_cache} positions, {human_bytes(last.target_cache_bytes)}"
            if last.draft_cache is not None and last.draft_cache_bytes is not None:
                kv += f" · draft {last.draft_cache} positions, {human_bytes(last.draft_cache_bytes)}"
        self.rate.setText(f"{v.mode}: acceptance rate {rate} ({s['accepted']} of {s['proposed']} proposed) over "
                          f"{s['rounds']} rounds, {s['new_tokens']} new tokens{kv}")  # fmt: skip
        self.status.setText(f"finished ({v.finished}): Back, or Start again" if v.finished else
                            "Round: propose and verify; Back undoes the last round")  # fmt: skip
        self.set_busy(False)


def create_panel(window) -> AssistedPanel:
    """Dock hook: the run lives on the worker; Start builds it over the live session."""
    panel = AssistedPanel()
    drafts: dict = {}  # path -> LoadedModel, loaded once on the worker

    def failed(error) -> None:
        panel.status.setText(str(error))
        report_error(window, "Assisted decoding", error)

    panel.job = PanelJob(window, panel.set_busy, failed)

    def start() -> None:
        mode, path, n, max_new = panel.settings()
        if mode == DRAFT and not path:
            report_error(window, "Assisted decoding", InspectorError("name a draft model (a hub id or a folder) first"))
            return

        def job(src):
            from ...core.assisted import Assisted
            from ...core.session import Session

            remote = src is not None and src.engine is not None
            if not (isinstance(src, Session) or remote):
                raise InspectorError("assisted decoding steps a live session in this window: not a trace or a beam")
            draft = None
            kw = {"prompt_lookup_num_tokens": n} if mode == LOOKUP else {"num_assistant_tokens": n}
            if remote:  # the engine checks, restarts and runs it; a draft is loaded there, from its disk
                a = Assisted(src, path if mode == DRAFT else None, max_new_tokens=max_new, **kw)
                return a, AssistedView.of(a)
            if mode == DRAFT:
                if path not in drafts:
                    from ...core.models import load_model

                    drafts[path] = load_model(path, device=str(src.lm.device))  # beside the target
                draft = drafts[path]
            # checked before the session is touched: a refusal leaves its steps as they were
            Assisted.check(src, draft, max_new_tokens=max_new, **kw)
            src.restart()
            a = Assisted(src, draft, max_new_tokens=max_new, **kw)
            return a, AssistedView.of(a)

        def done(result) -> None:
            panel.run, view = result
            panel.show_view(view)

        panel.job.submit(job, done, "starting assisted decoding…")

    def on_run(act, what: str) -> None:
        a = panel.run

        def job(_src):
            if a is None:
                raise InspectorError("no assisted run yet: press Start first")
            act(a)
            return AssistedView.of(a)

        panel.job.submit(job, panel.show_view, what)

    def next_round() -> None:
        if panel.run is None:
            window.statusBar().showMessage("Assisted decoding: press Start in its panel first", 5000)
            return
        window.raise_panel(panel)
        on_run(lambda a: a.round(), "proposing and verifying…")

    panel.start_button.clicked.connect(start)
    panel.round_button.clicked.connect(next_round)
    panel.back_button.clicked.connect(lambda: on_run(lambda a: a.back(), "undoing the last round…"))
    window.tools_menu.addAction(window.acts.action("Assisted decoding: next round", next_round, "Ctrl+Shift+R",
                                                   "A draft model or prompt lookup proposes, the model verifies"))  # fmt: skip
    return panel
