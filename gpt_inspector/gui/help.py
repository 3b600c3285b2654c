"""What each panel shows, in words and with the selection's own numbers.

Help ▸ What am I looking at (F1) opens the page of the panel that has the focus (else the one under
the pointer): a screen of text and the panel's equation written out with the numbers of the current
selection. The pages read the snapshot the views show, never the session, so a page's numbers are
the ones on screen; the arithmetic on them is the equation the engine runs (core/attention.py), in
float64. Also here: the keyboard page, About, and the docks' tooltips (title bars and tabs).
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PySide6.QtCore import QEvent, QObject, QTimer
from PySide6.QtGui import QAction, QCursor, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QDialog,
    QDialogButtonBox,
    QDockWidget,
    QTabBar,
    QTextBrowser,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from .viewdata import KIND_LABELS
from .views.token_strip import GLYPHS

# the token strip's legend: what the label glyphs stand for (core/tokens.py makes them)
TOKEN_LEGEND = " · ".join(html.escape(m) if g == "<0x" else f"{g} {html.escape(m)}" for g, m in GLYPHS)


@dataclass(frozen=True)
class Context:
    """What the pointer picked, beyond the selection: the key the Q/K/V panel takes apart (the hovered
    one, else the key the head attends to most) and the score-matrix cell under the pointer."""

    key: int = -1
    hovered: tuple[int, int] | None = None


@dataclass(frozen=True)
class Page:
    title: str
    tip: str  # the dock's tooltip: one line
    text: str  # what the panel shows and how to read it (HTML)
    live: Callable[[object, Context], str] | None = None  # the equation with the selection's numbers


def _n(x: float) -> str:
    return f"{x:.4f}"


def _lab(s, i: int) -> str:
    return f"“{html.escape(s.labels[i])}”" if 0 <= i < len(s.labels) else ""


def _where(s) -> str:
    sel = s.selection
    kv = f" (reads kv head {s.kv_head})" if s.n_kv_heads != s.n_heads else ""
    return f"layer {sel.layer} · head {sel.head}{kv} · query {s.query} {_lab(s, s.query)}"


def score_row(s) -> np.ndarray:
    """(T,) float64: the selected query's scores over every key, as the equation makes them (masked keys −inf)."""
    q, k = s.q.astype(np.float64), s.k.astype(np.float64)  # (d,), (T, d)
    row = (k @ q) * s.scaling  # (T,)
    if s.query_bias is not None:
        row = row + s.query_bias.astype(np.float64)
    if s.softcap is not None:
        row = np.tanh(row / s.softcap) * s.softcap
    return np.where(s.query_allowed, row, -np.inf) if s.query_allowed is not None else row


def key_of(s, ctx: Context) -> int:
    """The key a page writes out: the context's, else the one the selected head attends to most."""
    t = s.k.shape[0]
    if 0 <= ctx.key < t:
        return ctx.key
    return int(np.argmax(s.head_rows[s.selection.head])) if s.head_rows is not None else t - 1


def _terms(q: np.ndarray, k: np.ndarray, n: int = 3) -> str:
    parts = [f"({q[i]:.3f})({k[i]:.3f})" for i in range(min(n, len(q)))]
    return " + ".join(parts) + (" + …" if len(q) > n else "")


