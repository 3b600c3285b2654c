"""What the model's cache holds per layer, next to the K and V its attention function receives.

For most models the two are the same tensors, and the session reads K/V straight from the cache
(zero copy). Some keep something else:

- multi-head latent attention (deepseek_v2/v3, minicpm3) caches a compressed latent and a shared
  rotary key, and decompresses per-head K and V from it at every step;
- jetmoe caches its KV heads once and tiles them over the expert slots after the cache update;
- gemma3n's last layers keep no cache: they read an earlier layer's (KV sharing).

The load-time probe runs the model once and compares, layer by layer, what attention received
with what the cache holds (``read_layout``). Where attention received tensors no cache layer
holds, the session mirrors K/V as attention received them; everywhere else it reads the cache.
Hybrid models (state-space or convolution layers beside attention) also get their own cache
class, built from the config, so the state-space layers keep their running state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import hf
from .hf import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

Shape = tuple[int, int]  # (heads, numbers per head) per position

# cache layer types a plain DynamicCache stands in for (the rest: running states, a sparse indexer's keys)
_PLAIN_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "dummy"}


@dataclass(frozen=True)
class LayerKV:
    """One attention layer: K and V as attention received them, and where the cache keeps them."""

    keys: Shape  # (H_k, d_k) as attention received them
    values: Shape  # (H_v, d_v)
    # the cache layer whose K/V tensors attention received (itself, or the layer it shares);
    # None: the cache holds something else (a latent, untiled heads) and K/V are mirrored
    reads: int | None
    # what this layer's own cache layer stores per position: one (heads, numbers) per cached
    # tensor; () when it keeps nothing of its own (it reads a shared layer's)
    cached: tuple[Shape, ...]
    # the most positions the model's own cache (the one generate builds) keeps for this layer: a
    # sliding-window or chunked layer's window - 1; None: every position. The session's cache keeps
    # every position on every layer, so that all stay inspectable
    keeps: int | None = None

    def held(self, length: int) -> int:
        """Positions the model's own cache layer holds once ``length`` positions have run."""
        return length if self.keeps is None else min(length, self.keeps)

    @property
    def attention_numbers(self) -> int:
        """Numbers per position an ordinary per-head cache of these K and V would hold."""
        return self.keys[0] * self.keys[1] + self.values[0] * self.values[1]

    @property
    def cache_numbers(self) -> int:
        return sum(h * d for h, d in self.cached)


