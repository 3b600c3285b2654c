"""A hybrid model's own cache that can go back: state-space layers rewound exactly.

Hybrids (falcon_h1, jamba, bamba, lfm2, qwen3_next, nemotron_h, ...) keep, beside the attention
layers' K/V, a running state per state-space or convolution layer: it is overwritten at every
forward, so it cannot be cropped like K/V. This cache keeps each such layer's state as it was
before every forward (its running state is small and independent of the context length), so a
step back, a mask edit's recompute and the rollback after a fault put it back bit for bit.

Memory: one copy of each state layer's state per forward (step).
"""

from __future__ import annotations

from typing import TypeGuard

import torch

from .hf import DynamicCache, DynamicLayer, LinearAttentionCacheLayerMixin

_STATE_FIELDS = ("conv_states", "recurrent_states", "is_conv_states_initialized", "is_recurrent_states_initialized",
                 "has_previous_state", "conv_kernel_size")  # fmt: skip


class StateCache(DynamicCache):
    """``DynamicCache(config=...)`` whose state-space layers remember their state before each forward.

    ``begin_forward(start)`` before each forward over positions start.. (``core.forward`` calls
    it) keeps the states; ``rewind_states(length)`` puts every state layer back as it was before the forward that
    started at ``length``. ``crop`` does both halves: K/V cut, states rewound.
    """

    def __init__(self, config):
        super().__init__(config=config)
        # layer -> {start of a forward: the layer's state before it}
        self._history: dict[int, dict[int, dict]] = {}

    def begin_forward(self, start: int) -> None:
        # every state layer's state before the forward: decoding steps update the states in place
        # (causal_conv1d_update, selective_state_update), not through the cache's update methods
        for idx, layer in enumerate(self.layers):
            if is_state_layer(layer):
                state = {name: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in getattr(layer, name).items()}
                         for name in _STATE_FIELDS}  # fmt: skip
                self._history.setdefault(idx, {})[start] = {**state, "device": layer.device, "dtype": layer.dtype}

    def rewind_states(self, length: int) -> None:
        """Every state layer as it was after ``length`` positions (a forward boundary)."""
        for idx, hist in self._history.items():
            later = sorted(p for p in hist if p >= length)
            if not later:
                continue  # the layer has seen no forward past ``length``
            if later[0] != length:
                raise ValueError(f"the cache can only go back to the start of a forward, not to position {length}")
            layer = self.layers[idx]
            for name, value in hist[length].items():
                setattr(layer, name, dict(value) if isinstance(value, dict) else value)
            for p in later:
                del hist[p]

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``tokens_to_remove`` positions (given negative, as ``DynamicCache.crop``)."""
        # K/V cut as each layer cuts them; the running states rewound, never cut (they have no positions)
        length = self.get_seq_length() - abs(tokens_to_remove)
        self.rewind_states(length)
        for layer in self.layers:
            if not isinstance(layer, DynamicLayer) or not getattr(layer, "is_initialized", False):
                continue
            extra = layer.get_seq_length() - length
            if extra > 0:
                # a hybrid layer's own crop would also cut its state's convolution window: only its K/V here
                (DynamicLayer.crop if is_state_layer(layer) else type(layer).crop)(layer, -extra)


def is_state_layer(layer) -> TypeGuard[LinearAttentionCacheLayerMixin]:
    return isinstance(layer, LinearAttentionCacheLayerMixin)