def _score_lines(s, ctx: Context) -> str:
    """q·k → × scaling → mask → softmax for (the selected query, the context's key), every number shown."""
    j = key_of(s, ctx)
    q, k = s.q.astype(np.float64), s.k[j].astype(np.float64)
    d = len(q)
    raw = float(q @ k)
    scaled = raw * s.scaling
    lines = [
        f"cell: query {s.query} {_lab(s, s.query)} → key {j} {_lab(s, j)} (layer {s.selection.layer}, head "
        f"{s.selection.head}; hover another cell of this row to change the key)",
        f"1. raw: q·k = Σᵢ qᵢkᵢ = {_terms(q, k)} = <b>q·k = {_n(raw)}</b> (d = {d} terms)",
        f"2. scaled: q·k × scaling = {_n(raw)} × {s.scaling:.4g}"
        + (f" (= 1/√{d})" if abs(s.scaling - 1 / math.sqrt(d)) < 1e-6 else "")
        + f" = <b>scaled = {_n(scaled)}</b>",
    ]
    score = scaled
    if s.query_bias is not None:
        score += float(s.query_bias[j])
        lines.append(
            f"&nbsp;&nbsp;+ the model's score bias {float(s.query_bias[j]):+.4f} (ALiBi or learned) = {_n(score)}"
        )
    if s.softcap is not None:
        score = math.tanh(score / s.softcap) * s.softcap
        lines.append(f"&nbsp;&nbsp;soft-cap: tanh(s / {s.softcap:g}) × {s.softcap:g} = {_n(score)}")
    allowed = bool(s.query_allowed[j]) if s.query_allowed is not None else True
    if not allowed:
        lines.append(f"3. masked: key {j} is hidden from query {s.query} (the future, a window or a mask edit): "
                     "<b>−∞</b>, so the softmax gives it exactly 0")  # fmt: skip
        return "<br>".join(lines)
    row = score_row(s)
    n_allowed = int(np.isfinite(row).sum())
    lines.append(f"3. masked: key {j} is allowed (query {s.query} sees {n_allowed} of {len(row)} keys): "
                 f"<b>masked = {_n(score)}</b>")  # fmt: skip
    m = float(row.max())
    z = float(np.exp(row - m).sum())
    p_eq = math.exp(score - m) / z
    p_model = float(s.head_rows[s.selection.head, j]) if s.head_rows is not None else p_eq
    lines.append(
        f"4. softmax: p = e<sup>s − m</sup> / Σ e<sup>sⱼ − m</sup> with m = {_n(m)} (the row's largest score): "
        f"e<sup>{_n(score - m)}</sup> / {z:.4f} = <b>p = {_n(p_eq)}</b>"
    )
    if abs(p_eq - p_model) > 1e-4:  # a sink, a KV policy: terms this page cannot see
        lines.append(f"&nbsp;&nbsp;the model's own p is {_n(p_model)}: its softmax has terms not shown here "
                     "(an attention sink or a KV cache policy)")  # fmt: skip
    return "<br>".join(lines)


def head_output(s) -> np.ndarray:
    """(d,) float64: the selected head's attention output at the query, o = Σⱼ pⱼ vⱼ."""
    return s.head_rows[s.selection.head].astype(np.float64) @ s.v.astype(np.float64)  # (T,) @ (T, d)


def _live_scores(s, ctx: Context) -> str:
    out = [_score_lines(s, ctx)]
    if ctx.hovered is not None and ctx.hovered[0] != s.query and s.matrix is not None and s.matrix_block == 1:
        hq, hk = ctx.hovered
        v = s.matrix[hq, hk]
        val = "masked" if not s.allowed[hq, hk] else _n(float(v))
        out.append(f"Under the pointer: query {hq} → key {hk}, {KIND_LABELS[s.selection.kind]} = {val}. "
                   "Click that row to select its query and see its arithmetic.")  # fmt: skip
    return "<br><br>".join(out)


def _live_qkv(s, ctx: Context) -> str:
    o = head_output(s)
    d = len(o)
    first = ", ".join(f"{x:.4f}" for x in o[:4])
    p = s.head_rows[s.selection.head]
    top = np.argsort(-p)[:3]
    terms = " + ".join(f"{p[j]:.3f}·v<sub>{j}</sub>" for j in top)
    return (
        f"{_where(s)}<br>{_score_lines(s, ctx)}<br><br>"
        f"5. weighted V: the head's output o = Σⱼ pⱼ vⱼ = {terms} + … (the keys it weights most)<br>"
        f"&nbsp;&nbsp;<b>o = [{first}{', …' if d > 4 else ''}]</b>, |o| = {np.linalg.norm(o):.4f} ({d} numbers; the "
        "output projection then mixes every head's o into the residual stream)"
    )


