"""A guided tour of one step of the seed tutorial ("She eats apple" on the demo model, beams 2):
tokens → Q/K/V → raw scores → scaled → masked → softmax → weighted V → next token → two beams →
the cache grows, each stage on the real panel (its dock raised and framed) with the numbers of the
session shown.

Help ▸ Tour starts it; the first start offers it once, on a card (a persisted setting). Keys, while the tour's
card has the focus: → / Enter next, ← / Backspace back, Esc ends it. The tour drives the window
only through what a user could do: the stage buttons' selection, Step (F10) for the prefill when
nothing has run yet and once more for "the cache grows", and the Compare decoding panel's own
controls (2 beams, 2 returned, 3 new tokens, Compare) for the beam search.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PySide6.QtCore import QEvent, QObject, QRect, Qt
from PySide6.QtWidgets import QApplication, QFrame, QLabel, QPushButton, QWidget

from . import help as _help
from . import settings as _settings
from .views.common import hbox, vbox, wrapped_label

OFFERED = "tour/offered"  # the first start asked once; Help ▸ Tour works always


@dataclass(frozen=True)
class Stage:
    dock: str  # the dock it highlights (MainWindow.docks key)
    title: str
    kind: str | None  # the score matrix's stage it selects, None: leave it
    text: Callable[[Tour, object, int], str]  # (tour, snapshot, key) -> HTML with the numbers


def _lab(s, i: int) -> str:
    return f"“{html.escape(s.labels[i])}”"


def _tokens(tour, s, j) -> str:
    chips = " ".join(f"[{html.escape(lab)}]" for lab in s.labels[: s.prompt_len])
    ids = ", ".join(str(i) for i in s.token_ids[: s.prompt_len])
    return (f"The prompt is <b>{s.prompt_len} tokens</b>: {chips} (ids {ids}). The model reads ids, one "
            "position each; ␣ marks a space, which GPT-2's pieces carry before a word. The first step fed the "
            f"whole prompt at once; position {s.query} {_lab(s, s.query)} is the query from here on.")  # fmt: skip


def _qkv(tour, s, j) -> str:
    sel = s.selection
    q = ", ".join(f"{x:.3f}" for x in s.q[:3])
    return (f"In layer {sel.layer}, head {sel.head}, every position's hidden state is multiplied by three matrices: "
            f"<b>q</b> (what it looks for), <b>k</b> (what it offers) and <b>v</b> (what it passes on), "
            f"{len(s.q)} numbers each. q of position {s.query} {_lab(s, s.query)} starts [{q}, …]; K and V "
            f"have one row per cached position: <b>{s.k.shape[0]} rows</b>.")  # fmt: skip


def _raw(tour, s, j) -> str:
    raw = float(s.q.astype(np.float64) @ s.k[j].astype(np.float64))
    return (f"The raw score of query {s.query} {_lab(s, s.query)} for key {j} {_lab(s, j)} is the dot product "
            f"<b>q·k = Σᵢ qᵢkᵢ = {raw:.4f}</b>. The matrix shows it for every query (row) and key (column); "
            "hover a cell for its number.")  # fmt: skip


def _scaled(tour, s, j) -> str:
    raw = float(s.q.astype(np.float64) @ s.k[j].astype(np.float64))
    d = len(s.q)
    return (f"Scaled: q·k × {s.scaling:.4g} (1/√d, d = {d}): {raw:.4f} × {s.scaling:.4g} = "
            f"<b>{raw * s.scaling:.4f}</b>. Without it the scores would spread wider as d grows and the "
            "softmax would pick one key almost always.")  # fmt: skip


def _masked(tour, s, j) -> str:
    t = s.T
    hidden = t * t - int(s.allowed.sum()) if s.allowed is not None else t * (t - 1) // 2
    seen = int(s.query_allowed.sum())
    return (f"Masked: a position may not look ahead, so those cells become −∞ (grey): <b>{hidden} of the "
            f"{t} × {t} cells</b> are masked. Query {s.query} sees {seen} keys, itself included.")  # fmt: skip


def _softmax(tour, s, j) -> str:
    row = _help.score_row(s)
    m = float(row.max())
    z = float(np.exp(row - m).sum())
    p = s.head_rows[s.selection.head]
    return (f"Softmax turns each row into weights: pⱼ = e<sup>sⱼ − m</sup> / Σ e<sup>s − m</sup>, with m = {m:.4f} "
            f"and Σ = {z:.4f}. Key {j} {_lab(s, j)} gets <b>p = {float(p[j]):.4f}</b>; the row sums to "
            f"{float(p.sum()):.4f}. Here: this row for every head of the layer.")  # fmt: skip


def _weighted(tour, s, j) -> str:
    o = _help.head_output(s)
    p = s.head_rows[s.selection.head]
    top = np.argsort(-p)[:2]
    terms = " + ".join(f"{p[k]:.3f}·v<sub>{k}</sub>" for k in top)
    return (f"The head's output is V's rows weighted by p: o = Σⱼ pⱼ vⱼ = {terms} + … = "
            f"<b>[{', '.join(f'{x:.3f}' for x in o[:3])}, …]</b> (|o| = {np.linalg.norm(o):.4f}). Every head's o, "
            "projected, is added to the residual stream; the next layer does all this again.")  # fmt: skip


def _next(tour, s, j) -> str:
    st = s.step
    kept = [e for e in st.top if e.prob > 0]
    second = f" The runner-up is “{html.escape(kept[1].label)}” (p = {kept[1].prob:.4f})." if len(kept) > 1 else ""
    return (f"After the last layer the newest position's logits, through softmax, give every token a probability. "
            f"Greedy decoding chose <b>“{html.escape(st.label)}” with p = {st.prob:.4f}</b> (entropy "
            f"{st.entropy:.3f} nats).{second} Greedy keeps only the single likeliest token; next, beam search "
            f"keeps {BEAMS}.")  # fmt: skip


BEAMS = 2  # the seed tutorial's beam search
BEAM_TOKENS = 3  # new tokens it runs for: enough for two beams to part


def _beams(tour, s, j) -> str:
    r = tour.beam_result()
    if r is None and tour.beams_asked and tour.win.compare_panel.run_button.isEnabled():
        why = html.escape(tour.win.compare_panel.summary.text().split(">", 1)[-1].split("<", 1)[0])
        return f"Beam search with {BEAMS} beams could not run here: {why}"
    if r is None:
        return f"Running beam search with {BEAMS} beams on the prompt (Compare decoding)…"
    rows = []
    for i, b in enumerate(r.beams):
        chips = "".join(f"[{html.escape(lab)}]" for lab in b["tokens"])
        rows.append(f"beam {i + 1}: {chips} <b>score = {b['score']:.4f}</b>")
    greedy = "".join(f"[{html.escape(lab)}]" for lab in r.greedy["tokens"])
    pen = r.settings["length_penalty"]
    return (f"Beam search with <b>{BEAMS} beams</b> keeps the {BEAMS} likeliest continuations at every step "
            f"instead of one: each is extended by every token, and the {BEAMS} best sums of log p survive. "
            f"After {BEAM_TOKENS} new tokens (score = Σ log p / length<sup>{pen:g}</sup>):<br>"
            + "<br>".join(rows) + f"<br>greedy: {greedy}. The table and the tree below show every step; "
            "Inspect beam opens one as a run of its own.")  # fmt: skip


def _grows(tour, s, j) -> str:
    before = tour.before
    if before is None or s.T <= before[0]:
        if not tour.can_step():
            return "Step (F10) would feed the chosen token and add one row to every layer's cache (not possible here)."
        return "Feeding the chosen token (Step, F10)…"
    t0, b0 = before
    per = _help.kv_row_bytes(s, s.selection.layer)
    return (f"Step fed {_lab(s, s.T - 1)}: its k and v joined every layer's cache (the red row). "
            f"<b>{t0} → {s.T} positions</b>; layer {s.selection.layer} grew by {per:,} bytes, the whole cache "
            f"<b>{b0:,} → {sum(s.kv_bytes):,} bytes</b>. Nothing before it is recomputed: that is what the cache is for.")  # fmt: skip


STAGES = (
    Stage("tokens", "1 · Tokens", None, _tokens),
    Stage("qkv", "2 · Q, K and V", None, _qkv),
    Stage("scores", "3 · Raw scores", "raw", _raw),
    Stage("scores", "4 · Scaled", "scores", _scaled),
    Stage("scores", "5 · Masked", "masked_scores", _masked),
    Stage("softmax", "6 · Softmax", "probs", _softmax),
    Stage("qkv", "7 · Weighted V", "probs", _weighted),
    Stage("next", "8 · Next token", None, _next),
    Stage("panel_compare_decoding", "9 · Two beams", None, _beams),
    Stage("kv", "10 · The cache grows", None, _grows),
)
NEXT_KEYS = (Qt.Key.Key_Right, Qt.Key.Key_Return, Qt.Key.Key_Enter)
BACK_KEYS = (Qt.Key.Key_Left, Qt.Key.Key_Backspace)


class _Card(QFrame):
    """The tour's text and buttons; takes its keys before the window's shortcuts (Esc is Pause there)."""

    def __init__(self, tour: Tour, parent: QWidget):
        super().__init__(parent, objectName="tour_card")
        self.tour = tour
        self.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
        self.setStyleSheet("#tour_card { background: #2b2f38; border: 2px solid #ffb84f; border-radius: 6px; }")
        self.title = QLabel(objectName="tour_title", styleSheet="font-weight: bold; color: #ffb84f;")
        self.count = QLabel(objectName="tour_count", styleSheet="color: #8a8f99;")
        self.body = wrapped_label("", rich=True)
        self.body.setObjectName("tour_text")
        self.back = QPushButton("← Back", toolTip="The previous stage (←)", clicked=tour.back)
        self.next = QPushButton("Next →", toolTip="The next stage (→ or Enter)", clicked=tour.next)
        self.end = QPushButton("End tour", toolTip="Close the tour (Esc)", clicked=tour.end)
        for b in (self.back, self.next, self.end):
            b.setFocusPolicy(Qt.FocusPolicy.NoFocus)  # the card keeps the keys
        vbox(self, hbox(None, (self.title, 1), self.count), self.body, hbox(None, self.back, self.next, 1, self.end),
             margin=10, spacing=6)  # fmt: skip
        self.setFixedWidth(430)

    def event(self, ev) -> bool:
        if ev.type() == QEvent.Type.ShortcutOverride and ev.key() in (*NEXT_KEYS, *BACK_KEYS, Qt.Key.Key_Escape):
            ev.accept()  # a key press for this card, not the window's shortcut
            return True
        return super().event(ev)

    def keyPressEvent(self, ev) -> None:  # noqa: N802 (Qt)
        if ev.key() in NEXT_KEYS:
            self.tour.next()
        elif ev.key() in BACK_KEYS:
            self.tour.back()
        elif ev.key() == Qt.Key.Key_Escape:
            self.tour.end()
        else:
            super().keyPressEvent(ev)


class Tour(QObject):
    def __init__(self, win):
        super().__init__(win)
        self.win = win
        self.index = -1
        self.before: tuple[int, int] | None = None  # (T, cache bytes) before the tour's "cache grows" step
        self.beams_asked = False  # the tour clicked Compare for its beam search
        self.kind_before = win.selection.kind
        self.frame = QFrame(win, objectName="tour_frame")
        self.frame.setStyleSheet(
            "#tour_frame { border: 3px solid #ffb84f; border-radius: 4px; background: transparent; }"
        )
        self.frame.setAttribute(Qt.WidgetAttribute.WA_TransparentForMouseEvents)
        self.frame.hide()
        self.card = _Card(self, win)
        self.card.hide()
        self.focus_before: QWidget | None = None  # where the keys went before the card took them
        self.dock = None
        win.snapshot_changed.connect(self._refresh)
        win.compare_panel.result_shown.connect(self._refresh)  # the tour's beam search came back
        win.installEventFilter(self)

    @property
    def active(self) -> bool:
        return self.card.isVisible()

    def can_step(self) -> bool:
        acts = self.win.acts
        return acts.step.isEnabled()

    def offer(self) -> None:
        """The welcome card: Next (or Enter) starts the tour, End (or Esc) closes it."""
        self.index = -1
        self.card.title.setText("Welcome to gpt-inspector")
        self.card.count.setText("")
        self.card.body.setText(
            "Take a guided tour of one step of the model on this prompt? Tokens, Q/K/V, the scores, the mask, "
            "softmax, the weighted values, the next token and the KV cache, each on its own panel with its real "
            "numbers.<br><br>The tour is always in <b>Help ▸ Tour</b>; F1 explains the panel you are in."
        )
        self.card.back.setEnabled(False)
        self.card.next.setText("Start the tour")
        self.card.end.setText("Not now")
        self._take_keys()
        self.card.show()
        self._place()
        self.card.setFocus(Qt.FocusReason.OtherFocusReason)

    def start(self) -> None:
        self.card.end.setText("End tour")
        self.index = -1
        self.before = None
        self.kind_before = self.win.selection.kind
        self._take_keys()
        self.card.show()
        s = self.win.snapshot
        if (s is None or s.T == 0) and self.can_step():
            self.win.step()  # the prefill: nothing to show before it
        self.go(0)

    def go(self, i: int) -> None:
        self.index = i = max(0, min(i, len(STAGES) - 1))
        st = STAGES[i]
        if st.kind is not None and self.win.selection.kind != st.kind:
            self.win.controller.select(kind=st.kind)
        if st.text is _beams and self._ready() and self.beam_result() is None:
            self._run_beams()
        if i == len(STAGES) - 1 and self.before is None and self.can_step() and self._ready():
            s = self.win.snapshot
            self.before = (s.T, sum(s.kv_bytes))
            self.win.step()
        dock = self.win.docks[st.dock]
        dock.show()
        dock.raise_()
        if self.dock is not None:
            self.dock.removeEventFilter(self)
        self.dock = dock
        dock.installEventFilter(self)
        self.card.back.setEnabled(i > 0)
        self.card.next.setText("Finish" if i == len(STAGES) - 1 else "Next →")
        self._refresh()
        self.card.setFocus(Qt.FocusReason.OtherFocusReason)

    def next(self) -> None:
        if self.index < 0:  # the welcome card
            self.start()
        elif self.index >= len(STAGES) - 1:
            self.end()
        else:
            self.go(self.index + 1)

    def back(self) -> None:
        if self.index > 0:
            self.go(self.index - 1)

    def _take_keys(self) -> None:
        if not self.card.isVisible():
            self.focus_before = QApplication.focusWidget()

    def end(self) -> None:
        self.card.hide()
        self.frame.hide()
        # the keys go back where they were (the score matrix if that is gone): a hidden card's focus
        # otherwise lands on whatever Qt finds next, and on X11 F10 then stepped nothing until a click
        back = self.focus_before
        if back is None or not back.isVisible() or back.window() is not self.win:
            back = self.win.score_matrix
        self.focus_before = None
        self.win.activateWindow()
        back.setFocus(Qt.FocusReason.OtherFocusReason)
        if self.dock is not None:
            self.dock.removeEventFilter(self)
            self.dock = None
        if self.win.selection.kind != self.kind_before:
            self.win.controller.select(kind=self.kind_before)
        self.index = -1

    def beam_result(self):
        """The Compare panel's result when it is the tour's search on the prompt shown, else None."""
        r, s = self.win.compare_panel.result, self.win.snapshot
        if r is None or s is None or list(r.prompt_ids) != list(s.token_ids[: s.prompt_len]):
            return None
        return r if r.settings["num_beams"] == BEAMS and len(r.beams) == BEAMS else None

    def _run_beams(self) -> None:
        """What a user would do: the panel's controls set to 2 beams, 2 returned, 3 tokens, then Compare."""
        panel = self.win.compare_panel
        if not panel.run_button.isEnabled():
            return  # a comparison is on its way
        panel.samples.setValue(0)  # greedy and the beams only: no samples, no assisted row
        panel.lookup.setValue(0)
        panel.beams.setValue(BEAMS)
        panel.returns.setValue(BEAMS)
        panel.new_tokens.setValue(BEAM_TOKENS)
        panel.length_penalty.setValue(1.0)
        panel.early.setCurrentText("False")
        panel.run_button.click()
        self.beams_asked = True

    def _ready(self) -> bool:
        s = self.win.snapshot
        return s is not None and s.T > 0 and s.q is not None and s.step is not None

    def text(self) -> str:
        """The current stage's text with the numbers of the snapshot shown."""
        st = STAGES[self.index]
        s = self.win.snapshot
        if not self._ready():
            return "Running the prompt (Step, F10)…" if self.can_step() or self.win.busy else "Load a model first."
        if st.kind is not None and s.selection.kind != st.kind:
            return "…"  # the stage's matrix is on its way
        key = _help.key_of(s, _help.Context(key=self.win.qkv.key))
        return st.text(self, s, key)

    def _refresh(self, *_args) -> None:
        if not self.active or self.index < 0:
            return
        st = STAGES[self.index]
        self.card.title.setText(st.title)
        self.card.count.setText(f"{self.index + 1} / {len(STAGES)}")
        self.card.body.setText(self.text())
        self._place()

    def _place(self) -> None:
        """Frame the stage's dock; put the card in the window's corner farthest from it."""
        win, dock = self.win, self.dock
        if dock is None or dock.isFloating() or not dock.isVisible():
            self.frame.hide()
        else:
            self.frame.setGeometry(dock.geometry().adjusted(-2, -2, 2, 2))
            self.frame.show()
            self.frame.raise_()
        self.card.adjustSize()
        w, h = self.card.width(), self.card.sizeHint().height()
        area = win.rect().adjusted(12, win.menuBar().height() + 40, -12, -30)
        strip = win.docks["tokens"]
        if dock is not strip and strip.isVisible() and not strip.isFloating():  # keep the tokens in sight
            area.setTop(max(area.top(), strip.geometry().bottom() + 8))
        corners = [QRect(x, y, w, h) for x in (area.left(), area.right() - w) for y in (area.top(), area.bottom() - h)]
        if dock is None:  # the welcome card: in the middle
            self.card.setGeometry(QRect(area.center().x() - w // 2, area.center().y() - h // 2, w, h))
            self.card.raise_()
            return
        target = dock.geometry()

        def overlap(r: QRect) -> int:
            i = r.intersected(target)
            return i.width() * i.height() if not i.isEmpty() else 0

        self.card.setGeometry(min(corners, key=overlap))
        self.card.raise_()

    def eventFilter(self, obj, ev) -> bool:  # noqa: N802 (Qt)
        if self.active and ev.type() in (QEvent.Type.Resize, QEvent.Type.Move, QEvent.Type.Show, QEvent.Type.Hide):
            self._place()
        return super().eventFilter(obj, ev)


def tour(win) -> Tour:
    t = getattr(win, "tour", None)
    if t is None:
        t = win.tour = Tour(win)
    return t


def start(win) -> Tour:
    """Help ▸ Tour: from the first stage, on the session shown."""
    t = tour(win)
    t.start()
    return t


def offer_at_start(win) -> bool:
    """Offer the tour once, ever (a card, not a modal question); True when it was offered now."""
    st = _settings.settings()
    if st.value(OFFERED, False, type=bool):
        return False
    st.setValue(OFFERED, True)
    win.when_idle(lambda: tour(win).offer())  # once the model is in: the tour needs its numbers
    return True
