"""A prompt built from the tokenizer's chat template: the turns, the text the template made, each token's role.

``build(tokenizer, messages, add_generation_prompt)`` renders the turns with the tokenizer's own
``apply_chat_template`` (through ``core/hf.py``): the token ids are exactly the ones it returns. A
token's role is the turn whose content it falls in (by the fast tokenizer's character offsets in the
rendered text); everything else the template wrote (turn headers, special tokens, the generation
prompt) is ``template``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from . import hf, validate
from .errors import InspectorError

ROLES = ("system", "user", "assistant")
TEMPLATE = "template"  # a token the chat template wrote, not any turn's content
MAX_MESSAGES = 1024


@dataclass(frozen=True)
class Chat:
    """The turns, whether the generation prompt was added, the rendered text and each prompt token's role."""

    messages: tuple[tuple[str, str], ...]  # (role, content)
    add_generation_prompt: bool
    text: str
    ids: tuple[int, ...]
    roles: tuple[str, ...]  # one per id: a message's role, or TEMPLATE

    def messages_json(self) -> list[dict]:
        return [{"role": r, "content": c} for r, c in self.messages]

    def to_json(self) -> dict:
        return {"messages": self.messages_json(), "add_generation_prompt": self.add_generation_prompt}


def check_messages(messages) -> list[dict]:
    """``messages`` as a list of {"role", "content"} with text values, else InspectorError in one line."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InspectorError('messages must be a non-empty list of {"role": ..., "content": ...} objects')
    if len(messages) > MAX_MESSAGES:
        raise InspectorError(f"at most {MAX_MESSAGES} messages, got {len(messages)}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise InspectorError(f'message {i + 1} must be an object with exactly "role" and "content"')
        if not isinstance(m["role"], str) or not m["role"].strip():
            raise InspectorError(f"message {i + 1}: role must be non-empty text")
        if not isinstance(m["content"], str):
            raise InspectorError(f"message {i + 1}: content must be text")
        validate.text(m["content"], f"message {i + 1}'s content")
        validate.text(m["role"], f"message {i + 1}'s role")
        out.append({"role": m["role"], "content": m["content"]})
    return out


MAX_MESSAGES_BYTES = 64 * 2**20  # a long conversation is a few MB


def load_messages(path) -> list[dict]:
    """The messages in a JSON file (a list of turns, or {"messages": [...]}), checked."""
    import stat

    try:
        # a FIFO or a device would block the read (or never end): a messages file is a regular file
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise InspectorError(f"{path} is not a regular file: give a JSON file of messages")
        if os.path.getsize(path) > MAX_MESSAGES_BYTES:
            raise InspectorError(
                f"{path} is larger than {MAX_MESSAGES_BYTES // 2**20} MiB: too large for chat messages"
            )
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise InspectorError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise InspectorError(f"{path} is not JSON: {str(e).splitlines()[0]}") from None
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    return check_messages(data)


def build(tokenizer, messages, add_generation_prompt: bool = True) -> Chat:
    """The prompt the tokenizer's chat template makes of ``messages``; InspectorError if it has none."""
    msgs = check_messages(messages)
    if hf.chat_template_of(tokenizer) is None:
        raise InspectorError("this model's tokenizer has no chat template; give a plain --prompt instead")
    try:
        text, ids = hf.apply_chat_template(tokenizer, msgs, bool(add_generation_prompt))
    except Exception as e:  # the template's own Jinja error (raise_exception, a role it refuses)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InspectorError(f"the chat template refused these messages: {first}") from None
    if not ids:
        raise InspectorError("the chat template produced no tokens for these messages")
    return Chat(tuple((m["role"], m["content"]) for m in msgs), bool(add_generation_prompt), text, tuple(ids),
                tuple(_roles(tokenizer, text, ids, msgs)))  # fmt: skip


def _roles(tokenizer, text: str, ids: list[int], msgs: list[dict]) -> list[str]:
    # each turn's content, found in order in the rendered text (a template may trim or drop a turn:
    # that turn then claims nothing and its tokens stay TEMPLATE)
    spans, at = [], 0
    for m in msgs:
        c = m["content"].strip()
        k = text.find(c, at) if c else -1
        if k >= 0:
            spans.append((k, k + len(c), m["role"]))
            at = k + len(c)
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        same = list(enc["input_ids"]) == list(ids)
    except (NotImplementedError, ValueError, TypeError, KeyError):  # a slow tokenizer has no offsets
        same = False
    if not same:
        return [TEMPLATE] * len(ids)
    out = []
    for a, b in offsets:
        mid = (a + b) / 2  # a token straddling a turn's edge goes where most of it is
        out.append(next((r for s, e, r in spans if s <= mid < e), TEMPLATE))
    return out


__all__ = ["Chat", "ROLES", "TEMPLATE", "build", "check_messages", "load_messages"]