def _live_softmax(s, ctx: Context) -> str:
    rows = s.head_rows.astype(np.float64)  # (H, T)
    lines = [f"query {s.query} {_lab(s, s.query)}, layer {s.selection.layer}:"]
    for h, r in enumerate(rows):
        j = int(np.argmax(r))
        nz = r[r > 0]
        ent = float(-(nz * np.log(nz)).sum())
        mark = " ◀ selected" if h == s.selection.head else ""
        lines.append(
            f"H{h}: Σ p = {r.sum():.4f} · max p = {r[j]:.4f} on key {j} {_lab(s, j)} · entropy {ent:.3f} nats{mark}"
        )
    return "<br>".join(lines) + "<br><br>" + _score_lines(s, ctx)


def _live_overview(s, ctx: Context) -> str:
    sel = s.selection
    bs = s.thumb_bin_size
    return (f"{s.n_layers} layers × {s.n_heads} heads; each thumbnail is {s.thumb_bins} × {s.thumb_bins} bins"
            + (f" of {bs} positions" if bs > 1 else " (one position each)")
            + f"; the outlined one is layer {sel.layer}, head {sel.head}, shown large in the score matrix.")  # fmt: skip


def _live_next(s, ctx: Context) -> str:
    st = s.step
    if st is None:
        return "No step yet: press Step (F10)."
    kept = [e for e in st.top if e.prob > 0]
    rows = "<br>".join(f"“{html.escape(e.label)}” (id {e.token_id}): p = {_n(e.prob)}" for e in kept[:5])
    t = (s.decoding or {}).get("temperature") or 0.0
    how = "greedy: the most likely token" if t == 0 else f"sampled at temperature {t:g}"
    return (f"step {st.index + 1} at position {st.position}: p = softmax(logits / T) over {len(kept)} kept tokens; "
            f"{how}.<br>chose <b>“{html.escape(st.label)}”</b> (id {st.token_id}) with <b>p = {_n(st.prob)}</b>; "
            f"entropy −Σ p ln p = <b>{st.entropy:.4f}</b> nats<br>{rows}")  # fmt: skip


def kv_row_bytes(s, layer: int) -> int:
    """Bytes one position adds to ``layer``'s cache as the panel shows it: K and V, every KV head."""
    w = 0 if s.kv_k is None else s.kv_k.shape[1] + s.kv_v.shape[1]
    return w * {"float16": 2, "bfloat16": 2}.get(s.dtype, 4)


def _live_kv(s, ctx: Context) -> str:
    layer = s.selection.layer
    n = s.kv_positions[layer] if layer < len(s.kv_positions) else s.T
    per = kv_row_bytes(s, layer)
    size = {"float16": 2, "bfloat16": 2}.get(s.dtype, 4)
    line = (f"layer {layer}: {n} positions × 2 (K and V) × {s.n_kv_heads} kv heads × {s.head_dim} dims × {size} bytes "
            f"= {n * per:,} bytes")  # fmt: skip
    if n * per != s.kv_bytes[layer]:
        line += f"; the model's cache holds {s.kv_bytes[layer]:,} bytes here (it stores something else: the panel's title says what)"
    else:
        line += f" = the model's cache for this layer (<b>{s.kv_bytes[layer]:,} bytes</b>)"
    return (f"{line}<br>all {s.n_layers} layers: <b>{sum(s.kv_bytes):,} bytes</b>; the next step adds one row to "
            f"every layer: {per:,} bytes here.")  # fmt: skip


def _live_tokens(s, ctx: Context) -> str:
    i = s.query
    kind = "prompt" if i < s.prompt_len else "generated"
    p = s.token_probs[i] if i < len(s.token_probs) else None
    chosen = "" if p is None else f", chosen with p = {_n(p)}"
    return (f"selected: position {i} {_lab(s, i)}, token id {s.token_ids[i]} ({kind}{chosen}). The prompt is "
            f"{s.prompt_len} tokens; {s.T} positions are in the KV cache.")  # fmt: skip


def _live_mask(s, ctx: Context) -> str:
    r = s.mask_report
    line = f"{len(s.mask_edits)} mask edit(s) in force."
    if r is not None:
        line += f" The last one moved the next-token distribution by total variation ½ Σ |p − p′| = {r.total_variation:.4f}."
    return line


