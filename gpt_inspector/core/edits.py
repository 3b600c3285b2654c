"""Edits a user makes to a run, and what they change: mask edits (block or re-allow a query→key cell),
knock-outs and patches of head outputs, their compiled per-layer form the attention function reads,
the keys each query row may attend to once the model's own mask and the edits are applied, and the
front-end decisions about editing (what a click on a cell toggles, when Restart needs a new session),
kept here so every front end makes them the same way.

Kept apart from ``capture`` (the attention function and its records) so the readers of a run can
ask what was allowed without the machinery that recorded it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from .errors import InspectorError


@dataclass(frozen=True)
class MaskEdit:
    """Block (or re-allow) attention from query position ``query`` to key position ``key``.

    ``layer=None`` means every layer; ``head=None`` every head of the layer(s).
    """

    query: int
    key: int
    layer: int | None = None
    head: int | None = None
    blocked: bool = True

    def scope(self) -> tuple[int | None, int | None, int, int]:
        return (self.layer, self.head, self.query, self.key)

    def to_json(self) -> dict:
        return {"query": self.query, "key": self.key, "layer": self.layer, "head": self.head, "blocked": self.blocked}

    @classmethod
    def from_json(cls, d: dict) -> MaskEdit:
        try:
            return cls(
                query=int(d["query"]),
                key=int(d["key"]),
                layer=None if d.get("layer") is None else int(d["layer"]),
                head=None if d.get("head") is None else int(d["head"]),
                blocked=bool(d.get("blocked", True)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InspectorError(f"bad mask edit {d!r}: {e}") from None


@dataclass(frozen=True)
class HeadEdit:
    """Knock out head ``head`` of ``layer`` (``head=None``: the layer's whole attention), or, with
    ``patch_from``, write in that head's output from another run of the same model over those
    token ids, at the same positions.
    """

    layer: int
    head: int | None = None
    patch_from: tuple[int, ...] | None = None

    def to_json(self) -> dict:
        return {"layer": self.layer, "head": self.head,
                "patch_from": None if self.patch_from is None else list(self.patch_from)}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict) -> HeadEdit:
        try:
            src = d.get("patch_from")
            return cls(int(d["layer"]), None if d.get("head") is None else int(d["head"]),
                       None if src is None else tuple(int(i) for i in src))  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InspectorError(f"bad head edit {d!r}: {e}") from None


@dataclass
class CompiledEdits:
    """Blocked cells per layer as index tensors, so applying them is one masked_fill."""

    heads: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (n,) long
    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    cols: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, blocked: set[tuple[int, int, int, int]], n_layers: int) -> CompiledEdits:
        """``blocked`` holds (layer, head, query, key) expanded to concrete layers and heads."""
        out = cls()
        per_layer: dict[int, list[tuple[int, int, int]]] = {}
        for layer, head, i, j in blocked:
            per_layer.setdefault(layer, []).append((head, i, j))
        for layer, cells in per_layer.items():
            t = torch.tensor(sorted(cells), dtype=torch.long)  # (n, 3)
            out.heads[layer], out.rows[layer], out.cols[layer] = t[:, 0], t[:, 1], t[:, 2]
        return out

    def _cells(self, layer: int, q0: int, tq: int, tk: int) -> tuple[torch.Tensor, ...] | None:
        """(heads, rows, cols) of the blocked cells a forward over queries q0..q0+tq and tk keys meets."""
        if layer not in self.heads:
            return None
        h, i, j = self.heads[layer], self.rows[layer], self.cols[layer]
        sel = (i >= q0) & (i < q0 + tq) & (j < tk)
        if not bool(sel.any()):
            return None
        return h[sel], i[sel], j[sel]

    def block_for(self, layer: int, n_heads: int, q0: int, tq: int, tk: int) -> torch.Tensor | None:
        cells = self._cells(layer, q0, tq, tk)
        if cells is None:
            return None
        h, i, j = cells
        block = torch.zeros(n_heads, tq, tk, dtype=torch.bool)  # (H, Tq, Tk)
        block[h, i - q0, j] = True
        return block

    def rows_for(self, layer: int, n_heads: int, q0: int, tq: int, tk: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The edited query rows of a forward over q0..q0+tq only: (offsets (n,), blocked (H, n, Tk)).

        A recompute at long T has thousands of query rows and edits on a handful; a dense
        (H, Tq, Tk) block would cost gigabytes to say so.
        """
        cells = self._cells(layer, q0, tq, tk)
        if cells is None:
            return None
        h, i, j = cells
        offsets, which = torch.unique(i - q0, return_inverse=True)  # (n,), (m,)
        block = torch.zeros(n_heads, offsets.shape[0], tk, dtype=torch.bool)  # (H, n, Tk)
        block[h, which, j] = True
        return offsets, block


def compile_edits(
    edits: Iterable[MaskEdit], n_layers: int, n_heads: int
) -> tuple[set[tuple[int, int, int, int]], CompiledEdits]:
    """Blocked edits expanded to concrete (layer, head, query, key) cells, and compiled for capture."""
    cells: set[tuple[int, int, int, int]] = set()
    for e in edits:
        if not e.blocked:
            continue
        layers = range(n_layers) if e.layer is None else [e.layer]
        heads = range(n_heads) if e.head is None else [e.head]
        cells.update((layer, h, e.query, e.key) for layer in layers for h in heads)
    return cells, CompiledEdits.build(cells, n_layers)


def allowed_rows(
    mask_rows: dict[int, torch.Tensor],
    t: int,
    p0: int,
    p1: int,
    edits: CompiledEdits | None = None,
    layer: int = 0,
    head: int | None = None,
    n_heads: int = 1,
) -> torch.Tensor:
    """Keys that query rows p0..p1 could attend to: causal, the model's own mask, the edits.

    Returns (n, T) bool for one ``head``, or (n_heads, n, T) when ``head`` is None. A mask row
    is (T,) shared by the heads, (H, T) where the model masks each head differently, or (1, H, T)
    as a live single-row recorder keeps those.
    """
    pos = torch.arange(p0, p1)
    base = torch.arange(t)[None, :] <= pos[:, None]  # (n, T) causal
    rows = [(p, row[0] if row.dim() == 3 else row) for p, row in mask_rows.items() if p0 <= p < p1]
    per_head = any(row.dim() == 2 for _, row in rows)
    if per_head:
        base = base.unsqueeze(0).expand(n_heads, -1, -1).clone()  # (H, n, T)
    for p, row in rows:
        # a row is as long as the keys of its own forward; later keys are future ones
        n = min(row.shape[-1], t)
        base[..., p - p0, :n] = row[..., :n]
    if per_head:
        allowed = base if head is None else base[head].clone()
    else:
        allowed = base if head is not None else base.unsqueeze(0).expand(n_heads, -1, -1).clone()
    cells = None if edits is None else edits._cells(layer, p0, p1 - p0, t)
    if cells is not None:
        h, i, j = cells
        if head is not None:
            sel = h == head
            allowed[i[sel] - p0, j[sel]] = False
        else:
            allowed[h, i - p0, j] = False
    return allowed


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
    if wanted is None:
        return False
    chat, want = getattr(session, "chat", None), getattr(wanted, "chat", None)
    if chat is not None or want is not None:  # a chat session: its turns, not the text they make, are the prompt
        return want is None or chat is None or want != chat.to_json() or wanted.seed != session.seed
    return wanted.prompt != session.prompt or wanted.seed != session.seed
