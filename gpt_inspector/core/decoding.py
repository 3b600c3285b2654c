"""Turn logits into a next-token distribution with transformers' own logits warpers.

Order as in ``generate``: temperature, then top-k, then top-p. Temperature 0 means greedy: the
token is the argmax, and the distribution shown is the untempered softmax (a one-hot bar would
teach nothing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import hf
from .errors import InspectorError


@dataclass(frozen=True)
class Decoding:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        validate(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_json(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


# logits / temperature overflows float32 (inf, then NaN probabilities) for temperatures near float32's
# smallest normal; below this floor a temperature is indistinguishable from greedy anyway
MIN_TEMPERATURE = 1e-30


def validate(temperature, top_k, top_p) -> None:
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        raise InspectorError(f"temperature must be a number, got {temperature!r}") from None
    if math.isnan(t) or t < 0 or math.isinf(t):
        raise InspectorError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if 0 < t < MIN_TEMPERATURE:
        raise InspectorError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise InspectorError(f"top_k must be an integer >= 1, got {top_k!r}")
    if top_p is not None:
        try:
            p = float(top_p)
        except (TypeError, ValueError):
            raise InspectorError(f"top_p must be a number in (0, 1], got {top_p!r}") from None
        if math.isnan(p) or not (0.0 < p <= 1.0):
            raise InspectorError(f"top_p must be in (0, 1], got {top_p!r}")


def warp(logits: torch.Tensor, dec: Decoding) -> torch.Tensor:
    """Filtered, tempered scores (-inf for removed tokens). logits: (V,) float32."""
    # imported here: the argument checks above run before any model load and need no transformers
    lp = hf.logits_processors()

    scores = logits.float()[None]  # (1, V): the warpers take a batch
    if not dec.greedy and dec.temperature != 1.0:
        scores = lp.TemperatureLogitsWarper(float(dec.temperature))(None, scores)
    if dec.top_k is not None:
        scores = lp.TopKLogitsWarper(dec.top_k)(None, scores)
    if dec.top_p is not None and dec.top_p < 1.0:
        # drops the low tail whose mass is <= 1 - top_p, keeps at least one
        scores = lp.TopPLogitsWarper(float(dec.top_p))(None, scores)
    return scores[0]


def distribution(logits: torch.Tensor, dec: Decoding) -> torch.Tensor:
    """Probabilities (V,) float32 after temperature, top-k and top-p."""
    return torch.softmax(warp(logits, dec), dim=-1)


def choose(logits: torch.Tensor, dec: Decoding, generator: torch.Generator | None) -> int:
    if dec.greedy:
        return int(torch.argmax(logits))
    probs = distribution(logits, dec)
    return int(torch.multinomial(probs, 1, generator=generator))


def entropy(probs: torch.Tensor) -> float:
    """Shannon entropy in nats (entr(0) = 0, so filtered tokens count for nothing)."""
    return float(torch.special.entr(probs).sum())