def _live_interventions(s, ctx: Context) -> str:
    knocked = sum(e.patch_from is None for e, _ in s.head_edits)
    return (f"In force: {len(s.mask_edits)} mask edit(s), {knocked} knock-out(s), "
            f"{len(s.head_edits) - knocked} patch(es). A knocked-out head's output o = Σ pⱼ vⱼ is replaced by 0; "
            "a patched head's by the same head's output on the other prompt.")  # fmt: skip


def _live_session(s, ctx: Context) -> str:
    d = s.decoding or {}
    return (f"{html.escape(s.model_name)} · {s.n_layers} layers × {s.n_heads} heads · {s.device} · {s.dtype} · "
            f"step {s.n_steps} · temperature {d.get('temperature', 0) or 0:g}")  # fmt: skip


_STAGES = ("<b>raw</b> q·k · <b>scaled</b> × scaling (1/√d, plus a bias such as ALiBi, then a soft-cap) · "
           "<b>masked</b> −∞ where the query may not look (grey) · <b>softmax</b> each row sums to 1")  # fmt: skip

PAGES: dict[str, Page] = {
    "session": Page("Session", "The model, the prompt and the decoding settings: load, start, temperature, top-k, top-p",
        "Choose a model (the built-in demo model, a hub id from the local cache, or a folder) and <b>Load</b> it; "
        "type a prompt and <b>Start</b>. Decoding settings change the next-token distribution at once, without "
        "running the model; <b>Re-decide</b> (Ctrl+D) chooses the current token again under them.", _live_session),
    "breakpoints": Page("Breakpoints", "Stop a run (F5) when the chosen token matches, is unlikely, or the distribution is flat",
        "A run stops after the step whose chosen token contains the text, has a probability below the threshold, "
        "or whose distribution has an entropy above it (in nats: ln 2 ≈ 0.69 is a coin toss)."),
    "tokens": Page("Tokens", "Every token of the prompt and the generation; click one to select that query position",
        "One chip per token (the tokenizer's pieces, not words). Click a chip to make it the query the other panels "
        "show; the newest one follows the run (End). Generated chips are tinted by the probability they were "
        "chosen with (dark: unlikely, yellow: likely); a dashed chip is chosen but not yet fed to the model. "
        "A chat prompt's tokens (Chat…) carry a bar in their role's colour: system, user, assistant turns' "
        "content, or template (what the chat template wrote around them).<br>"
        "Legend: " + TOKEN_LEGEND, _live_tokens),
    "scores": Page("Score matrix", "One head's T × T attention: rows are queries, columns keys; hover a cell for its numbers",
        "Rows are query positions, columns keys; one layer and head at one stage of the equation: " + _STAGES + ". "
        "The colour bar gives the scale; grey cells are masked; the red outline is the newest row. Hover a cell: "
        "the footer reads its value and the Q/K/V panel writes out q·k for that key. Click a row to select that "
        "query. <b>Edit mask</b>: click or drag cells to block them; the model re-runs from the earliest position "
        "affected.", _live_scores),
    "overview": Page("Overview", "Every layer × head's attention pattern at a glance; click one to select it",
        "One thumbnail per layer (rows) and head (columns) of the softmax matrix, binned: each cell is the mean "
        "attention a bin of queries gives a bin of keys. Colours are √(value ÷ the thumbnail's largest), 0 to 1 "
        "(the colour bar), so faint structure stays visible beside a sink. Click a thumbnail to select that head.",
        _live_overview),
    "next": Page("Next token", "The next-token distribution at the current decoding settings; double-click a bar to force it",
        "The logits of the newest position through the decoding settings (temperature, top-k, top-p): "
        "p = softmax(logits / T). The orange bar is the chosen token. Double-click a bar to force that token "
        "(the generation branches); <b>Re-decide</b> chooses again at the current settings.", _live_next),
    "mask": Page("Mask edits", "The attention cells you blocked, and how the last edit moved the next-token distribution",
        "Edits are made on the score matrix (Edit mask, then click or drag). Each blocks (or unblocks) one query → key "
        "cell in one head, one layer or every layer; the table compares the distribution before and after.",
        _live_mask),
    "softmax": Page("Softmax rows", "The selected query's attention weights for every head of the layer; click a head",
        "One bar chart per head: the softmax row of the selected query, one bar per key, from 0 to 1 (the axis); "
        "each head's bars sum to 1. The orange one is the selected head; click a plot to select that head.",
        _live_softmax),
    "qkv": Page("Q / K / V", "q of the selected query, K and V of every cached position for this head; hover K to take q·k apart",
        "q is the selected position's query vector (after RoPE where the model uses it); K and V have one row per "
        "cached position, of the kv head this head reads (grouped-query attention shares one kv head among several "
        "query heads). Colours are a scale centred on 0: q and K share the first colour bar, V has its own. Hover "
        "a key row (here or in the score matrix): the bars are qᵢkᵢ for each dimension, their sum is the raw score.",
        _live_qkv),
    "kv": Page("KV cache", "The selected layer's cached K and V, kv head by kv head, and the bytes the cache holds",
        "Rows are positions (the newest outlined), columns the kv heads side by side: K and V as attention received "
        "them, each with its colour bar. A step adds one row to every layer. Right: the bytes of the model's own "
        "cache per layer (click a bar to select the layer) and after each step.", _live_kv),
    "panel_compare_decoding": Page("Compare decoding", "Greedy, beam search and sampling side by side on this prompt",
        "Runs the prompt greedily, with beam search (as model.generate does) and N seeded samples at each "
        "temperature (seeds seed, seed + 1, ...: each is generate(do_sample=True) with that seed), and shows where "
        "the texts part: in the table, and in the All outputs tree, where every output shares a node with the "
        "others while their tokens agree and the node where it first leaves greedy is orange. Any beam opens "
        "read-only in the window."),
    "panel_cache_probe": Page("Cache probe", "How much of the prompt can be read back from the cached K and V alone",
        "An attacker holding only the KV cache: for each position, the token whose keys match best."),
    "panel_math_check": Page("Math check", "softmax(qKᵀ·scale + mask)V recomputed in float64 beside the model's output",
        "The independent check: the attention output written out in float64 from the recorded q, K, V and mask, "
        "against what the model computed; the largest difference per head."),
    "panel_logit_lens": Page("Logit lens", "What each layer would predict, and each head's push on the chosen token",
        "Every layer's residual through the model's final norm and unembedding; the last layer is the model's own "
        "logits. Below, each head's direct effect on the chosen token."),
    "panel_interventions": Page("Interventions", "Every mask edit, knock-out and patch in force, each with its own Undo",
        "What the run is computed under besides the model itself: blocked attention cells (mask edits), heads whose "
        "output is zeroed (knock-outs) and heads whose output is taken from a run of another prompt (patches). "
        "Undo (or Delete on a row) takes one out and recomputes from the earliest position it touched, tokens "
        "kept. Ctrl+K knocks out the selected head; a second Ctrl+K on it is refused.", _live_interventions),
    "panel_kv_cache_lab": Page("KV cache lab", "What a KV cache policy (eviction, quantization) costs in bytes and fidelity",
        "Steps a policy run in lockstep with the full cache on the same tokens: KL, top-1 agreement, bytes per layer "
        "and the attention mass lost per head."),
    "panel_assisted": Page("Assisted decoding", "A draft model or prompt lookup proposes tokens; the model "
        "verifies them all in one forward",
        "Each round the proposer (a draft model with this model's tokenizer, or the tokens that followed the last "
        "n-gram earlier in the text) offers tokens; the model runs them in one forward and keeps its own greedy "
        "choices up to the first that differs (that one, or the next token when all agree, is its own). The "
        "rejected tokens' positions are cropped from its KV cache and the draft's. Every step a round adds is an "
        "ordinary step: every panel shows it. The tokens are generate(assistant_model=..., do_sample=False)'s."),
}  # fmt: skip


