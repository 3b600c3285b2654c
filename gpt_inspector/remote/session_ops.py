"""The engine's chat prompts, assisted decoding and rebuilt sessions: what a window or script on another
machine asks of them, run here beside the model and the tokenizer.

Mixed into ``server.Engine``; each ``op_<name>`` returns (JSON result, tensors) and runs under the
engine's lock with its arguments already checked against ``wire.OPS``. A chat's template is applied
here (the tokenizer is here); a draft model is loaded here, from this machine's disk, as ``load_model``
loads any model (safetensors only, never the repository's own code); the rounds go back as JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..core.errors import InspectorError

if TYPE_CHECKING:
    from ..core.assisted import Assisted
    from ..core.session import Session


def chat_json(chat) -> dict | None:
    """A ``core.chat.Chat`` as the client rebuilds it (the turns, the template's text and each token's role)."""
    if chat is None:
        return None
    return {**chat.to_json(), "text": chat.text, "roles": list(chat.roles)}


class SessionOps:
    """Chat, assisted decoding and replay for ``server.Engine`` (see the module docstring)."""

    lm: object
    session: Session | None
    assisted: Assisted | None = None
    _drafts: dict  # folder -> LoadedModel: a draft is loaded once per engine

    def _s(self) -> Session:  # server.Engine's
        raise NotImplementedError

    def _changing(self, change, edits: bool = False):  # server.Engine's
        raise NotImplementedError

    def state(self) -> dict:  # server.Engine's
        raise NotImplementedError

    def op_chat_build(self, messages, add_generation_prompt=True):
        """The prompt the engine's chat template makes of these turns, without opening a session (a preview)."""
        from ..core import chat

        c = chat.build(self.lm.tokenizer, messages, add_generation_prompt)  # type: ignore[attr-defined]
        return {"chat": chat_json(c), "ids": list(c.ids)}, []

    def op_replay(self, recipe):
        """A new session rebuilt from a recipe (a window's autosave, after the engine restarted)."""
        from ..core.recipe_check import check_recipe
        from ..core.session import Session

        check_recipe(recipe)
        self.session, self.assisted = Session.replay(self.lm, recipe), None  # type: ignore[arg-type]
        return self.state(), []

    # ------------------------------------------------------------------ assisted decoding
    def _draft(self, folder: str):
        from ..core.models import load_model

        try:
            p = Path(folder).expanduser()
            found = p.is_dir()
        except (RuntimeError, ValueError, OSError):  # ~someone unknown here, a NUL byte: no such folder either
            found = False
        if not found:
            # the laptop names it, the engine loads it: only what is already on this machine, never a download
            raise InspectorError(f"no folder {folder!r} on the engine's machine: name a draft model saved there")
        key = str(p.resolve())
        if not hasattr(self, "_drafts"):
            self._drafts = {}
        if key not in self._drafts:
            self._drafts[key] = load_model(p, device=str(self.lm.device))  # type: ignore[attr-defined]
        return self._drafts[key]

    def op_assisted_start(self, assistant=None, **numbers):
        """Restart the session at its prompt and put an assisted run over it (its settings checked first)."""
        from ..core.assisted import Assisted

        s = self._s()
        draft = None if assistant is None else self._draft(assistant)
        threshold = numbers.pop("assistant_confidence_threshold", None)
        Assisted.check(s, draft, **numbers)  # before the session is touched: a refusal leaves its steps
        if threshold is not None and draft is None:
            raise InspectorError("assistant_confidence_threshold applies to a draft model, not to prompt lookup")

        def start(s):
            s.restart()
            self.assisted = Assisted(s, draft, assistant_confidence_threshold=threshold, **numbers)

        return self._rounds(self._changing(start)[1], 0), []

    def _run(self) -> Assisted:
        a = self.assisted
        if a is None or a.session is not self.session:
            raise InspectorError("no assisted run on this session: start one first")
        return a

    def op_assisted_round(self, rounds=1):
        a = self._run()
        before = len(a.rounds)

        def go(_s):
            for _ in a.iter_rounds(rounds):  # one by one: Ctrl+C on the server stops between two rounds
                if self.stopping.is_set():  # type: ignore[attr-defined]
                    break

        if a.ended:
            a.round()  # says why, in one line
        return self._rounds(self._changing(go)[1], before), []

    def op_assisted_back(self):
        a = self._run()
        sync = self._changing(lambda _s: a.back())[1]
        return self._rounds(sync, len(a.rounds)), []

    def _rounds(self, sync: dict, since: int) -> dict:
        """The reply of an assisted op: the session's change, and the rounds from ``since`` on with their labels."""
        a = self.assisted
        assert a is not None
        s = a.session
        new = a.rounds[since:]
        ids = sorted({t for r in new for t in (*r.proposed, *r.tokens)})
        return {**sync, "mode": a.mode, "n_rounds": len(a.rounds), "rounds": [r.to_json() for r in new],
                "round_labels": [[i, s.label(i)] for i in ids], "max_length": a.max_length,
                "settings": a.settings}  # fmt: skip
