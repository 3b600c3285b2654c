"""The run-source protocol: what a run *is*, and one reader that derives everything else from it.

A run source is anything that holds a processed sequence: the live ``Session``, one beam of a
search (``BeamView``), a saved ``Trace``, the KV lab's policy run (a ``Session`` under a cache
policy). Each implements only the primitives:

- shapes (``n_layers``, ``n_heads``, ``n_kv_heads``, ``head_dim``, ``context_length``,
  ``vocab_size``), ``model_name``, ``read_only``, ``kv_itemsize``, ``cache_length``;
- ``tokens``, ``prompt_ids``, ``prompt``, ``steps_done`` (``Step`` records), ``finished``,
  ``decoding``, ``mask_edits``, ``seed``, and ``label(token_id)`` for readable token text;
- ``records``: a ``RunRecords``, what the model's attention function received or produced per layer (queries, keys,
  values, head outputs, mask rows, edits, scaling, soft-cap, sinks, score bias);
- ``live``: a ``Live``, what can be executed on the source (stepping, the cache probe, the recompute of
  head outputs it did not keep, the logit lens, the KV lab, a comparison of decodings), each refusal one line;
- ``lm``, the loaded model, or None (a trace); optionally ``unverified`` (why the load's fidelity self-test could
  not vouch for the numbers) and ``kv_policy`` (core.kvlab's policy the forwards ran under).

``RunSource`` turns those into the public accessors every reader uses (``attention``,
``attention_rows``, ``qkv``, ``allowed``, ``kv_cache_bytes``, ...) through the one equation in
``core.attention``. A view, a figure or a CLI command that needs something new adds it here,
never in a second adapter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

from . import attention as eq
from .edits import allowed_rows
from .errors import InspectorError, check_index
from .live import Live
from .tiles import ViewTiles

if TYPE_CHECKING:
    from .decoding import Decoding
    from .edits import CompiledEdits, MaskEdit
    from .kv_layout import KVLayout
    from .models import LoadedModel
    from .step import Step


@runtime_checkable
class RunRecords(Protocol):
    """What a run recorded per layer, as the model's attention function received or produced it.

    T is the source's ``cache_length``. Tensors are zero-copy views where the source can give them:
    read them on the thread that changes the source and only until its next change; do not modify.
    Implementations may subclass this protocol for the defaults (no sink, no score bias, nothing
    recomputed).
    """

    if TYPE_CHECKING:  # read-only for the checker, so an implementation may compute it (a property)

        @property
        def head_output_start(self) -> int:
            """The first position whose attention output per head is kept (a session keeps them from the
            prompt's last position on, where the steps decide tokens: the positions the lens looks at)."""
    else:
        head_output_start: int
    edits: CompiledEdits | None  # the compiled mask edits the forwards ran under, or None

    def queries(self, layer: int) -> torch.Tensor:
        """(H, T, d) q of every processed position."""
        ...

    def keys(self, layer: int) -> torch.Tensor:
        """(H_kv, T, d)."""
        ...

    def values(self, layer: int) -> torch.Tensor:
        """(H_kv, T, d)."""
        ...

    def head_outputs(self, layer: int) -> torch.Tensor:
        """(H, T - head_output_start, d): the attention output per head, before the output projection."""
        ...

    def mask_rows(self, layer: int) -> dict[int, torch.Tensor]:
        """position -> (T,) or (H, T) bool: the model's own mask where a row is not plain causal."""
        ...

    def scaling(self, layer: int) -> float: ...

    def softcap(self, layer: int) -> float | None: ...

    def sink(self, layer: int) -> torch.Tensor | None:
        """(H,) the attention-sink logits, or None (most models have none)."""
        return None

    def score_bias(self, layer: int) -> eq.ScoreBias | None:
        """The model's additive score bias (ALiBi, doge's dynamic mask), or None."""
        return None

    def head_output_row(self, layer: int, position: int) -> torch.Tensor | None:
        """(H, d) the kept head outputs of one position at or after ``head_output_start``, read
        without assembling the others; None: the reader takes the row from ``head_outputs``."""
        return None

    def recomputed_head_outputs(self, layer: int) -> torch.Tensor | None:
        """(H, head_output_start, d): the rows before ``head_output_start`` from the model run again,
        or None where the source cannot (its ``live`` refuses "recompute")."""
        return None


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """An owned float32 copy (views of live records change at the next step)."""
    return t.detach().to(torch.float32).numpy().copy()


class RunSource(ViewTiles):
    """The shared reader over a run's primitives (see the module docstring); ``ViewTiles``: view-sized reads."""

    records: RunRecords
    read_only: bool = True
    unverified: str | None = None  # why the model's fidelity self-test failed (loaded with --unverified), or None
    lm: LoadedModel | None = None  # the loaded model the run ran on, or None (a trace file)
    # the KV cache policy this run's forwards ran under (core.kvlab's, or a trace's stored one), or None
    kv_policy: Any = None
    head_edits: Sequence = ()  # knock-outs and patches (core.edits.HeadEdit) the run's forwards ran under

    if TYPE_CHECKING:  # the primitives each source implements (module docstring), typed for the reader

        @property
        def n_layers(self) -> int: ...
        @property
        def n_heads(self) -> int: ...
        @property
        def n_kv_heads(self) -> int: ...
        @property
        def head_dim(self) -> int: ...
        @property
        def model_name(self) -> str: ...
        @property
        def kv_itemsize(self) -> int: ...
        @property
        def cache_length(self) -> int: ...
        @property
        def tokens(self) -> list[int]: ...
        @property
        def prompt_ids(self) -> list[int]: ...
        @property
        def steps_done(self) -> list[Step]: ...

        prompt: str
        decoding: Decoding
        seed: int | None

        @property
        def mask_edits(self) -> list[MaskEdit]: ...
        @property
        def text(self) -> str: ...
        @property
        def cache_dtype(self) -> str: ...
        @property
        def finished(self) -> str | None: ...
        def label(self, token_id: int) -> str: ...

    @property
    def live(self) -> Live:
        """What can be executed on this source; a source without a model runs nothing."""
        return Live.nothing("it has no model; load the model and re-run the prompt")

    @property
    def head_output_start(self) -> int:
        """The first position whose head output the source keeps (see ``RunRecords``)."""
        return self.records.head_output_start

    @property
    def source_name(self) -> str:
        """What a window title calls this run."""
        return self.model_name

    # ------------------------------------------------------------------ shapes and tokens
    @property
    def n_steps(self) -> int:
        return len(self.steps_done)

    @property
    def current(self):
        steps = self.steps_done
        return steps[-1] if steps else None

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_ids)

    @property
    def processed_tokens(self) -> list[int]:
        """Tokens whose K/V are in the cache (all but the last chosen one)."""
        return list(self.tokens[: self.cache_length])

    def token_labels(self, ids=None) -> list[str]:
        return [self.label(int(i)) for i in (self.tokens if ids is None else ids)]

    def save_trace(self, path, derived: bool = False):
        """Write the run to a trace file (see docs/trace-format.md); ``derived`` adds the matrices."""
        from .trace import save_trace

        return save_trace(self, path, derived=derived)

    def kv_head_of(self, head: int, layer: int | None = None) -> int:
        """The KV head query head ``head`` reads in ``layer`` (Gemma 4's full-attention layers have fewer)."""
        lay = self.kv_layout
        lk = None if layer is None or lay is None else lay.layers[layer]
        return eq.kv_head_of(head, self.n_heads, self.n_kv_heads if lk is None else lk.keys[0])

    def check_layer(self, layer) -> int:
        return check_index(layer, self.n_layers, "layer")

    def check_attention_layer(self, layer) -> int:
        """``layer`` checked, and refused in one line where it has no attention (a hybrid's state-space layer)."""
        layer = self.check_layer(layer)
        lay = self.kv_layout
        if lay is not None and lay.layers[layer] is None:
            raise InspectorError(
                f"layer {layer} has no attention (state-space); the attention layers are {list(lay.attention_layers)}"
            )
        return layer

    def check_head(self, head) -> int:
        return check_index(head, self.n_heads, "head")

    def require_positions(self) -> int:
        t = self.cache_length
        if t == 0:
            raise InspectorError("nothing processed yet: run a step first")
        return t

    def _checked(self, layer) -> tuple[int, int]:
        """(``layer`` checked as an attention layer, the processed positions: refused while there are none)."""
        return self.check_attention_layer(layer), self.require_positions()

    # ------------------------------------------------------------------ primitives, checked
    # zero-copy views for fast front ends: read them on the thread that changes the source, until its next change
    def queries(self, layer: int) -> torch.Tensor:
        """q of every processed position as attention received it, (H, T, d)."""
        return self.records.queries(self._checked(layer)[0])

    def keys(self, layer: int) -> torch.Tensor:
        """The cached keys, (H_kv, T, d)."""
        return self.records.keys(self._checked(layer)[0])

    def values(self, layer: int) -> torch.Tensor:
        """The cached values, (H_kv, T, d)."""
        return self.records.values(self._checked(layer)[0])

    def head_outputs(self, layer: int) -> torch.Tensor:
        """The attention output per head, (H, T, d), before the output projection.

        Rows before ``head_output_start`` were not kept: where ``live`` allows "recompute" (a live
        session) the model recomputes them (one forward of the prompt, on the first call after a
        change); elsewhere they are NaN, never a made-up number.
        """
        layer, t = self._checked(layer)
        kept = self.records.head_outputs(layer)  # (H, T - start, d)
        start = self.head_output_start
        if start == 0:
            return kept
        full = torch.full((kept.shape[0], t, kept.shape[2]), float("nan"), dtype=kept.dtype)  # (H, T, d)
        full[:, start:] = kept
        if self.live.can("recompute"):
            rows = self.records.recomputed_head_outputs(layer)  # (H, start, d)
            assert rows is not None  # a source whose live allows "recompute" recomputes them
            full[:, :start] = rows
        return full

    @property
    def head_outputs_from(self) -> int:
        """The first position whose head output ``head_outputs`` can give (recomputed or kept)."""
        return 0 if self.live.can("recompute") else self.head_output_start

    def cached_rows(self, layer: int) -> torch.Tensor | None:
        """(T, n) the model's own cache rows for ``layer`` where they are not the per-head K and V
        (multi-head latent attention's compressed latent, untiled heads), else None."""
        return None

    def head_output_row(self, layer: int, position: int) -> torch.Tensor:
        """(H, d) the head outputs of one position (NaN where the source cannot give them)."""
        layer, t = self._checked(layer)
        if not 0 <= position < t:
            raise InspectorError(f"position must lie in [0, {t}), got {position}")
        start = self.head_output_start
        if position < start:
            return self.head_outputs(layer)[:, position]
        row = self.records.head_output_row(layer, position)  # (H, d) or None
        return self.records.head_outputs(layer)[:, position - start] if row is None else row

    def kept_head_outputs(self, layer: int) -> tuple[int, torch.Tensor]:
        """(start, (H, T - start, d)): the head outputs the source holds, from position ``start`` on."""
        return self.head_output_start, self.records.head_outputs(self._checked(layer)[0])

    def mask_rows(self, layer: int) -> dict[int, torch.Tensor]:
        """position -> (T,) or (H, T) bool: the model's own mask where a row is not plain causal."""
        return self.records.mask_rows(self.check_attention_layer(layer))

    def scaling(self, layer: int) -> float:
        return float(self.records.scaling(self.check_attention_layer(layer)))

    def softcap(self, layer: int) -> float | None:
        """The layer's attention-logit soft-cap (tanh(x / cap) * cap), or None."""
        cap = self.records.softcap(self.check_layer(layer))
        return None if cap is None else float(cap)

    def sink(self, layer: int) -> torch.Tensor | None:
        """The layer's attention-sink logit per head, (H,), or None (most models have no sink).

        A sink takes a share of each softmax row and contributes no value, so that row's
        probabilities sum to 1 - sink mass.
        """
        return self.records.sink(self.check_layer(layer))

    def score_bias(self, layer: int) -> eq.ScoreBias | None:
        """The additive bias the model put on this layer's scores (ALiBi, doge's dynamic mask), or None.

        Compact (slopes and reference positions, or one value per head and key); ``bias_rows``
        gives it as matrix rows. The "scores" stage already includes it.
        """
        return self.records.score_bias(self.check_layer(layer))

    def bias_rows(self, layer: int, p0: int, p1: int, heads=None) -> torch.Tensor | None:
        """Query rows p0..p1 of the model's additive score bias, (h, n, T) float32, or None if it adds none."""
        bias = self.score_bias(layer)
        if bias is None:
            return None
        t = self._key_span(p0, p1, None)  # the query rows checked
        idx = None if heads is None else torch.as_tensor([self.check_head(h) for h in heads], dtype=torch.long)
        return bias.block(p0, p1, t, idx)

    def allowed_rows(self, layer: int, p0: int, p1: int, keys: int | None = None) -> torch.Tensor:
        """(H, p1 - p0, T) bool: the keys query rows p0..p1 could attend to, for every head.

        Causal, then the model's own mask (sliding windows, ...), then the mask edits in force.
        ``keys``: only the first ``keys`` key positions, (H, n, keys) (see ``attention_rows``).
        """
        layer = self.check_attention_layer(layer)
        t = self._key_span(p0, p1, keys)
        allowed = allowed_rows(self.records.mask_rows(layer), t, p0, p1, self.records.edits, layer, None, self.n_heads)
        evicted = self._kv_evicted(layer, p0, p1, t)  # (H, n, T) or None
        return allowed if evicted is None else allowed & ~evicted

    def plain_causal(self, layer: int, p0: int, p1: int) -> bool:
        """Whether query rows p0..p1 of ``layer`` see exactly the keys up to themselves, at every
        head: no mask row of the model's own (sliding windows, padding), no edit, no cache policy."""
        if self.kv_policy is not None or any(p0 <= p < p1 for p in self.records.mask_rows(layer)):
            return False
        edits = self.records.edits
        if edits is not None and layer in edits.heads:
            rows = edits.rows[layer]
            return not bool(((rows >= p0) & (rows < p1)).any())
        return True

    def _allowed_from(self, layer: int, p0: int, p1: int, t: int) -> tuple[torch.Tensor, int]:
        """(allowed (H, n, t - c), c): ``allowed_rows`` from key column c on; every key before c is
        allowed to every row and head. Plain causal rows (no mask row of the model's own, no edit,
        no cache policy) have c = p0 + 1, so the equation masks n x n cells instead of n x t."""
        if self.plain_causal(layer, p0, p1):
            c = min(p0 + 1, t)
            pos = torch.arange(p0, p1)  # (n,)
            tail = torch.arange(c, t)[None, :] <= pos[:, None]  # (n, t - c) causal
            return tail.expand(self.n_heads, -1, -1), c
        return self.allowed_rows(layer, p0, p1, t), 0

    def _kv_evicted(self, layer: int, p0: int, p1: int, t: int) -> torch.Tensor | None:
        """(H, p1 - p0, T) bool: entries a KV cache policy (core.kvlab) had evicted when those rows ran."""
        policy = self.kv_policy
        return None if policy is None else policy.evicted_rows(layer, p0, p1, t, self.n_heads)

    # ------------------------------------------------------------------ derived, one equation
    def _key_span(self, p0: int, p1: int, keys: int | None) -> int:
        t = self.require_positions()
        if not 0 <= p0 <= p1 <= t:
            raise InspectorError(f"query rows must lie in [0, {t}], got {p0}..{p1}")
        if keys is None:
            return t
        if not p1 <= keys <= t:
            raise InspectorError(f"keys must lie in [{p1}, {t}] for query rows {p0}..{p1}, got {keys}")
        return keys

    def attention_rows(self, layer: int, p0: int, p1: int, kind: str = "probs", heads=None,
                       keys: int | None = None, work: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Query rows p0..p1 of ``kind`` for ``heads`` (default every head): (h, n, T) float32.

        One batched evaluation of the equation; the caller owns the result. ``keys`` (at least
        ``p1``) limits the key positions to the first ``keys``: (h, n, keys). Query rows never
        attend past themselves, so ``keys=p1`` drops only cells that are masked at every stage
        from ``masked_scores`` on, and halves the work of a pass over all rows. ``work``: a flat
        float32 buffer of at least h * n * keys numbers the rows may be computed in (the result
        is then a view of it, valid until the caller reuses it), for streams of row chunks.
        """
        eq.check_kind(kind)
        kt = self._key_span(p0, p1, keys)
        layer = self.check_attention_layer(layer)
        allowed, c = self._allowed_from(layer, p0, p1, kt)  # (H, n, kt - c): keys before c all allowed
        q = self.records.queries(layer)[:, p0:p1]  # (H, n, d)

        def buffer(*shape):  # the caller's buffer as the result's shape, or None (a new tensor)
            return None if work is None else work[: math.prod(shape)].view(*shape)

        k_all = self.records.keys(layer)[:, :kt]  # (Hkv, kt, d)
        sink = self.sink(layer)  # (H,) or None
        bias = self.score_bias(layer)
        scaling, softcap = self.scaling(layer), self.softcap(layer)
        if heads is not None:
            idx = torch.as_tensor([self.check_head(h) for h in heads], dtype=torch.long)
            kv = torch.as_tensor([self.kv_head_of(int(h), layer) for h in idx], dtype=torch.long)
            if len(idx) == 1:  # views, not copies: indexing with a tensor copied T x d keys per call
                h0, kv0 = int(idx[0]), int(kv[0])
                q, k, allowed = q[h0 : h0 + 1], k_all[kv0 : kv0 + 1], allowed[h0 : h0 + 1]
            else:
                q, k, allowed = q[idx], k_all[kv], allowed[idx]
            sink = None if sink is None else sink[idx]
            block = None if bias is None or kind == "raw" else bias.block(p0, p1, k.shape[-2], idx)  # (h, n, T)
            out = buffer(len(idx), p1 - p0, kt)  # (h, n, T) or None
            return eq.equation(q, k, scaling, softcap, allowed, kind, sink, block, masked_from=c, out=out)
        block = None if bias is None or kind == "raw" else bias.block(p0, p1, k_all.shape[-2], None)  # (H, n, T)
        if sink is not None:  # one sink logit per head: the equation takes it per leading index
            k = eq.expand_kv(k_all, self.n_heads)  # (H, T, d)
            return eq.equation(q, k, scaling, softcap, allowed, kind, sink, block, masked_from=c)
        # every head: each KV head's group of query heads in one product, so the keys are read
        # once per KV head instead of copied to every query head (at long T that copy dominated)
        hkv, (h, n, d) = k_all.shape[0], q.shape
        qg = q.reshape(hkv, (h // hkv) * n, d)  # (Hkv, g*n, d): query heads h*g .. h*g+g-1 read KV head h
        grouped = allowed.reshape(hkv, (h // hkv) * n, -1)  # (Hkv, g*n, T - c)
        gblock = None if block is None else block.expand(h, n, -1).reshape(hkv, (h // hkv) * n, -1)  # (Hkv, g*n, T)
        out = buffer(hkv, (h // hkv) * n, kt)  # (Hkv, g*n, T) or None
        out = eq.equation(qg, k_all, scaling, softcap, grouped, kind, None, gblock, masked_from=c, out=out)
        return out.reshape(h, n, -1)  # (H, n, T)

    def attention(self, layer: int, head: int, kind: str = "probs") -> np.ndarray:
        """(T, T) float32 over all processed positions; kind: raw, scores, masked_scores or probs."""
        layer, head = self.check_attention_layer(layer), self.check_head(head)
        eq.check_kind(kind)
        t = self.require_positions()
        return self.attention_rows(layer, 0, t, kind, heads=(head,))[0].numpy()

    def allowed(self, layer: int, head: int) -> np.ndarray:
        """(T, T) bool: keys each query could attend to (the model's own mask and the edits in force)."""
        layer, head = self.check_attention_layer(layer), self.check_head(head)
        t = self.require_positions()
        records = self.records
        allowed = allowed_rows(records.mask_rows(layer), t, 0, t, records.edits, layer, head, self.n_heads)  # (T, T)
        evicted = self._kv_evicted(layer, 0, t, t)  # (H, T, T) or None: only while a cache policy is attached
        return (allowed if evicted is None else allowed & ~evicted[head]).numpy()

    def qkv(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q (H, T, d), k (H_kv, T, d), v (H_kv, T, d) as owned float32 numpy arrays."""
        return to_numpy(self.queries(layer)), to_numpy(self.keys(layer)), to_numpy(self.values(layer))

    def attention_output(self, layer: int) -> np.ndarray:
        """The attention output the model computed, per head: (H, T, d) float32, before the output projection."""
        return to_numpy(self.head_outputs(layer))

    kv_layout: KVLayout | None = None  # what the cache holds per layer (core.kv_layout.KVLayout); None: per-head

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Layers with attention; the others (hybrids' state-space layers) have no K, V or matrices."""
        lay = self.kv_layout
        return tuple(range(self.n_layers)) if lay is None else lay.attention_layers

    def cache_layer_of(self, layer: int) -> int | None:
        """The layer whose cache holds the K/V ``layer`` reads: itself, a shared layer's, or None
        where the cache holds something else (a latent, untiled heads) or the layer has no attention."""
        layer, lay = self.check_layer(layer), self.kv_layout
        if lay is None:
            return layer
        return None if (lk := lay.layers[layer]) is None else lk.reads

    def _kv_length(self, length: int | None) -> int:
        t = self.cache_length
        if length is None:
            return t
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= t:
            raise InspectorError(f"length must be a whole number in [0, {t}], got {length!r}")
        return length

    def _kv_layers(self, layer: int | None) -> range | list[int]:
        return range(self.n_layers) if layer is None else [self.check_layer(layer)]

    def kv_cache_positions(self, layer: int, length: int | None = None) -> int:
        """Positions the model's own cache holds for ``layer`` after ``length`` positions (default: all
        processed): every one, or on a sliding-window or chunked layer the newest its window keeps
        (``LayerKV.keeps``). A layer that reads another layer's cache (KV sharing) is given that layer's."""
        layer, t = self.check_layer(layer), self._kv_length(length)
        lay = self.kv_layout
        lk = None if lay is None else lay.layers[layer]
        if lay is None or lk is None:
            return t
        if lk.reads is not None and lk.reads != layer:
            lk = lay.layers[lk.reads] or lk
        return lk.held(t)

    def kv_cache_bytes(self, layer: int | None = None, length: int | None = None) -> int:
        """Bytes the model's own KV cache would hold at this point (one layer, or all; ``length``: after
        that many positions instead of now), the cache ``generate`` builds: sliding-window and chunked
        layers hold only their window, a latent (MLA) its latent rows, a KV-sharing layer nothing of its
        own. The session keeps more, every position (``kv_kept_bytes``)."""
        t, layers = self._kv_length(length), self._kv_layers(layer)
        if t == 0:
            return 0
        policy = self.kv_policy
        if policy is not None:  # a KV cache lab run: what the policy's cache would hold, not the simulation's
            return sum(policy.cache_bytes(i, t) for i in layers)
        lay = self.kv_layout
        if lay is None:  # an ordinary per-head cache of unknown windows (a trace written without a layout)
            return sum(2 * self.n_kv_heads * t * self.head_dim for _ in layers) * self.kv_itemsize
        held = (lk.cache_numbers * lk.held(t) for i in layers if (lk := lay.layers[i]) is not None)
        return sum(held) * self.kv_itemsize

    def kv_kept_bytes(self, layer: int | None = None, length: int | None = None) -> int:
        """Bytes of the cache the inspector keeps (one layer, or all): the model's own cache rows at
        every position, sliding-window layers included, so every position stays inspectable. More
        than ``kv_cache_bytes`` where the model's cache holds only a window (or under a cache policy)."""
        t, layers = self._kv_length(length), self._kv_layers(layer)
        lay = self.kv_layout
        if lay is None:
            return sum(2 * self.n_kv_heads * t * self.head_dim for _ in layers) * self.kv_itemsize
        return sum(lk.cache_numbers for i in layers if (lk := lay.layers[i]) is not None) * t * self.kv_itemsize

    def kv_per_head_bytes(self, layer: int | None = None) -> int:
        """Bytes an ordinary per-head cache of the K and V attention received would take (one layer,
        or all), over the positions the model's cache holds: equal to ``kv_cache_bytes`` for most
        models, more for a latent cache."""
        t, lay = self.cache_length, self.kv_layout
        if lay is None or t == 0:
            return self.kv_cache_bytes(layer)  # the cache is an ordinary per-head one, or empty
        layers = self._kv_layers(layer)
        held = (lk.attention_numbers * self.kv_cache_positions(i) for i in layers if (lk := lay.layers[i]) is not None)
        return sum(held) * self.kv_itemsize


def _from_lm(name: str, *default) -> Any:
    """``self.lm.<name>`` as a property (``default`` where a model may lack it); Any: each use annotates it."""
    return property(lambda self: getattr(self.lm, name, *default))


def model_refusals(lm) -> dict[str, str]:
    """What the model itself rules out on any source it ran: the cache probe replays per-head K/V
    of every layer, which some caches do not hold."""
    lay = lm.kv_layout  # what the cache holds (core.kv_layout), or None: per-head K/V
    if lay is None or not (lay.state_layers or lay.mirrored or lay.kind == "shared"):
        return {}
    if lay.state_layers:
        held = "state-space layers keep a running state"
    elif lay.kind == "shared":  # and a replay through its layers is not the model's (gemma3n's AltUp streams)
        held = "later layers read earlier layers' caches (KV sharing)"
    else:
        held = f"the cache holds a {lay.kind} form"
    return {"probe": f"the cache probe replays per-head K/V of every layer; in {lm.name} {held}, not those"}


class ModelShape:
    """Shapes of a source that has the loaded model (``self.lm``): a Session, a beam."""

    lm: LoadedModel  # set by the subclass's __init__
    tokens: list[int]
    prompt_ids: list[int]
    n_layers: int = _from_lm("n_layers")
    n_heads: int = _from_lm("n_heads")
    n_kv_heads: int = _from_lm("n_kv_heads")
    head_dim: int = _from_lm("head_dim")
    context_length: int = _from_lm("context_length")
    vocab_size: int = _from_lm("vocab_size")
    model_name: str = _from_lm("name")
    unverified: str | None = _from_lm("unverified", None)
    kv_layout: KVLayout | None = _from_lm("kv_layout", None)

    @property
    def cache_dtype(self) -> str:
        return str(self.lm.dtype).removeprefix("torch.")

    @property
    def kv_itemsize(self) -> int:
        return torch.empty((), dtype=self.lm.dtype).element_size()

    @property
    def text(self) -> str:
        return self.lm.tokenizer.decode(self.tokens)

    @property
    def generated_text(self) -> str:
        return self.lm.tokenizer.decode(self.tokens[len(self.prompt_ids) :])

    def label(self, token_id: int) -> str:
        from .tokens import token_label

        return token_label(self.lm.tokenizer, token_id)