def page_html(key: str, snap, ctx: Context = Context()) -> str:
    """The page of dock ``key``: its text, then the live numbers where the snapshot has them."""
    page = PAGES[key]
    body = f"<h3>{html.escape(page.title)}</h3><p>{page.text}</p>"
    if page.live is not None:
        if snap is None or snap.T == 0 or snap.q is None:
            body += "<p><i>No numbers yet: press Step (F10) to run the prompt.</i></p>"
        else:
            body += f"<h4>With the current selection</h4><p>{page.live(snap, ctx)}</p>"
    return body


# ------------------------------------------------------------------------------------ the window's side
def dock_key_of(win, widget: QWidget | None) -> str | None:
    """The key of the dock holding ``widget`` (None: in no dock)."""
    while widget is not None:
        if isinstance(widget, QDockWidget):
            return next((k for k, d in win.docks.items() if d is widget), None)
        widget = widget.parentWidget()
    return None


def panel_in_question(win) -> str:
    """F1's panel: the one with the focus, else the one under the pointer, else the score matrix."""
    key = dock_key_of(win, QApplication.focusWidget())
    if key is None:
        key = dock_key_of(win, QApplication.widgetAt(QCursor.pos()))
    return key if key in PAGES else "scores"


class HelpDialog(QDialog):
    """One page at a time, kept up to date with the selection while it is open (not modal)."""

    def __init__(self, win):
        super().__init__(win, objectName="help_dialog")
        self.win, self.key = win, None
        self.setWindowTitle("What am I looking at")
        self.text = QTextBrowser(objectName="help_text", openExternalLinks=False)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close, rejected=self.close)
        lay = QVBoxLayout(self)
        lay.addWidget(self.text, 1)
        lay.addWidget(buttons)
        self.resize(600, 500)
        win.snapshot_changed.connect(self.refresh)
        win.score_matrix.key_hovered.connect(lambda *_: self.refresh())

    def context(self) -> Context:
        sm = self.win.score_matrix
        return Context(key=self.win.qkv.key, hovered=sm.hovered_cell())

    def show_page(self, key: str) -> None:
        self.key = key
        self._render()
        self.show()
        self.raise_()
        self.activateWindow()

    def show_html(self, title: str, body: str) -> None:
        self.key = None
        self.setWindowTitle(title)
        self.text.setHtml(body)
        self.show()
        self.raise_()

    def refresh(self, *_args) -> None:
        if self.key is not None and self.isVisible():
            self._render()

    def _render(self) -> None:
        self.setWindowTitle(f"What am I looking at: {PAGES[self.key].title}")
        bar = self.text.verticalScrollBar().value()
        self.text.setHtml(page_html(self.key, self.win.snapshot, self.context()))
        self.text.verticalScrollBar().setValue(bar)


