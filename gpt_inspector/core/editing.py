"""Front-end decisions about editing a session, kept here so every front end makes them the same way."""

from __future__ import annotations

from collections.abc import Iterable

from .edits import MaskEdit
from .errors import InspectorError

SCOPES = ("head", "layer", "all")


def toggle_cells(edits: Iterable[MaskEdit], cells: Iterable[tuple[int, int]], layer: int, head: int,
                 scope: str = "head", block: bool | None = None) -> list[MaskEdit]:  # fmt: skip
    """The mask edits after clicking (or dragging over) ``cells`` = [(query, key), ...].

    ``scope`` says what a click blocks: the selected head, every head of the selected layer, or
    every layer. ``block=None`` toggles: the first cell decides, so a drag that starts on a
    blocked cell unblocks all it crosses and one that starts on a free cell blocks them all.
    Cells above the diagonal are dropped (the causal mask already hides them); the edits of
    other scopes are kept.
    """
    if scope not in SCOPES:
        raise InspectorError(f"mask edit scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    lay = None if scope == "all" else layer
    hd = head if scope == "head" else None
    cells = [(int(q), int(k)) for q, k in cells if k <= q]
    edits = list(edits)
    if not cells:
        return edits
    present = {e.scope() for e in edits}
    if block is None:
        q, k = cells[0]
        block = (lay, hd, q, k) not in present
    if block:
        added = []
        for q, k in cells:
            if (lay, hd, q, k) not in present:
                present.add((lay, hd, q, k))  # a drag may cross the same cell twice
                added.append(MaskEdit(q, k, lay, hd, True))
        return edits + added
    drop = {(lay, hd, q, k) for q, k in cells}
    return [e for e in edits if e.scope() not in drop]


def restart_starts_new_session(session, wanted) -> bool:
    """Whether Restart must build a new session rather than step back to the prompt.

    ``wanted`` is anything with ``prompt`` and ``seed`` (the controls' values) or None. A changed
    prompt or seed cannot be reached by stepping back; changed decoding settings can, so they
    are applied to the restarted session instead.
    """
    return wanted is not None and (wanted.prompt != session.prompt or wanted.seed != session.seed)
