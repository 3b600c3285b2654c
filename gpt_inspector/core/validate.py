"""Argument rules shared by every front door (Session, beam search, compare, the CLI).

One copy of each rule, so a prompt or a count that one path accepts is accepted by all.
"""

from __future__ import annotations

import os

import numpy as np

from .errors import InspectorError


def integer(name: str, v, low: int) -> int:
    """``v`` as an int >= ``low`` (bools and floats refused), else InspectorError."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
        raise InspectorError(f"{name} must be an integer >= {low}, got {v!r}")
    return int(v)


def count(n, name: str = "steps") -> int:
    """A number of steps (>= 1)."""
    return integer(name, n, 1)


def seed(v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise InspectorError(f"seed must be an integer, got {v!r}")
    return int(v)


def early_stopping(v) -> bool | str:
    """generate's ``early_stopping``: True, False or "never" (strings accepted from the CLI)."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("true", "false", "never"):
        s = v.strip().lower()
        return {"true": True, "false": False}.get(s, "never")
    raise InspectorError(f"early_stopping must be True, False or 'never', got {v!r}")


def prompt_ids(lm, prompt, ids) -> list[int]:
    """The token ids a run starts from: ``ids`` if given, else ``prompt`` tokenized; BOS for an empty prompt."""
    if ids is None:
        if not isinstance(prompt, str):
            raise InspectorError("prompt must be text")
        out = list(lm.tokenizer(prompt)["input_ids"]) if prompt else []
    else:
        try:
            out = [int(i) for i in ids]
        except (TypeError, ValueError):
            raise InspectorError("prompt token ids must be integers") from None
        if any(i < 0 or i >= lm.vocab_size for i in out):
            raise InspectorError(f"prompt token ids must be in [0, {lm.vocab_size})")
    if not out:
        if lm.bos_token_id is None:
            raise InspectorError("empty prompt and this tokenizer has no BOS token to start from; type a prompt")
        out = [lm.bos_token_id]
    return out


def memory_bytes() -> int | None:
    """The machine's physical memory in bytes, or None where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