def _dialog(win) -> HelpDialog:
    d = win.findChild(HelpDialog, "help_dialog")
    return d if d is not None else HelpDialog(win)


def show_page(win, key: str | None = None) -> HelpDialog:
    """Open the page of dock ``key`` (default: F1's panel), beside that panel rather than over it."""
    d = _dialog(win)
    key = key or panel_in_question(win)
    d.show_page(key)
    dock = win.docks.get(key)
    if dock is not None and dock.isVisible() and not dock.isFloating():
        frame = win.frameGeometry()
        left_half = dock.geometry().center().x() < win.width() // 2
        x = frame.right() - d.frameGeometry().width() - 8 if left_half else frame.left() + 8
        d.move(max(frame.left(), x), frame.top() + 80)
    return d


MOUSE = (
    ("hover a score-matrix cell", "its value below the matrix; q·k for that key in Q / K / V"),
    ("click a score-matrix row or a token chip", "select that query position"),
    ("click an overview thumbnail / a softmax plot", "select that layer and head / that head"),
    ("double-click a next-token bar", "force that token (the generation branches)"),
    ("Edit mask, then click or drag cells", "block or unblock attention cells"),
    ("wheel / drag on a heatmap", "zoom / pan (right-click: reset zoom, export)"),
)


def keyboard_html(win) -> str:
    seen, rows = set(), []
    for a in win.findChildren(QAction):
        keys = a.shortcut().toString(QKeySequence.SequenceFormat.NativeText)
        text = a.text().replace("&", "")
        if keys and text and (keys, text) not in seen:
            seen.add((keys, text))
            rows.append((keys, text, a.statusTip()))
    rows.sort(key=lambda r: r[1].lower())
    table = "".join(f"<tr><td><b>{html.escape(k)}</b></td><td>{html.escape(t)}</td><td>{html.escape(tip)}</td></tr>"
                    for k, t, tip in rows)  # fmt: skip
    mouse = "".join(f"<tr><td>{html.escape(a)}</td><td>{html.escape(b)}</td></tr>" for a, b in MOUSE)
    tour = "→ / Enter: next stage · ← / Backspace: back · Esc: end the tour"
    return (f"<h3>Keyboard shortcuts</h3><table cellspacing=4>{table}</table><p>In the tour: {tour}.</p>"
            f"<h3>Mouse</h3><table cellspacing=4>{mouse}</table>")  # fmt: skip


