"""Cache privacy probe: read the prompt back out of a KV cache, given nothing but the cache.

Layer-0 keys and values are a deterministic function of one token and its position (embedding,
position handling, first layer norm, K/V projection, RoPE). So for every cached position we ask
the model what key and value *each* vocabulary token would produce there and pick the nearest:
the true token matches exactly, up to float noise.

We never re-implement a model's input path. Candidates run through the model itself and our
attention function hands us the key/value of the layer we want; a sentinel exception then stops
the forward, so the rest of the network is never computed. That keeps the probe model-agnostic
(learned positions, RoPE, partial rotary, qkv bias, GQA all come for free).

Deeper layers depend on the prefix. Two ways to supply it:
- ``cache``: the probed cache itself holds the K/V of layers 0..l at earlier positions, which is
  all a candidate at position p needs to reach layer l; exact, no recovered tokens involved.
- ``greedy``: only layer l is known; recover left to right, feeding the tokens recovered so far
  as the prefix (an attacker who holds a single deep layer).
Both cost one pass over the vocabulary per position, so they are opt-in.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from . import hf
from .errors import InspectorError, check_index
from .models import LoadedModel
from .probe_direct import (
    Best,
    distance,
    layer0_at,
    position_map,
    run_to_layer,
    search_reference,
    search_shared,
    shared_forwards,  # fmt: skip
)
from .source import RunSource
from .tokens import token_label
from .validate import json_number

CONTEXTS = ("auto", "cache", "greedy")

# rows (candidate x position) per forward; bounds activation memory of the truncated pass
_ROWS = 8192
# bytes the per-chunk prefix cache may take in deeper-layer probes
_PREFIX_BYTES = 256 * 1024 * 1024


# ---------------------------------------------------------------------- results


@dataclass
class PositionProbe:
    """The verdict for one cached position."""

    position: int
    token_id: int  # the nearest candidate
    label: str
    distance: float  # relative L2 distance between cached K‖V and the candidate's K‖V
    runner_up_id: int
    runner_up_label: str
    runner_up_distance: float
    tolerance: float
    true_token_id: int | None = None
    true_label: str | None = None

    @property
    def margin(self) -> float:
        """How far the runner-up is behind the winner; 0 means two tokens are indistinguishable."""
        return self.runner_up_distance - self.distance

    @property
    def exact(self) -> bool:
        """The winner reproduces the cached K/V within float tolerance."""
        return self.distance <= self.tolerance

    @property
    def correct(self) -> bool | None:
        return None if self.true_token_id is None else self.token_id == self.true_token_id

    @property
    def recovered(self) -> bool:
        # with the truth at hand we judge by it; without, an exact match is the attacker's evidence
        c = self.correct
        return self.exact if c is None else c

    def to_json(self) -> dict:
        out = {
            k: getattr(self, k)
            for k in (
                "position",
                "token_id",
                "label",
                "distance",
                "margin",
                "runner_up_id",
                "runner_up_label",
                "exact",
                "true_token_id",
                "true_label",
                "correct",
                "recovered",
            )
        }
        out["margin"] = json_number(self.margin)  # inf without a runner-up: JSON has none
        return out


@dataclass
class LayerProbe:
    layer: int
    method: str  # direct (layer 0), cache or greedy
    positions: list[PositionProbe]
    tolerance: float
    seconds: float = 0.0
    text: str = ""  # the recovered tokens, decoded

    @property
    def n_positions(self) -> int:
        return len(self.positions)

    @property
    def n_recovered(self) -> int:
        return sum(p.recovered for p in self.positions)

    @property
    def n_exact(self) -> int:
        return sum(p.exact for p in self.positions)

    @property
    def tokens(self) -> list[int]:
        return [p.token_id for p in self.positions]

    def summary(self) -> str:
        judged = "correct" if self.positions and self.positions[0].true_token_id is not None else "exact"
        return (
            f"layer {self.layer} ({self.method}): recovered {self.n_recovered}/{self.n_positions} positions "
            f"({judged}; {self.n_exact} exact matches within {self.tolerance:g})"
        )

    def to_json(self) -> dict:
        return {
            "layer": self.layer,
            "method": self.method,
            "tolerance": self.tolerance,
            "recovered": self.n_recovered,
            "exact": self.n_exact,
            "total": self.n_positions,
            "seconds": self.seconds,
            "text": self.text,
            "positions": [p.to_json() for p in self.positions],
        }


@dataclass
class ProbeResult:
    model_name: str
    vocab_size: int
    n_positions: int
    layers: list[LayerProbe]
    true_tokens: list[int] | None = None

    @property
    def texts(self) -> dict[int, str]:
        """layer -> the recovered tokens, decoded."""
        return {lp.layer: lp.text for lp in self.layers}

    def layer(self, layer: int) -> LayerProbe:
        for lp in self.layers:
            if lp.layer == layer:
                return lp
        raise InspectorError(f"layer {layer} was not probed; probed: {', '.join(str(x.layer) for x in self.layers)}")

    @property
    def n_recovered(self) -> int:
        """Recovered positions in the first probed layer (layer 0 when probed)."""
        return self.layers[0].n_recovered if self.layers else 0

    @property
    def all_recovered(self) -> bool:
        return all(lp.n_recovered == lp.n_positions for lp in self.layers)

    def summary(self) -> str:
        return "; ".join(lp.summary() for lp in self.layers)

    def to_json(self) -> dict:
        return {
            "model": self.model_name,
            "vocab_size": self.vocab_size,
            "positions": self.n_positions,
            "true_tokens": self.true_tokens,
            "layers": [lp.to_json() for lp in self.layers],
        }


def default_tolerance(dtype: torch.dtype) -> float:
    """Relative distance below which a candidate counts as reproducing the cache exactly."""
    # fp32 batched-vs-single matmuls differ ~1e-7 relative; half types round each element ~1e-3
    return 1e-4 if dtype == torch.float32 else 3e-2


# ---------------------------------------------------------------------- input handling


def _as_tensor(x, what: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        t = x.detach()
    elif isinstance(x, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(x))
    else:
        raise InspectorError(f"{what} must be a numpy array or torch tensor, got {type(x).__name__}")
    if t.ndim == 4:
        if t.shape[0] != 1:
            raise InspectorError(f"{what} has batch size {t.shape[0]}; probe one sequence (batch 1) at a time")
        t = t[0]
    if t.ndim != 3:
        raise InspectorError(f"{what} must be (kv_heads, positions, head_dim), got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise InspectorError(f"{what} must hold floats, got {t.dtype}")
    return t


def _normalize(lm: LoadedModel, kv) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Accept a DynamicCache, ``{layer: (K, V)}`` or a per-layer sequence of (K, V) / None."""
    if hasattr(kv, "layers") and not isinstance(kv, (Mapping, Sequence)):
        pairs = {
            i: (cl.keys, cl.values)
            for i, cl in enumerate(kv.layers)
            if getattr(cl, "is_initialized", True) and getattr(cl, "keys", None) is not None and cl.keys.numel()
        }
    elif isinstance(kv, Mapping):
        pairs = dict(kv)
    elif isinstance(kv, Sequence) and not isinstance(kv, (str, bytes)):
        pairs = {i: p for i, p in enumerate(kv) if p is not None}
    else:
        raise InspectorError("keys_values_per_layer must be a cache, a {layer: (K, V)} mapping or a list of (K, V)")
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    length = None
    for layer, pair in pairs.items():
        check_index(layer, lm.n_layers, "cache layer")
        try:
            k, v = pair
        except (TypeError, ValueError):
            raise InspectorError(f"layer {layer}: expected a (keys, values) pair") from None
        k, v = _as_tensor(k, f"layer {layer} keys"), _as_tensor(v, f"layer {layer} values")
        # the layer's own K/V shape: Gemma 4's full-attention layers have their own head size and KV heads
        lk = None if lm.kv_layout is None else lm.kv_layout.layers[layer]
        want = (lm.n_kv_heads, lm.head_dim) if lk is None else lk.keys
        if (k.shape[0], k.shape[2]) != want or k.shape != v.shape:
            raise InspectorError(
                f"layer {layer}: keys {tuple(k.shape)} / values {tuple(v.shape)} do not fit this model "
                f"({want[0]} KV heads of size {want[1]})"
            )
        if length is None:
            length = k.shape[1]
        elif k.shape[1] != length:
            raise InspectorError(f"layer {layer} holds {k.shape[1]} positions, other layers {length}")
        out[int(layer)] = (k, v)
    if not out or not length:
        raise InspectorError("the cache is empty: nothing to probe")
    if length > lm.context_length:
        raise InspectorError(f"the cache holds {length} positions, more than the model's context {lm.context_length}")
    return out


