"""Mask edits, knock-outs and patches on a live session: validate, recompute from the earliest
affected position with the chosen tokens kept, and roll back completely on any fault."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .capture import scratch_forward
from .edits import HeadEdit, MaskEdit, compile_edits
from .errors import Cancelled, InspectorError
from .forward import crop_cache, interrupts_deferred, save_state, undo
from .recipe_check import edit_shape, push_op

if TYPE_CHECKING:
    from .capture import Recorder
    from .decoding import Decoding
    from .models import LoadedModel
    from .step import Step

# positions per forward of a recompute: the points where progress is reported and a cancel can
# land, and a bound on the (chunk x T) mask a forward over a kept prefix needs
RECOMPUTE_CHUNK = 1024

Progress = Callable[[int, int], None]  # (positions recomputed, positions to recompute)


@dataclass
class MaskEditReport:
    """How a mask edit changed the current next-token distribution."""

    earliest_position: int | None  # first recomputed position; None if nothing processed was affected
    recomputed: int  # positions re-run through the model
    before: torch.Tensor | None  # (V,) probs before
    after: torch.Tensor | None  # (V,) probs after
    tokens_changed: bool = False  # always False: chosen tokens are teacher-forced

    @property
    def total_variation(self) -> float:
        if self.before is None or self.after is None:
            return 0.0
        return float(0.5 * (self.before - self.after).abs().sum())


class EditingMixin:
    """The editing half of ``Session`` (state it uses: cache, recorder, tokens, steps_done, _ops)."""

    if TYPE_CHECKING:  # what Session, the class this is mixed into, provides: typed for the methods here
        lm: LoadedModel
        cache: Any  # the model's cache: a DynamicCache, or a hybrid's own (core.state_cache)
        recorder: Recorder
        tokens: list[int]
        steps_done: list[Step]
        _blocked: dict[tuple, MaskEdit]
        _head_edits: list[HeadEdit]
        _patch_sources: dict[tuple[int, ...], list[torch.Tensor]]
        _ops: list[dict]
        n_layers: int
        n_heads: int
        vocab_size: int
        model_name: str

        @property
        def cache_length(self) -> int: ...
        @property
        def current(self) -> Step | None: ...
        @property
        def mask_edits(self) -> list[MaskEdit]: ...
        def check_layer(self, layer: Any) -> int: ...
        def check_head(self, head: Any) -> int: ...
        def _forward(self, ids: list[int], keep: int) -> torch.Tensor: ...
        def _refresh(self, s: Step, dec: Decoding | None = None, stages: Any = None) -> None: ...
        def _window_outputs(self) -> None: ...
        def _emit(self, event: str, payload: object) -> None: ...

    # ------------------------------------------------------------------ mask editing
    def _validate_edit(self, e: MaskEdit) -> None:
        if not isinstance(e, MaskEdit):
            raise InspectorError(f"mask edits must be MaskEdit values, got {e!r}")
        for what, v in (("query", e.query), ("key", e.key)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise InspectorError(f"mask edit {what} position must be an integer, got {v!r}")
        if not isinstance(e.blocked, (bool, np.bool_)):
            raise InspectorError(f"mask edit 'blocked' must be True or False, got {e.blocked!r}")
        if e.layer is not None:
            self.check_layer(e.layer)
        if e.head is not None:
            self.check_head(e.head)
        if not (0 <= e.query < self.lm.context_length) or not (0 <= e.key < self.lm.context_length):
            raise InspectorError(
                f"mask edit positions must be in [0, {self.lm.context_length}), got {e.query}->{e.key}"
            )
        if e.key > e.query:
            verb = "allow" if not e.blocked else "block"
            raise InspectorError(
                f"cannot {verb} query {e.query} -> key {e.key}: a future position; the causal mask always hides it"
            )

    def _refuse_under_policy(self, what: str) -> None:
        # a KV lab's policy run: its evictions and its step-back states follow the path it took, so
        # a recompute under other edits would leave the lab's record of that path wrong
        if self.recorder.kv_policy is not None:
            raise InspectorError(f"{what} are not available on a KV cache policy's run (the KV lab): edit the "
                                 "reference session, or edit first and run the lab on that")  # fmt: skip

    def set_mask_edits(self, edits: Iterable[MaskEdit], progress: Progress | None = None,
                       cancelled: Callable[[], bool] | None = None) -> MaskEditReport:  # fmt: skip
        """Replace the mask edits in force and recompute from the earliest affected position.

        Edits apply in order: a block adds a cell for its scope, an allow removes that scope's block.
        Chosen tokens are kept (teacher-forced); the report says how the current distribution moved.
        ``progress(done, total)`` hears of each chunk of positions recomputed; when ``cancelled()``
        turns true between chunks the session goes back exactly to where it was and ``Cancelled``
        is raised.
        """
        self._refuse_under_policy("mask edits")
        edits = list(edits)
        blocked: dict[tuple, MaskEdit] = {}
        for e in edits:
            self._validate_edit(e)
            if e.blocked:
                blocked[e.scope()] = e
            else:
                blocked.pop(e.scope(), None)
        new_cells, compiled = compile_edits(blocked.values(), self.lm.n_layers, self.lm.n_heads)
        rows = Counter((l, h, i) for l, h, i, _ in new_cells)  # blocked keys per query row
        for (l, h, i), n in rows.items():
            if n >= i + 1:
                raise InspectorError(
                    f"that would mask every key of query {i} in layer {l} head {h}; softmax needs at least one key"
                )
        changed = new_cells ^ compile_edits(self._blocked.values(), self.lm.n_layers, self.lm.n_heads)[0]
        op = {"op": "mask", "edits": [e.to_json() for e in blocked.values()]}
        return self._put_edits("_blocked", blocked, "edits", compiled, op, min((c[2] for c in changed), default=None),
                               progress, cancelled)  # fmt: skip

    def _put_edits(self, own: str, edits, rec: str, compiled, op: dict, earliest: int | None,
                   progress: Progress | None, cancelled: Callable[[], bool] | None) -> MaskEditReport:  # fmt: skip
        """Put ``edits`` in ``self.<own>`` and ``compiled`` in ``recorder.<rec>``, recompute from
        ``earliest`` and record ``op``; all of it is put back on a fault or a cancel."""
        prev, prev_compiled = getattr(self, own), getattr(self.recorder, rec)
        committed, ops = [], push_op(self._ops, op, edit_shape(self.lm))

        def commit():
            self._ops = ops
            committed.append(True)

        try:
            setattr(self, own, edits)
            setattr(self.recorder, rec, compiled)
            report = self._recompute_from(earliest, lambda: setattr(self.recorder, rec, prev_compiled), commit,
                                          progress, cancelled)  # fmt: skip
        except BaseException:
            if not committed:  # an interrupt just after the commit keeps the new, complete state
                setattr(self, own, prev)
                setattr(self.recorder, rec, prev_compiled)
            raise
        self._emit("mask", report)
        return report

    def add_mask_edit(self, edit: MaskEdit, progress: Progress | None = None,
                      cancelled: Callable[[], bool] | None = None) -> MaskEditReport:  # fmt: skip
        return self.set_mask_edits([*self.mask_edits, edit], progress, cancelled)

    def clear_mask_edits(
        self, progress: Progress | None = None, cancelled: Callable[[], bool] | None = None
    ) -> MaskEditReport:
        return self.set_mask_edits([], progress, cancelled)

    def _recompute_from(self, earliest: int | None, restore: Callable[[], None], commit: Callable[[], None],
                        progress: Progress | None = None, cancelled: Callable[[], bool] | None = None) -> MaskEditReport:  # fmt: skip
        """Re-run positions earliest..end under the edits now in the recorder (tokens kept).

        The cache before ``earliest`` is reused; the rest runs in chunks of ``RECOMPUTE_CHUNK``
        positions, with ``progress`` after each and ``cancelled`` checked before each. On a
        fault or a cancel ``restore()`` puts the recorder's previous edits back and the cache and
        records are put back as they were (kept, not recomputed); ``commit()`` records the change
        once the new numbers are all in place.
        """
        end = self.cache_length
        cur = self.current
        before = cur.probs.clone() if cur else None
        if earliest is None or earliest >= end:
            with interrupts_deferred():
                commit()
            return MaskEditReport(None, 0, before, before)
        layout = getattr(self.lm, "kv_layout", None)
        if layout is not None and layout.state_layers:
            # the running state at a position inside an earlier forward was never kept (core.state_cache)
            raise InspectorError(
                "mask and head edits are not available for hybrid models: their state-space layers keep a "
                "running state that cannot be recomputed from the edited position"
            )
        decided = [s for s in self.steps_done if s.position >= earliest]
        # logits only where a step decides a token: a (T x V) block at T = 8,192 is a gigabyte
        first = decided[0].position if decided else end - 1
        put_back = save_state(self.cache, self.recorder, earliest)  # None: a cache of another kind
        committed = False
        try:
            crop_cache(self.cache, earliest)
            self.recorder.crop(earliest)
            parts = []
            for a in range(earliest, end, RECOMPUTE_CHUNK):
                if cancelled is not None and cancelled():
                    raise Cancelled("the mask edit was cancelled; the session is as it was before it")
                b = min(a + RECOMPUTE_CHUNK, end)
                keep = b - max(a, first)  # this chunk's positions at or after the first decided one
                logits = self._forward(self.tokens[a:b], max(keep, 1))  # (max(keep, 1), V)
                if keep > 0:
                    parts.append(logits)
                if progress is not None:
                    progress(b - earliest, end - earliest)
            logits = torch.cat(parts)  # (end - first, V)
            # the new logits go in all at once or not at all: an interrupt halfway would mix two masks
            fresh = [(s, logits[s.position - first].clone()) for s in decided]
            with interrupts_deferred():
                for s, row in fresh:
                    s.logits = row
                    self._refresh(s)
                commit()
                self._window_outputs()  # the recompute wrote head outputs from `earliest` on: back to the window
                committed = True
        except BaseException:
            if committed:  # a Ctrl+C held back through the commit: the new state is whole, keep it
                raise

            # the caller restores the previous edits; the cache and records return as they were:
            # kept, or, for a cache of another kind, refilled under the previous edits (a second
            # Ctrl+C waits: stopping the refill would leave the cache short)
            def back():
                restore()
                if put_back is not None:
                    put_back()
                else:
                    crop_cache(self.cache, earliest)
                    self.recorder.crop(earliest)
                    self._forward(self.tokens[earliest:end], 1)

            undo(back)
            raise
        after = cur.probs.clone() if cur else None
        return MaskEditReport(earliest, end - earliest, before, after)

    # ------------------------------------------------------------------ knock-out and patching
    @property
    def head_edits(self) -> list[HeadEdit]:
        return list(self._head_edits)

    def patch_edit(self, layer: int, head: int, source) -> HeadEdit:
        """A HeadEdit that writes ``source``'s output of (layer, head) into this run, position by position.

        ``source`` is another Session (or Trace) of the same model that processed at least as
        many positions as this run.
        """
        self.check_layer(layer), self.check_head(head)
        if getattr(source, "model_name", None) != self.model_name or source.n_heads != self.n_heads:
            raise InspectorError("the patch source must be a run of the same model")
        if source.cache_length < self.cache_length:
            raise InspectorError(
                f"the patch source processed {source.cache_length} positions; this run has {self.cache_length}, "
                "so some positions would have nothing to patch in: run the source further"
            )
        return HeadEdit(layer, head, tuple(source.processed_tokens))

    def _head_outputs_of(self, ids: tuple[int, ...]) -> list[torch.Tensor]:
        """Per layer (H, T_src, d): the head outputs of a clean run over ``ids`` (cached per source)."""
        if ids not in self._patch_sources:
            rec = scratch_forward(self.lm, ids)  # no edits: the source runs as the model does
            self._patch_sources[ids] = [rec.out[i].view(len(ids))[0].clone() for i in range(self.n_layers)]
        return self._patch_sources[ids]

    def set_head_edits(self, edits: Iterable[HeadEdit], progress: Progress | None = None,
                       cancelled: Callable[[], bool] | None = None) -> MaskEditReport:  # fmt: skip
        """Replace the knock-outs and patches in force and recompute the run (teacher-forced).

        The report says how the current next-token distribution moved.
        """
        self._refuse_under_policy("knock-outs and patches")
        edits = list(edits)
        compiled: dict[int, list] = {}
        for e in edits:
            if not isinstance(e, HeadEdit):
                raise InspectorError(f"head edits must be HeadEdit values, got {e!r}")
            self.check_layer(e.layer)
            if e.head is not None:
                self.check_head(e.head)
            if e.patch_from is not None:
                if e.head is None:
                    raise InspectorError("patching takes one head; knock out a whole layer with head=None instead")
                if any(not 0 <= i < self.vocab_size for i in e.patch_from):
                    raise InspectorError(f"patch source token ids must be in [0, {self.vocab_size})")
                if len(e.patch_from) < self.cache_length:
                    raise InspectorError(f"the patch source has {len(e.patch_from)} positions; this run has "
                                         f"{self.cache_length}: run the source further")  # fmt: skip
        for e in edits:  # validated: now the (possibly slow) source runs
            heads = range(self.n_heads) if e.head is None else [e.head]
            src = None if e.patch_from is None else self._head_outputs_of(e.patch_from)[e.layer]
            compiled.setdefault(e.layer, []).extend((h, src) for h in heads)
        op = {"op": "heads", "edits": [e.to_json() for e in edits]}
        return self._put_edits("_head_edits", edits, "head_edits", compiled, op, 0 if (edits or self._head_edits) else None,
                               progress, cancelled)  # fmt: skip
