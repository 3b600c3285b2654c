"""The KV cache lab: what a cache policy costs in bytes, fidelity and privacy, step by step.

``policies`` simulates eviction and quantization inside the inspector's attention function,
``lab`` runs a policy beside the full-cache reference, ``sweep`` maps budgets and policies to a
frontier.
"""

from .lab import KVLab, LabStep, PrivacyResult, kl_divergence, policy_rows, row_error
from .policies import EVICTION, NAMES, QUANT, Eviction, Policy, make
from .quant import SCHEMES, Quantization, quantize_groups

__all__ = ["EVICTION", "NAMES", "QUANT", "SCHEMES", "Eviction", "KVLab", "LabStep", "Policy", "PrivacyResult", "Quantization",
           "kl_divergence", "make", "policy_rows", "quantize_groups", "row_error"]  # fmt: skip