def _parse_layers(layers, lm: LoadedModel, have: dict) -> list[int]:
    if isinstance(layers, (int, np.integer)) and not isinstance(layers, bool):
        layers = [layers]
    out = []
    for layer in layers:
        check_index(layer, lm.n_layers, "probe layer")
        if int(layer) not in have:
            raise InspectorError(f"layer {layer} is not in the given cache; it holds layers {sorted(have)}")
        if int(layer) not in out:
            out.append(int(layer))
    if not out:
        raise InspectorError("no layers to probe")
    return out


# ---------------------------------------------------------------------- probing


def probe_cache(
    lm: LoadedModel,
    keys_values_per_layer,
    layers: Iterable[int] | int = (0,),
    *,
    context: str = "auto",
    true_tokens: Sequence[int] | None = None,
    tolerance: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    _edits=None,  # the session's compiled mask edits (probe_session); not part of the public API
) -> ProbeResult:
    """Reconstruct the token at every cached position from cached K/V alone.

    ``keys_values_per_layer``: a DynamicCache, ``{layer: (K, V)}`` or a list indexed by layer, with
    K and V shaped (Hkv, T, d) or (1, Hkv, T, d). ``layers``: which layers to attack; layer 0 is
    direct and cheap, deeper layers cost one vocabulary pass per position (see module doc).
    ``context`` (deeper layers): ``cache`` uses the given lower layers as the prefix, ``greedy``
    the tokens recovered so far, ``auto`` picks ``cache`` when every lower layer was given.
    ``true_tokens`` are only used to score the result, never to recover. ``progress(done, total)``
    is called after each forward; raising from it aborts the probe.
    """
    if context not in CONTEXTS:
        raise InspectorError(f"unknown context {context!r}; use {', '.join(CONTEXTS)}")
    have = _normalize(lm, keys_values_per_layer)
    todo = _parse_layers(layers, lm, have)
    n = next(iter(have.values()))[0].shape[1]
    truth = None
    if true_tokens is not None:
        truth = [int(t) for t in list(true_tokens)[:n]]
        if len(truth) != n:
            raise InspectorError(f"{len(truth)} true tokens for {n} cached positions")
    tol = default_tolerance(lm.dtype) if tolerance is None else float(tolerance)
    if not tol > 0:
        raise InspectorError(f"tolerance must be positive, got {tolerance!r}")
    methods = {layer: _method(layer, context, have) for layer in todo}
    # layer 0: whether the model's positions let one vocabulary pass serve every position (probe_direct)
    pm = position_map(lm, n, have[0][0].shape[-1]) if "direct" in methods.values() else None
    total = max(1, sum(_n_forwards(lm, layer, n, m, pm is not None) for layer, m in methods.items()))
    done = itertools.count(1)
    tick = (lambda: None) if progress is None else (lambda: progress(min(next(done), total), total))
    result = ProbeResult(lm.name, lm.vocab_size, n, [], truth)
    for layer in todo:
        t0 = time.perf_counter()
        method = methods[layer]
        k, v = have[layer]
        target = torch.cat([k.permute(1, 0, 2).reshape(n, -1), v.permute(1, 0, 2).reshape(n, -1)], 1)  # (T, 2*Hkv*d)
        target = target.to(lm.device, torch.float32)
        if method == "direct":
            best = _probe_direct(lm, pm, target, n, tick)
        else:
            best = _probe_prefixed(lm, layer, have, target, n, method, tick, _edits)
        verdicts = _verdicts(lm, best, tol, truth)
        text = lm.tokenizer.decode([p.token_id for p in verdicts])
        result.layers.append(LayerProbe(layer, method, verdicts, tol, time.perf_counter() - t0, text))
    return result


