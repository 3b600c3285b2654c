"""Families whose forward skips query rows of some layers when only the last logits are asked for.

Gemma 4's KV-shared layers read K/V that earlier layers computed, so with an integer
``logits_to_keep`` (what ``generate`` and a session pass) its text model runs them on the kept
positions only. The logits are the same either way; but the inspector shows every position's
attention in every layer, and rows those layers never ran would stay unrecorded. The adapter
runs them on every row, as the model's full forward (and ``output_attentions``) does.
"""

from __future__ import annotations

import inspect

from . import register
from ._common import patch


def _every_row(self, *args, **kwargs):
    # the inputs it would slice, untouched: its parameters before logits_to_keep (gemma4_text has per-layer
    # inputs among them, gemma4_unified_text not)
    sig = inspect.signature(type(self)._maybe_slice_kv_shared_inputs)
    bound = sig.bind(self, *args, **kwargs).arguments
    names = list(sig.parameters)[1 : list(sig.parameters).index("logits_to_keep")]
    return tuple(bound[n] for n in names)


@register("gemma4_text")
@register("gemma4_unified_text")
def gemma4_text(model) -> None:
    base = model.get_decoder()
    slicer = getattr(type(base), "_maybe_slice_kv_shared_inputs", None)
    if slicer is None:  # a release that runs every row anyway
        return
    if "logits_to_keep" not in inspect.signature(slicer).parameters:
        # the shared layers' earlier rows would go unrecorded, their attention shown as zeros: refuse instead
        raise NotImplementedError(
            "its text model slices the KV-shared layers' inputs in a way the adapter does not know"
        )
    patch(base, "_maybe_slice_kv_shared_inputs", _every_row)
