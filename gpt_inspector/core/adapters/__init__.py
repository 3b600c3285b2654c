"""Adapters for families whose modeling code computes attention itself.

transformers 5 routes most families' attention through ``AttentionInterface``, where our capture
function sits. GPT-J, GPT-Neo, CodeGen, GPT-NeoX-Japanese, XGLM, Falcon, BLOOM and MPT compute
it in their own attention modules instead, and doge hides a learned bias inside its mask. For
each, one small function (registered per ``model_type``) wraps the model's attention modules at
load so that the attention core, after the model's own projections, rotary embedding and cache
update, goes through ``capture.inspector_attention`` with the model's arithmetic: what the
inspector records is what produced the logits.

``native()`` switches every adapter off for the duration of a block, so the load's fidelity
self-test compares the inspector with the model's own code rather than with itself.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

from ..errors import InspectorError

# set while the model's own attention code must run (the fidelity reference)
NATIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("gpt_inspector_native_attention", default=False)

# model_type -> adapter(model): wraps the model's attention modules in place
ADAPTERS: dict[str, Callable] = {}
# model_type -> check(config) -> a one-line reason the adapter cannot be exact for this config, or None
LIMITS: dict[str, Callable] = {}


def register(model_type: str, limit: Callable | None = None):
    def deco(fn):
        ADAPTERS[model_type] = fn
        if limit is not None:
            LIMITS[model_type] = limit
        return fn

    return deco


@contextlib.contextmanager
def native():
    """Run the model's own attention code inside this block (adapters pass through)."""
    token = NATIVE.set(True)
    try:
        yield
    finally:
        NATIVE.reset(token)


def adapt(model, source: str) -> bool:
    """Wrap ``model``'s attention if its family needs an adapter; True if it did.

    Raises InspectorError (one line) when the family's adapter cannot be exact for this config.
    Adapting twice is harmless: a module already wrapped is left as it is.
    """
    mt = str(getattr(model.config, "model_type", ""))
    fn = ADAPTERS.get(mt)
    if fn is None:
        return False
    limit = LIMITS.get(mt)
    why = None if limit is None else limit(model.config)
    if why:
        raise InspectorError(f"{source} ({mt}) is not supported: {why}")
    try:
        fn(model)
    except NotImplementedError as e:  # the model's code is not the shape the adapter was written for
        raise InspectorError(f"{source} ({mt}) is not supported: {e}") from None
    return True


from . import biased, classic, rows  # noqa: E402, F401  (registers the adapters, which need register above)
