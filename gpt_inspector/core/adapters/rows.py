"""Families whose forward skips query rows of some layers when only the last logits are asked for.

Gemma 4's KV-shared layers read K/V that earlier layers computed, so with an integer
``logits_to_keep`` (what ``generate`` and a session pass) its text model runs them on the kept
positions only. The logits are the same either way; but the inspector shows every position's
attention in every layer, and rows those layers never ran would stay unrecorded. The adapter
runs them on every row, as the model's full forward (and ``output_attentions``) does.
"""

from __future__ import annotations

from . import register
from ._common import patch


def _every_row(self, hidden_states, per_layer_inputs, position_embeddings, causal_mask_mapping, *args, **kwargs):
    return hidden_states, per_layer_inputs, position_embeddings, causal_mask_mapping


@register("gemma4_text")
def gemma4_text(model) -> None:
    base = model.get_decoder()
    if hasattr(type(base), "_maybe_slice_kv_shared_inputs"):
        patch(base, "_maybe_slice_kv_shared_inputs", _every_row)
