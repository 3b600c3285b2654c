"""Assisted decoding and chat prompts of a session on a remote engine, as the client sees them.

``RemoteAssisted`` is ``core.assisted.Assisted``'s API over the link: the engine proposes (a draft
model on its own disk, or prompt lookup), verifies and crops; the rounds come back as JSON, each field
checked here before it is used, and the session's new steps with them. ``chat_of`` rebuilds a
``core.chat.Chat`` from the engine's answer, checked the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..core.assisted import Round, Tally
from ..core.chat import Chat, check_messages
from ..core.errors import InspectorError
from .wire import WireError

if TYPE_CHECKING:
    from .client import RemoteSession

_INTS = ("proposed", "rejected", "tokens")
_COUNTS = ("index", "first_step", "accepted", "target_cache_verified", "target_cache", "target_cache_bytes")
_OPTIONAL = ("draft_cache_proposed", "draft_cache", "draft_cache_bytes")


def _int(v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise WireError(f"the engine sent a round whose {what} is not a count")
    return v


def round_of(d) -> Round:
    """A ``Round`` from the engine's JSON, every field checked (a malformed reply is refused in one line)."""
    if not isinstance(d, dict) or set(d) != {*_INTS, *_COUNTS, *_OPTIONAL, "seconds"}:
        raise WireError("the engine sent a malformed assisted round")
    out: dict = {k: _int(d[k], k) for k in _COUNTS}
    for k in _INTS:
        if not isinstance(d[k], list):
            raise WireError(f"the engine sent a round whose {k} is not a list of token ids")
        out[k] = tuple(_int(t, k) for t in d[k])
    for k in _OPTIONAL:
        out[k] = None if d[k] is None else _int(d[k], k)
    if isinstance(d["seconds"], bool) or not isinstance(d["seconds"], (int, float)):
        raise WireError("the engine sent a round whose seconds is not a number")
    r = Round(**out, seconds=float(d["seconds"]))
    if r.accepted > len(r.proposed) or r.rejected != r.proposed[r.accepted :] or not r.tokens:
        raise WireError("the engine sent an assisted round that does not add up")
    return r


def chat_of(d, ids) -> Chat | None:
    """The engine's ``chat_json`` as a ``Chat`` of the prompt ``ids`` (one role for each)."""
    if d is None:
        return None
    if not isinstance(d, dict) or set(d) != {"messages", "add_generation_prompt", "text", "roles"}:
        raise WireError("the engine sent a malformed chat prompt")
    msgs = check_messages(d["messages"])
    roles, text = d["roles"], d["text"]
    if not isinstance(text, str) or not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
        raise WireError("the engine sent a chat prompt whose text or roles are not text")
    if len(roles) != len(ids):
        raise WireError(f"the engine sent {len(roles)} token roles for a prompt of {len(ids)} tokens")
    return Chat(tuple((m["role"], m["content"]) for m in msgs), bool(d["add_generation_prompt"]), text,
                tuple(ids), tuple(roles))  # fmt: skip


class RemoteAssisted(Tally):
    """``core.assisted.Assisted`` on a ``RemoteSession``: ``round()``, ``run()``, ``back()``, the rounds,
    the acceptance rate. ``assistant``: a draft model's folder on the engine's machine (it loads it
    there), or None with ``prompt_lookup_num_tokens``. Starting restarts the session at its prompt."""

    def __init__(self, session: RemoteSession, assistant: str | None = None, **numbers):
        if assistant is not None and not isinstance(assistant, str):
            raise InspectorError(
                "over the link the assistant is named, not sent: give the draft model's folder on the engine's "
                "machine (a str), which the engine loads"
            )
        self.session = session
        self.rounds: list[Round] = []
        self.mode = ""
        self.max_length = 0
        self.settings: dict = {}
        self._apply(session._assisted_op("assisted_start", assistant=assistant, **numbers))

    def _apply(self, d: dict) -> None:
        n, new = d["n_rounds"], [round_of(x) for x in d["rounds"]]
        if not isinstance(n, int) or not 0 <= n - len(new) <= len(self.rounds):
            raise WireError("the engine sent a round count that does not match the rounds so far")
        self.rounds = self.rounds[: n - len(new)] + new
        labels = d["round_labels"]
        if not isinstance(labels, list) or not all(isinstance(x, list) and len(x) == 2 for x in labels):
            raise WireError("the engine sent malformed token labels")
        self.session._label_of.update({_int(i, "token id"): str(lab) for i, lab in labels})
        self.mode, self.max_length, self.settings = str(d["mode"]), int(d["max_length"]), dict(d["settings"])

    # ------------------------------------------------------------------ as Assisted's
    def round(self) -> Round:
        self._apply(self.session._assisted_op("assisted_round", rounds=1))
        return self.rounds[-1]

    def iter_rounds(self, max_rounds: int | None = None) -> Iterator[Round]:
        n = 0
        while not self.ended and (max_rounds is None or n < max_rounds):
            yield self.round()
            n += 1

    def run(self, max_rounds: int | None = None) -> list[Round]:
        """Rounds to the end (or ``max_rounds``) in one request: the engine runs them back to back."""
        if self.ended:
            return []
        before = len(self.rounds)
        self._apply(self.session._assisted_op("assisted_round", rounds=max_rounds))
        return self.rounds[before:]

    def back(self) -> Round:
        if not self.rounds:
            raise InspectorError("no round to undo")
        last = self.rounds[-1]
        self._apply(self.session._assisted_op("assisted_back"))
        return last

    def steps_of(self, r: Round) -> list:
        return self.session.steps_done[r.first_step : r.first_step + len(r.tokens)]
