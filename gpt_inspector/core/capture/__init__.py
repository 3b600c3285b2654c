"""Capture every attention quantity by *being* the model's attention function.

The attention call as a short pipeline (``attend.inspector_attention``): prepare the call, let the
interventions that apply change it (``interventions``: sparse key selections, a key bias, a KV policy,
mask edits), compute it (``kernel``: sdpa, or the written-out equation where the scores must be in
hand), let them read or change the output (a policy's scoring, mask-edited rows, head edits), and
record the primitives (``recorder``).

Our mask builder is the eager one (an additive float mask) except where sdpa's own builder would skip
the mask (plain causal, nothing padded, no window in reach): then it returns None and we ask sdpa for
``is_causal``, so a prefill at T = 8,192 never builds a T x T mask and a decode step passes none.
Queries after a cache (a recompute's chunks) get the materialised mask, since the model may read it,
marked plain where it is plain causal; the kernel then computes them without it.
"""

from ..edits import HeadEdit, MaskEdit, allowed_rows, compile_edits  # noqa: F401 (the names capture always offered)
from . import kernel  # noqa: F401 (kernel.causal_additive and its sdpa switch are patched through here in tests)
from .attend import ATTN_NAME, inspector_attention  # noqa: F401 (importing it registers the attention function)
from .interventions import KEY_BIAS_ATTR, Intervention  # noqa: F401
from .kernel import AppliedBias, Call, causal_additive, inspector_mask  # noqa: F401
from .recorder import (  # noqa: F401
    Recorder,
    RowRecorders,
    Unpairable,
    active_recorder,
    current_recorder,
    make_active,
    scratch_forward,
)

__all__ = [
    "ATTN_NAME", "AppliedBias", "Call", "HeadEdit", "Intervention", "KEY_BIAS_ATTR", "MaskEdit", "Recorder",
    "RowRecorders", "Unpairable", "allowed_rows", "causal_additive", "compile_edits", "current_recorder", "active_recorder", "make_active",
    "inspector_attention", "inspector_mask", "scratch_forward",
]  # fmt: skip
