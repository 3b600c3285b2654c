"""Chat…: the prompt built from the tokenizer's chat template, one turn per row.

Each row is a role (system, user, assistant, or any role the template knows) and its content; the
preview below shows the exact text the template makes of them, rendered on the worker thread by
``core.chat.build`` (the tokenizer's own ``apply_chat_template``), each turn's content coloured by its
role. OK starts a session on it; the Session panel then shows that text in the prompt box.
"""

from __future__ import annotations

import html

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QGridLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QScrollArea,
    QTextEdit,
    QWidget,
)

from ..core.chat import ROLES
from .views.common import hbox, vbox

# the token strip and the preview colour a token by the turn it came from
ROLE_COLORS = {"system": "#c586f7", "user": "#5fd18b", "assistant": "#f0a35e", "template": "#7d8390"}
ROLE_TIP = ("Each prompt token's role (a chat prompt): <span style='color:#c586f7'>system</span>, "
            "<span style='color:#5fd18b'>user</span>, <span style='color:#f0a35e'>assistant</span> turns' content, "
            "<span style='color:#7d8390'>template</span>: what the chat template wrote around them "
            "(turn headers, special tokens, the generation prompt)")  # fmt: skip
PREVIEW_MS = 150


class ChatDialog(QDialog):
    """The turns editor. ``messages()`` and ``add_generation_prompt()`` are what OK accepts."""

    def __init__(self, window, chat: dict | None = None):
        super().__init__(window, windowTitle="Chat prompt")
        self._window = window
        self.rows: list[tuple[QComboBox, QLineEdit, QPushButton]] = []
        self._grid_host = QWidget()
        self._grid = QGridLayout(self._grid_host)
        self._grid.setColumnStretch(1, 1)
        scroll = QScrollArea(widgetResizable=True)
        scroll.setWidget(self._grid_host)
        self.add_button = QPushButton("Add turn", toolTip="Add a turn after the last (Ctrl+N)", shortcut="Ctrl+N",
                                      clicked=lambda: self.add_turn("user" if not self.rows or
                                                                    self.rows[-1][0].currentText() != "user" else "assistant"))  # fmt: skip
        self.generation_prompt = QCheckBox("add generation prompt", checked=True,
                                           toolTip="End with the template's assistant header, so the model "
                                                   "answers as the assistant (add_generation_prompt)")  # fmt: skip
        self.preview = QTextEdit(readOnly=True, toolTip="The exact text the tokenizer's chat template makes of "
                                                        "these turns; each turn's content coloured by its role")  # fmt: skip
        self.preview.setMinimumHeight(110)
        self.status = QLabel(wordWrap=True)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        self.ok_button = buttons.button(QDialogButtonBox.StandardButton.Ok)
        self.ok_button.setText("Start chat")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        vbox(self, (scroll, 2), hbox(None, self.add_button, self.generation_prompt, 1),
             QLabel("What the chat template makes of them:"), (self.preview, 3), self.status, buttons)  # fmt: skip
        self.resize(620, 460)
        self._timer = QTimer(self, singleShot=True, interval=PREVIEW_MS, timeout=self._render)
        self._asked = 0  # the newest preview asked for: an older answer arriving late is dropped
        self.generation_prompt.toggled.connect(self._changed)
        turns = (chat or {}).get("messages") or [{"role": "system", "content": ""}, {"role": "user", "content": ""}]
        for m in turns:
            self.add_turn(m["role"], m["content"])
        self.generation_prompt.setChecked(bool((chat or {}).get("add_generation_prompt", True)))
        self._changed()

    def add_turn(self, role: str = "user", content: str = "") -> None:
        combo = QComboBox(editable=True, toolTip="The turn's role (any role the template knows)")
        combo.addItems(list(ROLES))
        combo.setCurrentText(role)
        edit = QLineEdit(content, placeholderText=f"{role} turn", toolTip="The turn's text")
        remove = QPushButton("✕", toolTip="Remove this turn")
        remove.setFixedWidth(28)
        row = (combo, edit, remove)
        remove.clicked.connect(lambda: self._remove(row))
        combo.currentTextChanged.connect(self._changed)
        edit.textChanged.connect(self._changed)
        r = len(self.rows)
        for c, w in enumerate(row):
            self._grid.addWidget(w, r, c)
        self.rows.append(row)
        edit.setFocus()
        self._changed()

    def _remove(self, row) -> None:
        for w in row:
            self._grid.removeWidget(w)
            w.deleteLater()
        self.rows.remove(row)
        self._changed()

    def messages(self) -> list[dict]:
        """The turns; rows left empty are dropped."""
        return [{"role": c.currentText().strip(), "content": e.text()} for c, e, _ in self.rows if e.text().strip()]

    def add_generation_prompt(self) -> bool:
        return self.generation_prompt.isChecked()

    def chat(self) -> dict:
        return {"messages": self.messages(), "add_generation_prompt": self.add_generation_prompt()}

    def _changed(self, *_) -> None:
        self.ok_button.setEnabled(bool(self.messages()))
        self._timer.start()

    def _render(self) -> None:
        msgs, gen = self.messages(), self.add_generation_prompt()
        if not msgs:
            self.preview.clear()
            self.status.setText("Type at least one turn.")
            return
        self._asked += 1
        asked = self._asked

        def job(source):
            from ..core import chat
            from ..core.errors import InspectorError

            if getattr(source, "engine", None) is not None:  # the template is the engine's tokenizer's
                return source.build_chat(msgs, gen)
            lm = getattr(source, "lm", None)
            if lm is None:
                raise InspectorError("load a model first: the chat template is the model's tokenizer's")
            return chat.build(lm.tokenizer, msgs, gen)

        def done(result, error) -> None:
            if asked != self._asked:
                return
            if error is not None:
                self.preview.clear()
                self.status.setText(f"<span style='color:#ff6b6b'>{html.escape(str(error).splitlines()[0])}</span>")
                self.ok_button.setEnabled(False)
                return
            self.preview.setHtml(_colored(result))
            self.status.setText(f"{len(result.ids)} tokens")
            self.ok_button.setEnabled(True)

        self._window.run_in_worker(job, done)


def _colored(chat) -> str:
    """The rendered text, each turn's content in its role's colour (the markup grey)."""
    spans, at = [], 0
    for role, content in chat.messages:
        c = content.strip()
        k = chat.text.find(c, at) if c else -1
        if k >= 0:
            spans.append((k, k + len(c), role))
            at = k + len(c)
    out, pos = [], 0
    for a, b, role in spans:
        out.append(_span(chat.text[pos:a], "template"))
        out.append(_span(chat.text[a:b], role))
        pos = b
    out.append(_span(chat.text[pos:], "template"))
    return "<pre style='white-space: pre-wrap'>" + "".join(out) + "</pre>"


def _span(text: str, role: str) -> str:
    color = ROLE_COLORS.get(role, "#d7dae0")
    return f"<span style='color:{color}'>{html.escape(text)}</span>" if text else ""


__all__ = ["ROLE_COLORS", "ROLE_TIP", "ChatDialog"]
