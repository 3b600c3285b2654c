"""What every adapter shares: patching a module method, and calling the capture with a layer index."""

from __future__ import annotations

import types

import torch

from .. import capture
from . import NATIVE


def patch(module: torch.nn.Module, name: str, fn) -> None:
    """Make ``module.name`` run ``fn(module, ...)``; the class's own method still runs under ``native()``.

    Bound with MethodType, so a deep copy of the model carries a wrapper bound to the copy.
    """
    if module.__dict__.get(name) is not None:
        return  # already adapted

    def call(self, *args, **kwargs):
        if NATIVE.get():
            return getattr(type(self), name)(self, *args, **kwargs)
        return fn(self, *args, **kwargs)

    setattr(module, name, types.MethodType(call, module))


def attend(layer_idx: int, query, key, value, mask, scaling: float, **kwargs):
    """The inspector's attention over q (B, H, Tq, d), K/V (B, Hkv, Tk, d): ((B, H, Tq, d) output, probs).

    ``mask``: additive, or boolean with True where a query may attend (what transformers builds
    for a model loaded for sdpa, as Falcon is by default).
    """
    mask = allowed_to_additive(mask, query.dtype)  # (B, 1, Tq, Tk)
    # the module stands in for what inspector_attention reads off one: the cache layer the session crops and reads
    module = types.SimpleNamespace(layer_idx=layer_idx)
    out, probs = capture.inspector_attention(module, query, key, value, mask, scaling=scaling, **kwargs)
    return out.transpose(1, 2), probs  # (B, H, Tq, d)


def blocked_to_additive(mask: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """A boolean "masked" mask (True = may not attend, MPT's) as the additive mask the capture takes."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, torch.finfo(dtype).min)


def allowed_to_additive(mask: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """A boolean "allowed" mask (True = may attend, sdpa's) as the additive mask the capture takes."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return blocked_to_additive(~mask, dtype)
