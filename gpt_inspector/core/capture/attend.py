"""The model's attention function: prepare → interventions before → kernel → interventions after → record.

Registered under ``ATTN_NAME`` in transformers' ``AttentionInterface``, with ``kernel.inspector_mask``
under the same name in ``AttentionMaskInterface``. The second registration matters: without it
``create_causal_mask`` finds no builder for our name, hands us no mask, and the causal mask silently
disappears (logits drift by ~0.02 on GPT-2).

Because this function computes the attention the model uses, what we record *is* what the model
computed; mask and head edits are applied here too, so an edited model and its records never disagree.
"""

from __future__ import annotations

from ..hf import AttentionInterface, AttentionMaskInterface
from . import kernel
from .interventions import interventions_for
from .kernel import AppliedBias, Call
from .recorder import RowRecorders, current_recorder

ATTN_NAME = "gpt_inspector"

# arguments some families pass to their attention function that change its result and that we do
# not reproduce (relative position biases, sparse key selections, sinks in another layout than s_aux)
_CHANGES_THE_RESULT = ("position_bias", "block_indices", "sinks")


def inspector_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                        score_bias: AppliedBias | None = None, **kwargs):  # fmt: skip
    """The model's attention, computed here so that what we record is what it used.

    query (B, H, Tq, d); key, value (B, Hkv, Tk, d) with every cached position (the cache is already
    updated). Returns the output as (B, Tq, H, d_v) and the probabilities where they were in hand. We
    record q and the output; scores and probabilities are derived on demand from q and K with the same
    equation (``core.attention``), so nothing T x T is kept.
    """
    active = current_recorder()
    if isinstance(active, RowRecorders):  # runs stepped as one batch: each row attends as its own run
        return active.attend(module, query, key, value, attention_mask, scaling, dropout, softcap,
                             score_bias=score_bias, **kwargs)  # fmt: skip
    layer = getattr(module, "layer_idx", None)
    call = prepare(query, key, value, attention_mask, scaling, softcap, score_bias, kwargs)
    interventions = interventions_for(module, active, layer, kwargs)
    for step in interventions:
        step.before(call)
    out = kernel.attend(call)  # (B, H, Tq, d_v)
    for step in interventions:
        out = step.after(call, out)  # (B, H, Tq, d_v)
    if active is not None and layer is not None:
        active._record(layer, query, call.key, call.value, call.model_mask, out, call.scaling, softcap, call.sinks,
                       call.bias)  # fmt: skip
    return out.transpose(1, 2).contiguous(), call.probs  # (B, Tq, H, d_v)


def prepare(query, key, value, attention_mask, scaling, softcap, score_bias, kwargs: dict) -> Call:
    """The call as the model made it; refused where it passes an argument we would have to drop."""
    for name in _CHANGES_THE_RESULT:
        if kwargs.get(name) is not None:
            # computing without it would be silently wrong; the load's probe turns this into a refusal
            raise NotImplementedError(f"gpt-inspector's attention cannot apply the model's {name!r} argument")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return Call(query, key, value, attention_mask, scaling, softcap, sinks=kwargs.get("s_aux"), bias=score_bias)


AttentionInterface.register(ATTN_NAME, inspector_attention)
AttentionMaskInterface.register(ATTN_NAME, kernel.inspector_mask)