def about_html() -> str:
    import torch

    from .. import __version__
    from ..core import hf

    return (f"<h3>gpt-inspector {__version__}</h3><p>A step-through debugger for GPT-style language models: every "
            "number shown is the number the model computed (its attention runs through gpt-inspector's function "
            "in transformers' attention interface, checked against the model's own at load).</p>"
            f"<p>torch {torch.__version__} · transformers {hf.VERSION} · MIT licence</p>"
            "<p>The demo model is a 4-layer GPT-2 trained for this program (resources/demo-gpt2).</p>")  # fmt: skip


def show_keyboard(win) -> HelpDialog:
    d = _dialog(win)
    d.show_html("Keyboard shortcuts", keyboard_html(win))
    return d


def show_about(win) -> HelpDialog:
    d = _dialog(win)
    d.show_html("About gpt-inspector", about_html())
    return d


class DockTips(QObject):
    """Each dock's tooltip on its title bar and on its tab, never over its contents (a tip over a
    heatmap would hide the cells the pointer reads)."""

    def __init__(self, win):
        super().__init__(win)
        self.win = win
        self._pending = False
        self._late()
        win.installEventFilter(self)

    def _late(self) -> None:
        self._pending = False
        self.tip_all()
        for bar in self.win.findChildren(QTabBar):
            bar.removeEventFilter(self)  # installed once
            bar.installEventFilter(self)

    def tip_all(self) -> None:
        for key, dock in self.win.docks.items():
            page = PAGES.get(key)
            if page is not None and not dock.toolTip():
                dock.setToolTip(f"{page.tip} (F1: what am I looking at)")
                dock.installEventFilter(self)

    def eventFilter(self, obj, ev) -> bool:  # noqa: N802 (Qt)
        t = ev.type()
        if t == QEvent.Type.ChildAdded and obj is self.win and not self._pending:
            # a new dock group's tab bar, a panel's dock (add_panel): seen here mid-construction, before
            # they are what they will be (a plain QWidget, no name), so looked at once control returns
            self._pending = True
            QTimer.singleShot(0, self, self._late)
        elif t == QEvent.Type.ToolTip and isinstance(obj, QTabBar):
            i = obj.tabAt(ev.pos())
            dock = next((d for d in self.win.docks.values() if i >= 0 and d.windowTitle() == obj.tabText(i)), None)
            if dock is not None and dock.toolTip():
                QToolTip.showText(ev.globalPos(), dock.toolTip(), obj)
                return True
        elif t == QEvent.Type.ToolTip and isinstance(obj, QDockWidget):
            inner = obj.widget()
            if inner is not None and inner.geometry().contains(ev.pos()):
                QToolTip.hideText()  # over the contents: theirs or none
                ev.ignore()
                return True
        return super().eventFilter(obj, ev)


def install(win) -> None:
    """The docks' tooltips; the menu is actions.py's."""
    # a panel added after this (add_panel) gets its tip when its dock is made: ChildAdded above
    win.dock_tips = DockTips(win)