@dataclass(frozen=True)
class KVLayout:
    """Per model layer a ``LayerKV``, or None for a layer without attention (state-space)."""

    layers: tuple[LayerKV | None, ...]
    kind: str = "per-head"  # per-head, latent, tiled or shared
    # the cache is built from the config, layer kinds as the model's own (running states beside
    # K/V, a sparse indexer's key cache), rather than a plain DynamicCache
    own_cache: bool = False
    # layers whose cache keeps a running state (state-space, convolution) rather than positions
    state_layers: tuple[int, ...] = ()

    @property
    def mirrored(self) -> bool:
        """Whether the session must keep its own copy of K/V (the cache holds something else)."""
        return any(lk is not None and lk.reads is None for lk in self.layers)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, lk in enumerate(self.layers) if lk is not None)

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "layers": [None if lk is None else {"keys": list(lk.keys), "values": list(lk.values), "reads": lk.reads,
                                                "cached": [list(c) for c in lk.cached],
                                                # only where windowed: older readers ignore it; absent: every position
                                                **({} if lk.keeps is None else {"keeps": lk.keeps})}
                       for lk in self.layers],
        }  # fmt: skip

    @classmethod
    def from_json(cls, d, n_layers: int) -> KVLayout:
        """The layout a trace saved; ValueError when it is not one for ``n_layers`` layers."""

        def shape(x) -> Shape:
            if not (isinstance(x, list) and len(x) == 2 and all(isinstance(v, int) and v >= 1 for v in x)):
                raise ValueError(f"bad (heads, size) {x!r}")
            return (x[0], x[1])

        if not isinstance(d, dict) or not isinstance(d.get("layers"), list) or len(d["layers"]) != n_layers:
            raise ValueError(f"kv_layout must describe {n_layers} layers")
        layers: list[LayerKV | None] = []
        for x in d["layers"]:
            if x is None:
                layers.append(None)
                continue
            reads = x.get("reads") if isinstance(x, dict) else -1
            if reads is not None and not (isinstance(reads, int) and 0 <= reads < n_layers):
                raise ValueError(f"bad cache layer {reads!r}")
            cached = x.get("cached")
            if not isinstance(cached, list):
                raise ValueError("bad cached shapes")
            keeps = x.get("keeps")  # traces from before it was recorded: unknown, every position
            if keeps is not None and (isinstance(keeps, bool) or not isinstance(keeps, int) or keeps < 1):
                raise ValueError(f"bad window {keeps!r}")
            layers.append(LayerKV(shape(x.get("keys")), shape(x.get("values")), reads, tuple(shape(c) for c in cached),
                                  keeps))  # fmt: skip
        if not any(lk is not None for lk in layers):
            raise ValueError("kv_layout has no attention layer")
        return cls(tuple(layers), str(d.get("kind", "per-head")))

    def describe(self) -> str:
        """One line on what the cache holds, or "" for an ordinary per-head cache."""
        att = [lk for lk in self.layers if lk is not None]
        parts = []
        if self.kind == "latent":
            lk = att[0]
            pieces = " + ".join(f"{d}" for _, d in lk.cached)
            parts.append(
                f"KV cache holds a compressed latent ({pieces} = {lk.cache_numbers} numbers per position and layer); "
                f"per-head K and V would take {lk.attention_numbers} ({lk.attention_numbers / lk.cache_numbers:.1f}x)"
            )
        elif self.kind == "tiled":
            lk = att[0]
            parts.append(
                f"KV cache holds {lk.cached[0][0]} KV heads; attention receives them tiled to {lk.keys[0]} heads"
            )
        shared = [(i, lk.reads) for i, lk in enumerate(self.layers) if lk is not None and lk.reads not in (None, i)]
        if shared:
            parts.append("KV sharing: " + ", ".join(f"layer {i} reads layer {j}'s cache" for i, j in shared))
        for idx, what in (
            ([i for i, lk in enumerate(self.layers) if lk is None and i in self.state_layers], "no attention (state-space)"),
            ([i for i, lk in enumerate(self.layers) if lk is None and i not in self.state_layers], "no attention (feed-forward only)"),
            ([i for i in self.state_layers if self.layers[i] is not None], "a state-space block beside attention"),
        ):  # fmt: skip
            if idx:
                parts.append(f"layers {_ranges(idx)}: {what}")
        return "; ".join(parts)


def _ranges(idx: list[int]) -> str:
    return ", ".join(str(i) for i in idx) if len(idx) <= 6 else f"{idx[0]}..{idx[-1]} ({len(idx)} layers)"


def human_bytes(n: float) -> str:
    """``n`` bytes as the KV views and the CLI print them: 512 B, 1.5 KiB, 3.0 MiB, 2.1 GiB."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def needs_own_cache(config) -> bool:
    """Whether the model's cache keeps more than per-position K/V (running states, indexer keys)."""
    try:
        types = hf.layer_types(config)
    except (AttributeError, TypeError, ValueError):
        return False
    return any(t not in _PLAIN_TYPES for t in types)


