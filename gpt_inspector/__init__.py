"""gpt-inspector: a step-through debugger for GPT-style language models.

    >>> import gpt_inspector as gi
    >>> lm = gi.load_model()                     # the embedded demo model
    >>> s = gi.Session(lm, "She eats apple")
    >>> s.run(5); s.attention(0, 1, "probs")     # (T, T) numpy

Names load on first use, so ``gpt-inspector --help`` does not import torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_NAMES = {
    "DEMO_MODEL": ".core.models", "InspectorError": ".core.errors", "LoadedModel": ".core.models",
    "MaskEdit": ".core.capture", "Session": ".core.session", "Step": ".core.step", "StepFailed": ".core.errors",
    "Trace": ".core.trace", "load_model": ".core.models", "load_trace": ".core.trace", "save_trace": ".core.trace",
    "compare": ".core.compare", "connect": ".remote.client", "Comparison": ".core.compare", "render_heatmap": ".export", "render_grid": ".export",
    "Decoding": ".core.decoding", "assisted": ".core.assisted", "Assisted": ".core.assisted",
}  # fmt: skip
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_NAMES))