def probe_session(session: RunSource, layers: Iterable[int] | int = (0,), **kwargs) -> ProbeResult:
    """Probe a run's KV cache (a live session's, or a beam's as it ran) and score the recovery against the
    tokens it processed."""
    t = session.cache_length
    if t == 0:
        raise InspectorError("nothing cached yet: run a step first")
    if getattr(session, "engine", None) is not None:  # a remote engine's session: it runs this code beside the model
        return session.remote_probe(layers, **kwargs)  # type: ignore[attr-defined]
    session.live.require("probe")  # the probe replays candidates through the run's model
    assert session.lm is not None  # a source whose live allows the probe has its model
    # the K/V every reader of the run sees: a session's are its cache's, a beam's the rows recorded on its path
    kv = {i: (session.keys(i)[:, :t], session.values(i)[:, :t]) for i in range(session.n_layers)}  # (Hkv, T, d) each
    # deeper layers saw the session's mask edits when the cache was filled; so must the candidates
    return probe_cache(session.lm, kv, layers, true_tokens=session.processed_tokens, _edits=session.records.edits,
                       **kwargs)  # fmt: skip


def _method(layer: int, context: str, have: dict) -> str:
    if layer == 0:
        return "direct"
    lower = all(i in have for i in range(layer))
    if context == "cache" and not lower:
        missing = [i for i in range(layer) if i not in have]
        raise InspectorError(f"context 'cache' for layer {layer} needs layers {missing} in the cache; use greedy")
    if context == "greedy" or (context == "auto" and not lower):
        return "greedy"
    return "cache"


def _vocab_chunk(lm: LoadedModel) -> int:
    return max(1, min(lm.vocab_size, _ROWS))


