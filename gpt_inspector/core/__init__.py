"""The Qt-free engine: loading, capture, the step session, decoding, traces.

Names load on first use (PEP 562), so ``gpt_inspector.core.errors`` and the CLI's argument
parsing do not pay for importing torch and transformers.
"""

from __future__ import annotations

import importlib

_NAMES = {
    "ATTN_NAME": "capture", "MaskEdit": "capture", "InspectorError": "errors", "StepFailed": "errors",
    "check": "mathcheck", "check_all": "mathcheck", "DEMO_MODEL": "models", "LoadedModel": "models",
    "load_model": "models", "probe_cache": "probe", "probe_session": "probe", "MaskEditReport": "session",
    "Session": "session", "Step": "step", "TopEntry": "step", "Trace": "trace", "load_trace": "trace",
    "save_trace": "trace", "RunSource": "source", "KINDS": "attention", "Assisted": "assisted", "assisted": "assisted",
}  # fmt: skip
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        value = getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_NAMES))
