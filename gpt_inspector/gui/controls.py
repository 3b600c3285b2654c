"""The side panels that drive the session: model, prompt, decoding (with generate's other sampler
settings under "Advanced sampling"), breakpoints."""

from __future__ import annotations

from PySide6.QtCore import QSignalBlocker, Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSlider,
    QSpinBox,
    QToolButton,
    QWidget,
)

from ..core.breakpoints import Breakpoints
from ..core.decoding import Decoding
from ..core.errors import InspectorError
from . import settings as _settings
from .commands import ModelSpec, SessionSpec
from .views.common import hbox, vbox

DEMO_LABEL = "Demo model (built in)"
RECENT_MODELS = "recent/models"
DEFAULT_PROMPT = "She eats apple"
THROTTLE_MS = 40  # decoding changes from a dragged slider: at most ~25 redraws a second


class SessionPanel(QWidget):
    load_requested = Signal()
    start_requested = Signal()
    chat_requested = Signal()  # Chat…: the window opens the turns editor
    decoding_changed = Signal()  # throttled; read decoding() and sampler_settings() for the values
    bad_input = Signal(str)  # a malformed id list: the window shows it in a dialog

    def __init__(self, parent=None):
        super().__init__(parent)
        lay = vbox(self, margin=4)

        g = QGroupBox("Model")
        f = QFormLayout(g)
        self.model = QComboBox(editable=True, insertPolicy=QComboBox.InsertPolicy.NoInsert, minimumContentsLength=12,
                               sizeAdjustPolicy=QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon,
                               toolTip="The demo model, a Hugging Face hub id (from the local cache) or a local folder")  # fmt: skip
        self.model.lineEdit().setPlaceholderText("hub id (gpt2) or folder")
        browse = QPushButton("…", toolTip="Choose a local model folder", clicked=self._browse)
        browse.setFixedWidth(28)
        f.addRow(hbox(None, (self.model, 1), browse))
        self.device = QComboBox(editable=True, toolTip="Where the model runs: auto picks a GPU when there is one")
        self.device.addItems(["auto", "cpu", "cuda", "mps"])
        self.dtype = QComboBox(toolTip="The weights' precision: float32 is exact; float16 / bfloat16 halve memory")
        self.dtype.addItems(["float32", "float16", "bfloat16"])
        f.addRow("device / dtype", hbox(None, (self.device, 1), (self.dtype, 1)))
        self.device_map = QComboBox(toolTip="Spread the layers over the GPUs, the CPU and disk (accelerate); "
                                            "the device above is then ignored")  # fmt: skip
        self.device_map.addItems(["one device", "auto", "balanced", "sequential"])
        self.max_memory = QLineEdit(placeholderText="0=20GiB,cpu=60GiB",
                                    toolTip="With a device map: the most each device may hold (GPU index, cpu, disk)")  # fmt: skip
        f.addRow("device map / max", hbox(None, (self.device_map, 1), (self.max_memory, 1)))
        self.offload_folder = QLineEdit(placeholderText="offload folder (disk), optional",
                                        toolTip="With a device map: where the weights that fit nowhere else wait on disk")  # fmt: skip
        f.addRow(self.offload_folder)
        self.allow_pickle = QCheckBox(
            "allow pickle weights", toolTip="Pickle (.bin) files can run code when loaded: only for sources you trust"
        )
        self.trust_code = QCheckBox(
            "trust remote code", toolTip="Runs the model repository's own Python code: only for sources you trust"
        )
        self.allow_unverified = QCheckBox("load even if unverified", toolTip="Load a model whose logits through gpt-inspector differ "
                                          "from its own attention (the load-time self-test failed); every view is marked UNVERIFIED")  # fmt: skip
        for box in (self.allow_pickle, self.trust_code, self.allow_unverified):
            f.addRow(box)
        self.load_button = QPushButton("Load model", toolTip="Load the model above and start on the prompt (Ctrl+L)")
        self.load_button.clicked.connect(self.load_requested)
        f.addRow(self.load_button)
        lay.addWidget(g)

        g = QGroupBox("Prompt")
        self.prompt = QPlainTextEdit(DEFAULT_PROMPT, maximumHeight=80,
                                     toolTip="The text the model continues; Start (or Step after an edit) runs it")  # fmt: skip
        # "Start", not "Start from this prompt": beside Chat… and Plain the longer name made the Session
        # column scroll sideways at 1366 px; the tooltip says the rest
        self.start_button = QPushButton(
            "Start", toolTip="Start from this prompt: a new session with this prompt and seed (mask edits are kept)"
        )
        self.start_button.clicked.connect(self.start_requested)
        # chat mode: the prompt is the tokenizer's chat template of these turns; the box shows its text
        self.chat: dict | None = None
        self.chat_button = QPushButton("Chat…", toolTip="Build the prompt from the model's chat template: "
                                       "system / user / assistant turns (Ctrl+Shift+C)")  # fmt: skip
        self.chat_button.clicked.connect(self.chat_requested)
        self.plain_button = QPushButton("Plain", visible=False, clicked=lambda: self.set_chat(None),
                                        toolTip="Leave chat mode: the box becomes an ordinary prompt again")  # fmt: skip
        self.chat_label = QLabel(visible=False, wordWrap=True)
        vbox(g, self.chat_label, self.prompt, hbox(None, (self.start_button, 1), self.chat_button, self.plain_button))
        lay.addWidget(g)

        # before the controls that start it
        self._throttle = QTimer(self, singleShot=True, interval=THROTTLE_MS)
        self._throttle.timeout.connect(self.decoding_changed)
        g = QGroupBox("Decoding")
        f = QFormLayout(g)
        self.temperature = QDoubleSpinBox(minimum=0.0, maximum=10.0, singleStep=0.05, decimals=2,
                                          toolTip="0 = greedy (the distribution is then shown at temperature 1)")  # fmt: skip
        self.temp_slider = QSlider(Qt.Orientation.Horizontal, minimum=0, maximum=200,
                                   toolTip="Temperature 0 to 2: p = softmax(logits / T); higher flattens the distribution")  # fmt: skip
        f.addRow("temperature", hbox(None, self.temperature, (self.temp_slider, 1)))
        self.top_k = QSpinBox(minimum=0, maximum=1_000_000, specialValueText="off",
                              toolTip="Keep only the k most likely tokens (0 = off)")  # fmt: skip
        self.top_p = QDoubleSpinBox(
            minimum=0.01, maximum=1.0, singleStep=0.05, value=1.0, decimals=2, toolTip="1.00 = off"
        )
        f.addRow("top-k / top-p", hbox(None, self.top_k, self.top_p))
        self.seed = QSpinBox(
            minimum=0, maximum=2**31 - 1, toolTip="The sampler's seed: the same seed samples the same tokens"
        )
        self.max_steps = QSpinBox(
            minimum=1, maximum=1_000_000, value=32, toolTip="Run (F5) stops after this many steps at most"
        )
        f.addRow("seed / max steps", hbox(None, self.seed, self.max_steps))
        self.advanced_toggle = QToolButton(text="Advanced sampling", checkable=True, autoRaise=True,
                                           toolButtonStyle=Qt.ToolButtonStyle.ToolButtonTextBesideIcon,
                                           toolTip="generate's other processors: penalties, n-grams, min-p, ...")  # fmt: skip
        self.advanced_toggle.setArrowType(Qt.ArrowType.RightArrow)
        f.addRow(self.advanced_toggle)
        lay.addWidget(g)
        self.advanced = self._advanced_group()
        self.advanced.setVisible(False)
        self.advanced_toggle.toggled.connect(self._show_advanced)
        lay.addWidget(self.advanced)
        lay.addStretch(1)

        self.temp_slider.valueChanged.connect(lambda v: self.temperature.setValue(v / 100.0))
        self.temperature.valueChanged.connect(self._temperature_changed)
        self.top_k.valueChanged.connect(self._throttle.start)
        self.top_p.valueChanged.connect(self._throttle.start)
        self.refresh_recent()

    def _advanced_group(self) -> QGroupBox:
        """generate's sampler settings beyond temperature / top-k / top-p; each at its "off" value
        means unset, so the model's shipped default (if any) applies, as in generate."""
        g = QGroupBox("Advanced sampling")
        f = QFormLayout(g)

        def spin(cls, lo, hi, step, off, tip, decimals=None, text="off"):
            w = cls(minimum=lo, maximum=hi, singleStep=step, value=off, toolTip=tip, specialValueText=text)
            if decimals is not None:
                w.setDecimals(decimals)
            w.valueChanged.connect(self._throttle.start)
            return w

        self.repetition_penalty = spin(QDoubleSpinBox, 0.0, 10.0, 0.05, 0.0, "repetition_penalty: divides the "
                                       "scores of tokens already in the text (> 1 discourages, < 1 favours)", 2)  # fmt: skip
        self.no_repeat_ngram = spin(QSpinBox, 0, 50, 1, 0, "no_repeat_ngram_size: never repeat an n-gram this long")
        f.addRow("repetition penalty / no-repeat n", hbox(None, self.repetition_penalty, self.no_repeat_ngram))
        self.min_p = spin(QDoubleSpinBox, 0.0, 1.0, 0.01, 0.0, "min_p (sampling): drop tokens below min-p "
                          "times the top token's probability", 3)  # fmt: skip
        self.typical_p = spin(QDoubleSpinBox, 0.0, 1.0, 0.05, 0.0, "typical_p (sampling): keep the locally "
                              "typical tokens up to this mass", 3)  # fmt: skip
        f.addRow("min-p / typical-p", hbox(None, self.min_p, self.typical_p))
        self.epsilon = spin(QDoubleSpinBox, 0.0, 0.99, 0.0005, 0.0, "epsilon_cutoff (sampling)", 4)
        self.eta = spin(QDoubleSpinBox, 0.0, 0.99, 0.0005, 0.0, "eta_cutoff (sampling)", 4)
        f.addRow("epsilon / eta", hbox(None, self.epsilon, self.eta))
        self.min_new_tokens = spin(QSpinBox, 0, 1_000_000, 1, 0, "min_new_tokens: no end-of-sequence token "
                                   "for this many steps")  # fmt: skip
        self.forced_eos = spin(QSpinBox, -1, 2**31 - 1, 1, -1, "forced_eos_token_id: this token is forced on the "
                               "last step (max steps)")  # fmt: skip
        f.addRow("min new tokens / forced EOS", hbox(None, self.min_new_tokens, self.forced_eos))
        self.suppress = QLineEdit(placeholderText="suppress token ids: 13,198",
                                  toolTip="suppress_tokens: token ids never chosen")  # fmt: skip
        self.bad_words = QLineEdit(placeholderText="bad word ids: 318;262,3290",
                                   toolTip="bad_words_ids: token-id sequences never completed (; between them)")  # fmt: skip
        for w in (self.suppress, self.bad_words):
            w.editingFinished.connect(self._ids_edited)
            f.addRow(w)
        self._good_ids = ({}, ("", ""))  # the last well-formed id lists and their text
        return g

    def _show_advanced(self, on: bool) -> None:
        self.advanced.setVisible(on)
        self.advanced_toggle.setArrowType(Qt.ArrowType.DownArrow if on else Qt.ArrowType.RightArrow)

    def _ids_edited(self) -> None:
        text = (self.suppress.text(), self.bad_words.text())
        if text == self._good_ids[1]:
            return
        try:
            ids = _parse_ids(*text)
        except InspectorError as e:
            with QSignalBlocker(self.suppress), QSignalBlocker(self.bad_words):
                self.suppress.setText(self._good_ids[1][0])
                self.bad_words.setText(self._good_ids[1][1])
            self.bad_input.emit(str(e))
            return
        self._good_ids = (ids, text)
        self._throttle.start()

    def sampler_settings(self) -> dict:
        """generate's other sampler settings as the controls show them, every one named (None: off)."""
        rp, mp, tp = self.repetition_penalty.value(), self.min_p.value(), self.typical_p.value()
        eos = self.forced_eos.value()
        return {
            "repetition_penalty": rp or None, "no_repeat_ngram_size": self.no_repeat_ngram.value() or None,
            "min_p": mp or None, "typical_p": None if tp in (0.0, 1.0) else tp,
            "epsilon_cutoff": self.epsilon.value() or None, "eta_cutoff": self.eta.value() or None,
            "min_new_tokens": self.min_new_tokens.value() or None,
            "forced_eos_token_id": None if eos < 0 else eos, "max_new_tokens": None if eos < 0 else self.max_steps.value(),
            "suppress_tokens": self._good_ids[0].get("suppress_tokens"),
            "bad_words_ids": self._good_ids[0].get("bad_words_ids"),
        }  # fmt: skip

    def set_sampler_settings(self, d: dict) -> None:
        """Show ``d``'s settings (``Decoding.to_json`` names; absent ones off), without signalling."""
        boxes = (self.repetition_penalty, self.no_repeat_ngram, self.min_p, self.typical_p, self.epsilon, self.eta,
                 self.min_new_tokens, self.forced_eos, self.suppress, self.bad_words)  # fmt: skip
        blockers = [QSignalBlocker(w) for w in boxes]
        self.repetition_penalty.setValue(d.get("repetition_penalty") or 0.0)
        self.no_repeat_ngram.setValue(d.get("no_repeat_ngram_size") or 0)
        self.min_p.setValue(d.get("min_p") or 0.0)
        self.typical_p.setValue(d.get("typical_p") or 0.0)
        self.epsilon.setValue(d.get("epsilon_cutoff") or 0.0)
        self.eta.setValue(d.get("eta_cutoff") or 0.0)
        self.min_new_tokens.setValue(d.get("min_new_tokens") or 0)
        self.forced_eos.setValue(-1 if d.get("forced_eos_token_id") is None else d["forced_eos_token_id"])
        text = (",".join(map(str, d.get("suppress_tokens") or ())),
                ";".join(",".join(map(str, w)) for w in d.get("bad_words_ids") or ()))  # fmt: skip
        self.suppress.setText(text[0])
        self.bad_words.setText(text[1])
        self._good_ids = (_parse_ids(*text), text)
        del blockers
        if any(v is not None for v in self.sampler_settings().values()):
            self.advanced_toggle.setChecked(True)

    # ------------------------------------------------------------------ values
    def _temperature_changed(self, v: float) -> None:
        pos = int(round(v * 100))
        if self.temp_slider.value() != pos and pos <= self.temp_slider.maximum():
            with QSignalBlocker(self.temp_slider):
                self.temp_slider.setValue(pos)
        self._throttle.start()

    def decoding(self) -> tuple[float, int | None, float | None]:
        k = self.top_k.value() or None
        p = self.top_p.value()
        return self.temperature.value(), k, (None if p >= 1.0 else p)

    def set_decoding(self, temperature: float, top_k: int | None, top_p: float | None) -> None:
        with (
            QSignalBlocker(self.temperature),
            QSignalBlocker(self.top_k),
            QSignalBlocker(self.top_p),
            QSignalBlocker(self.temp_slider),
        ):
            self.temperature.setValue(temperature)
            self.top_k.setValue(top_k or 0)
            self.top_p.setValue(1.0 if top_p is None else top_p)
            self.temp_slider.setValue(min(200, int(round(temperature * 100))))

    def model_spec(self) -> ModelSpec:
        text = self.model.currentText().strip()
        name = None if text in ("", DEMO_LABEL) else text
        dtype = self.dtype.currentText()
        dmap = self.device_map.currentText()
        return ModelSpec(name, self.device.currentText().strip() or "auto", None if dtype == "float32" else dtype,
                         self.allow_pickle.isChecked(), self.trust_code.isChecked(),
                         self.allow_unverified.isChecked(), device_map=None if dmap == "one device" else dmap,
                         max_memory=self.max_memory.text().strip() or None,
                         offload_folder=self.offload_folder.text().strip() or None)  # fmt: skip

    def set_model_spec(self, spec: ModelSpec) -> None:
        self.model.setCurrentText(spec.model or DEMO_LABEL)
        self.device.setCurrentText(spec.device or "auto")
        self.dtype.setCurrentText(spec.dtype or "float32")
        self.allow_pickle.setChecked(spec.allow_pickle)
        self.trust_code.setChecked(spec.trust_remote_code)
        self.allow_unverified.setChecked(spec.allow_unverified)
        self.device_map.setCurrentText(spec.device_map or "one device")
        self.max_memory.setText(spec.max_memory or "")
        self.offload_folder.setText(spec.offload_folder or "")

    def session_spec(self) -> SessionSpec:
        t, k, p = self.decoding()
        return SessionSpec(self.prompt.toPlainText(), t, k, p, self.seed.value(), self.sampler_settings(),
                           chat=self.chat)  # fmt: skip

    def set_chat(self, chat: dict | None) -> None:
        """Chat mode with these turns (``core.chat.Chat.to_json()``), or plain-prompt mode (None)."""
        self.chat = chat
        on = chat is not None
        self.prompt.setReadOnly(on)  # the template's text: edit the turns (Chat…), not the text
        self.plain_button.setVisible(on)
        self.chat_label.setVisible(on)
        if on:
            roles = ", ".join(m["role"] for m in chat["messages"])
            gen = " + generation prompt" if chat["add_generation_prompt"] else ""
            self.chat_label.setText(f"<b>chat</b>: {roles}{gen}")
            self.chat_label.setToolTip(f"{len(chat['messages'])} turns through the model's chat template; the box "
                                       "shows the exact text it made (Chat… edits the turns, Plain leaves chat mode)")  # fmt: skip
        self.prompt.setToolTip("The exact text the chat template made of the turns; Chat… edits them" if on else
                               "The text the model continues; Start (or Step after an edit) runs it")  # fmt: skip

    def refresh_recent(self) -> None:
        current = self.model.currentText()
        with QSignalBlocker(self.model):
            self.model.clear()
            self.model.addItem(DEMO_LABEL)
            for m in _settings.recent(RECENT_MODELS):
                self.model.addItem(m)
            self.model.setCurrentText(current or DEMO_LABEL)

    def remember_model(self, name: str | None) -> None:
        if name:
            _settings.remember(RECENT_MODELS, name)
            self.refresh_recent()

    def _browse(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Choose a model folder (with config.json)")
        if path:
            self.model.setCurrentText(path)

    def set_read_only(self, ro: bool) -> None:
        for w in (self.temperature, self.temp_slider, self.top_k, self.top_p, self.advanced):
            w.setEnabled(not ro)


def _parse_ids(suppress: str, bad_words: str) -> dict:
    """The id lists typed in the controls; InspectorError naming the field for anything else."""
    out = {}
    if suppress.strip():
        out["suppress_tokens"] = _ints(suppress, "suppress tokens")
    seqs = [part for part in bad_words.split(";") if part.strip()]
    if seqs:
        out["bad_words_ids"] = [_ints(part, "bad word ids") for part in seqs]
    if out:
        Decoding(**out)  # ids >= 0 and non-empty sequences; the vocabulary bound is the session's check
    return out


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise InspectorError(f"{what}: comma-separated token ids, got {text!r}") from None


class BreakpointsPanel(QWidget):
    """Stop a run when the chosen token matches a text, its probability is low or entropy high."""

    def __init__(self, parent=None):
        super().__init__(parent)
        f = QFormLayout(self)
        f.setContentsMargins(6, 6, 6, 6)
        self.on_text = QCheckBox("token contains", toolTip="Stop after a step whose chosen token contains this text")
        self.text = QLineEdit(placeholderText="e.g. .", toolTip="The text to look for in the chosen token")
        self.text.textEdited.connect(lambda s: self.on_text.setChecked(bool(s)))
        f.addRow(self.on_text, self.text)
        self.on_prob = QCheckBox("probability below", toolTip="Stop after a step whose chosen token was this unlikely")
        self.prob = QDoubleSpinBox(minimum=0.0, maximum=1.0, singleStep=0.05, decimals=3, value=0.1,
                                   toolTip="The probability threshold (0 to 1)")  # fmt: skip
        self.prob.valueChanged.connect(lambda _: self.on_prob.setChecked(True))
        f.addRow(self.on_prob, self.prob)
        self.on_entropy = QCheckBox("entropy above", toolTip="Stop after a step whose distribution was this flat")
        self.entropy = QDoubleSpinBox(minimum=0.0, maximum=100.0, singleStep=0.25, value=3.0, suffix=" nats",
                                      toolTip="−Σ p ln p of the next-token distribution; ln 2 ≈ 0.69 is a coin toss")  # fmt: skip
        self.entropy.valueChanged.connect(lambda _: self.on_entropy.setChecked(True))
        f.addRow(self.on_entropy, self.entropy)

    def breakpoints(self) -> Breakpoints:
        return Breakpoints(
            self.text.text() if self.on_text.isChecked() and self.text.text() else None,
            self.prob.value() if self.on_prob.isChecked() else None,
            self.entropy.value() if self.on_entropy.isChecked() else None,
        )