def _prefix_chunk(lm: LoadedModel, layer: int, prefix: int) -> int:
    per_row = 2 * (layer + 1) * lm.n_kv_heads * (prefix + 1) * lm.head_dim * 4
    return max(1, min(_vocab_chunk(lm), _PREFIX_BYTES // max(per_row, 1)))


def _n_forwards(lm: LoadedModel, layer: int, n: int, method: str, shared: bool) -> int:
    v = lm.vocab_size
    if method == "direct" and shared:
        return shared_forwards(lm, n, _vocab_chunk(lm))
    if method == "direct":
        c = _vocab_chunk(lm)
        per_pass = max(1, _ROWS // c)
        return math.ceil(v / c) * math.ceil(n / per_pass)
    return sum(math.ceil(v / _prefix_chunk(lm, layer, p)) for p in range(n))


def _probe_direct(lm: LoadedModel, pm, target: torch.Tensor, n: int, tick: Callable[[], None]) -> Best:
    """Layer 0: the shared search where the model's positions allow it, else the reference (probe_direct)."""
    c = _vocab_chunk(lm)

    def one_position(p: int) -> torch.Tensor:
        cand = torch.arange(lm.vocab_size, device=lm.device)  # (V,)
        return torch.cat([distance(layer0_at(lm, cand[c0 : c0 + c], p)[None], target[p][None, None])[0]
                          for c0 in range(0, lm.vocab_size, c)])  # fmt: skip

    if pm is None:
        return search_reference(lm, target, n, _ROWS, tick)
    return search_shared(lm, pm, target, n, c, tick, one_position)


def _probe_prefixed(lm: LoadedModel, layer: int, have: dict, target: torch.Tensor, n: int, method: str,
                    tick: Callable[[], None], edits) -> Best:  # fmt: skip
    """Layer > 0, one position at a time, with a prefix from the cache or from recovered tokens."""
    best = Best(n)
    cfg: Any = lm.model.config  # the model's PretrainedConfig (nn.Module types attributes Tensor | Module)
    running = hf.DynamicCache(config=cfg)  # greedy: the recovered prefix, grown one token at a time
    for p in range(n):
        if method == "cache":
            prefix = [
                (have[i][0][None, :, :p].to(lm.device, lm.dtype), have[i][1][None, :, :p].to(lm.device, lm.dtype))
                for i in range(layer + 1)
            ]  # per layer (1, Hkv, p, d)
        else:
            if p > 0:  # extend the running prefix by the token recovered at p - 1
                tok = torch.tensor([[int(best.i[p - 1, 0])]], device=lm.device)
                run_to_layer(lm, layer, tok, running, edits=edits)
            # every layer of the probe's own cache holds K/V: models with layers that keep something
            # else (state-space, KV sharing) are refused before a probe (model_refusals)
            held = cast("list[hf.DynamicLayer]", running.layers)
            prefix = [(held[i].keys, held[i].values) for i in range(layer + 1)] if p else []
        c = _prefix_chunk(lm, layer, p)
        row = torch.tensor([p])
        for c0 in range(0, lm.vocab_size, c):
            cand = torch.arange(c0, min(lm.vocab_size, c0 + c), device=lm.device)  # (C,)
            cache = hf.DynamicCache(config=cfg)
            for i, (pk, pv) in enumerate(prefix):
                cache.update(pk.expand(len(cand), -1, -1, -1), pv.expand(len(cand), -1, -1, -1), i)
            pids = None if p else torch.zeros((len(cand), 1), dtype=torch.long, device=lm.device)
            out = run_to_layer(lm, layer, cand[:, None], cache, pids, edits)  # (C, F)
            best.update(row, distance(out[None], target[p][None, None]), cand)  # (1, C)
            tick()
    return best


def _verdicts(lm: LoadedModel, best: Best, tol: float, truth: list[int] | None) -> list[PositionProbe]:
    tok = lm.tokenizer
    out = []
    for p in range(best.d.shape[0]):
        i0, i1 = int(best.i[p, 0]), int(best.i[p, 1])
        d0, d1 = float(best.d[p, 0]), float(best.d[p, 1])
        true = None if truth is None else truth[p]
        out.append(
            PositionProbe(
                position=p,
                token_id=i0,
                label=token_label(tok, i0),
                distance=d0,
                runner_up_id=i1,
                runner_up_label=token_label(tok, i1) if math.isfinite(d1) else "",
                runner_up_distance=d1,
                tolerance=tol,
                true_token_id=true,
                true_label=None if true is None else token_label(tok, true),
            )
        )
    return out


__all__ = [
    "CONTEXTS",
    "LayerProbe",
    "PositionProbe",
    "ProbeResult",
    "default_tolerance",
    "probe_cache",
    "probe_session",
]