def new_cache(config, own: bool) -> DynamicCache:
    """The cache a session steps with: full length on every attention layer.

    Sliding-window layers keep every position so all stay inspectable (the model's own sliding
    mask, recorded as mask rows, hides what the window drops). ``own``: the model's own per-layer
    cache classes from the config (hybrids, sparse indexers), sliding ones swapped for full-length.
    """
    if not own:
        return DynamicCache()
    cu = hf.cache_utils()
    LinearAttentionAndFullAttentionLayer = cu.LinearAttentionAndFullAttentionLayer
    LinearAttentionAndSlidingWindowAttentionLayer = cu.LinearAttentionAndSlidingWindowAttentionLayer

    from .state_cache import StateCache

    cache = StateCache(config)  # state-space layers rewound exactly on step back
    for i, cl in enumerate(cache.layers):
        if type(cl) is DynamicSlidingWindowLayer:
            cache.layers[i] = DynamicLayer()
        elif type(cl) is LinearAttentionAndSlidingWindowAttentionLayer:
            n_states = cl.number_of_states  # type: ignore[union-attr]  # mypy does not narrow on type(x) is
            cache.layers[i] = LinearAttentionAndFullAttentionLayer(number_of_states=n_states)
    return cache


def silent_layers(cache) -> set[int]:
    """Cache layers that never see attention: state-space / convolution layers, and feed-forward-only
    layers (a ``DummyLayer`` slot). Only those may skip the attention function in the load probe."""
    from .state_cache import is_state_layer

    return {i for i, cl in enumerate(cache.layers) if is_state_layer(cl) or type(cl).__name__ == "DummyLayer"}


def cache_tensors(cl) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A cache layer's own keys and values, (B, h, T, n) each, where it holds both; else None."""
    k, v = getattr(cl, "keys", None), getattr(cl, "values", None)
    if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == 4 and v.dim() == 4:
        return k, v
    return None


def read_layout(rec, cache, n_layers: int, length: int, own_cache: bool, keeps=()) -> KVLayout:
    """Compare, after one probe forward, what attention received with what the cache holds.

    ``rec`` recorded with ``mirror_kv=True``; layers it never saw have no attention. ``keeps``: per
    layer the most positions the model's own cache keeps (``hf.cache_keeps``), None for every one.
    """
    held = [cache_tensors(cl) for cl in cache.layers]
    held = [None if kv is None else (kv[0].detach().cpu(), kv[1].detach().cpu()) for kv in held]
    layers: list[LayerKV | None] = []
    for i in range(n_layers):
        if rec.calls[i] == 0:
            layers.append(None)
            continue
        k, v = rec.k[i].view(length), rec.v[i].view(length)  # (B, H, T, d) as attention received them
        reads = None
        # itself first: a layer that owns its cache reads it; only then another layer's (sharing)
        for j in [i] + [j for j in range(len(held)) if j != i]:
            kv = held[j] if j < len(held) else None
            if kv is not None and kv[0].shape == k.shape and kv[1].shape == v.shape:
                if torch.equal(kv[0], k) and torch.equal(kv[1], v):
                    reads = j
                    break
        own = held[i] if i < len(held) else None
        cached = () if own is None else ((own[0].shape[1], own[0].shape[3]), (own[1].shape[1], own[1].shape[3]))
        if reads is not None and reads != i:
            cached = ()  # a KV-sharing layer: its cache slot (if any) is an empty placeholder
        window = keeps[i] if i < len(keeps) else None
        layers.append(LayerKV((k.shape[1], k.shape[3]), (v.shape[1], v.shape[3]), reads, cached, window))
    kind = "per-head"
    att = [lk for lk in layers if lk is not None]
    if any(lk.reads is None for lk in att):
        lk = next(lk for lk in att if lk.reads is None)
        kind = "latent" if any(h == 1 for h, _ in lk.cached) and lk.keys[0] > 1 else "tiled"
    elif any(lk.reads != i for i, lk in enumerate(layers) if lk is not None):
        kind = "shared"
    from .state_cache import is_state_layer

    states = tuple(i for i, cl in enumerate(cache.layers) if is_state_layer(cl))
    return KVLayout(tuple(layers), kind, own_cache, states)
