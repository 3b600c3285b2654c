"""What one step computed and chose, the same record for sessions, beams and traces."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import decoding

TOP_N = 10


@dataclass(frozen=True)
class TopEntry:
    token_id: int
    label: str  # readable token text (see tokens.token_label)
    prob: float
    logit: float

    @property
    def text(self) -> str:  # the name the first API used
        return self.label


def top_entries(
    probs: torch.Tensor, logits: torch.Tensor, label: Callable[[int], str], n: int = TOP_N
) -> list[TopEntry]:
    """The ``n`` most likely tokens of ``probs`` (V,), best first, with their labels and raw logits."""
    return top_rows(probs[None], logits[None], label, n)[0]


def top_rows(
    probs: torch.Tensor, logits: torch.Tensor, label: Callable[[int], str], n: int = TOP_N
) -> list[list[TopEntry]]:
    """``top_entries`` of every row of ``probs`` and ``logits`` (R, V), in one top-k on their device.

    Only tokens the decoding keeps (p > 0): top-k / top-p leave the rest at exactly 0, and the top
    ``n`` of a row whose tail is all zeros were arbitrary tokens from ``torch.topk``'s tie. Equal
    probabilities are listed by token id, so the order never depends on the kernel.
    """
    vals, idx = torch.topk(probs, min(n, probs.shape[-1]), dim=-1)  # (R, n)
    # one conversion each, not a tensor index per entry: this runs on every step
    ids, ps, ls = idx.tolist(), vals.tolist(), logits.gather(-1, idx).tolist()
    return [
        [TopEntry(i, label(i), p, lg) for i, p, lg in sorted(zip(*row), key=lambda e: (-e[1], e[0])) if p > 0]
        for row in zip(ids, ps, ls)
    ]


@dataclass
class Step:
    """What one step computed and chose.

    ``position`` is the query position whose logits gave the token; the chosen token itself is
    not in the cache yet (it is fed by the next step).
    """

    index: int
    position: int
    token_id: int
    token_text: str  # the decoded text of the chosen token
    logits: torch.Tensor  # (V,) float32, raw model output
    probs: torch.Tensor  # (V,) float32 after temperature / top-k / top-p
    top: list[TopEntry]
    entropy: float
    forced: bool = False
    time_s: float = 0.0
    finish_reason: str | None = None
    rng_state: torch.Tensor | None = field(default=None, repr=False)
    label: str = ""  # the chosen token's readable label

    @property
    def prob(self) -> float:
        return float(self.probs[self.token_id])

    def refresh(self, dec: decoding.Decoding, label: Callable[[int], str], text: Callable[[int], str]) -> None:
        """Recompute what depends on the decoding settings and the chosen token."""
        self.probs = decoding.distribution(self.logits, dec)
        self.entropy = decoding.entropy(self.probs)
        self.top = top_entries(self.probs, self.logits, label)
        self.token_text = text(self.token_id)
        self.label = label(self.token_id)

    def same_as(self, other: Step) -> bool:
        return (
            self.index == other.index
            and self.position == other.position
            and self.token_id == other.token_id
            and torch.equal(self.logits, other.logits)
            and torch.equal(self.probs, other.probs)
            and self.entropy == other.entropy
            and self.finish_reason == other.finish_reason
        )
