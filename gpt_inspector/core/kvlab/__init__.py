"""The KV cache lab: what a cache policy costs in bytes, fidelity and privacy, step by step.

``policy`` simulates eviction (one policy running a scorer from ``scorers``) and quantization
(``quant``) inside the inspector's attention function, ``registry`` names every policy, ``lab``
runs a policy beside the full-cache reference, ``sweep`` maps budgets and policies to a frontier.
``presses`` holds kvpress's presses written again in kvpress's own scoring interface and
``press_policy.from_press`` runs any such press (kvpress's own objects too) as a policy.

Names load on first use (PEP 562), so ``registry``'s names cost no torch import (the CLI's --help).
"""

from __future__ import annotations

import importlib

_NAMES = {
    "KVLab": "lab", "LabStep": "lab", "PrivacyResult": "lab", "kl_divergence": "lab", "policy_rows": "lab",
    "row_error": "lab", "EVICTION": "registry", "NAMES": "registry", "QUANT": "registry", "register": "registry",
    "Eviction": "policy", "Policy": "policy", "make": "policy", "Scorer": "scorers", "Seen": "scorers",
    "SCHEMES": "quant", "Quantization": "quant", "quantize_groups": "quant",
    "PressPolicy": "press_policy", "from_press": "press_policy",
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
