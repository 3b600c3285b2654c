"""The beam tree's data: nodes (every kept continuation), hypotheses, steps, results, and where
each node stands now (alive, finished, pruned) given the running beams and kept hypotheses.

Plain data, no model: the search (``search.py``) fills it, views and front ends read it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from ..validate import json_number

# ---------------------------------------------------------------------------------------------
# what a step shows


@dataclass
class BeamNode:
    """One token in the beam tree: a continuation some beam proposed at some step.

    ``fate`` is what happened at its own step: ``beam`` (kept as running beam ``beam``),
    ``finished`` (stopped and entered the finished hypotheses), ``dropped`` (stopped but did not
    enter them), ``pruned`` (not among the kept continuations). ``status`` is where it stands now:
    ``alive`` (on the path of a running beam or a kept hypothesis), ``finished`` (the last token
    of a kept hypothesis) or ``pruned``.
    """

    id: int
    parent: int | None
    step: int  # -1 for the prompt (the root)
    token_id: int | None
    text: str
    logprob: float  # log p(token | its beam), 0 for the root
    score: float  # cumulative log-probability of the beam after this token
    rank: int = 0  # place among the step's kept continuations (0 = best)
    parent_beam: int | None = None  # running beam (row) it extends
    stopped: bool = False  # hit an EOS token or max_length
    normalized: float | None = None  # length-normalised score, for stopped ones
    fate: str = "pruned"
    beam: int | None = None  # the running beam it became, if kept
    status: str = "pruned"
    returned: int | None = None  # rank among the returned sequences whose path runs through it

    @property
    def prob(self) -> float:
        return math.exp(self.logprob)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)  # every field, in order
        for k in ("logprob", "score", "normalized"):
            d[k] = json_number(d[k])  # JSON has no inf or NaN
        return d


@dataclass
class Hypothesis:
    """A finished sequence kept by the search (EOS or max_length reached)."""

    node: int  # its last token in the tree
    token_ids: list[int]  # prompt included, no padding
    score: float  # length-normalised, what generate returns as sequences_scores
    sum_logprobs: float
    step: int  # the step it finished at


@dataclass
class BeamStep:
    """What one step of the search did."""

    index: int
    length: int  # sequence length (prompt included) before the step
    candidates: list[BeamNode]  # the K kept continuations, best first
    beams: list[int]  # node id of each running beam after the step
    beam_scores: list[float]  # their cumulative log-probabilities
    finished: list[Hypothesis]  # the kept hypotheses after the step, best first
    done: bool
    time_s: float = 0.0
    logits: torch.Tensor | None = field(default=None, repr=False)  # (num_beams, V) float32 CPU, row = parent beam
    parent_scores: list[float] = field(default_factory=list)  # running beams' scores before the step

    @property
    def survivors(self) -> list[BeamNode]:
        return [c for c in self.candidates if c.fate == "beam"]

    def top_for_beam(self, beam: int, n: int = 5) -> list[tuple[int, float, float]]:
        """Beam ``beam``'s own best ``n`` next tokens: (token id, log-prob, cumulative log-prob)."""
        assert self.logits is not None, "top_for_beam on a step that kept no logits"
        lp = torch.log_softmax(self.logits[beam], dim=-1)  # (V,)
        vals, idx = torch.topk(lp, min(n, lp.shape[0]))
        base = self.parent_scores[beam]
        return [(int(i), float(v), base + float(v)) for v, i in zip(vals, idx)]


@dataclass
class BeamResult:
    """What ``generate(..., return_dict_in_generate=True, output_scores=True)`` returns, as lists."""

    sequences: list[list[int]]  # prompt included, padded to a common length as generate pads
    sequences_scores: list[float]
    lengths: list[int]  # unpadded lengths
    hypotheses: list[Hypothesis]


# ---------------------------------------------------------------------------------------------
# where nodes stand


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (the shorter length if one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def path(nodes: list[BeamNode], node: int) -> list[BeamNode]:
    """The generated tokens leading to ``node``, first to last (the root, the prompt, left out)."""
    out = []
    n: int | None = node
    while n is not None and n != 0:
        out.append(nodes[n])
        n = nodes[n].parent
    return out[::-1]


def refresh_status(nodes: list[BeamNode], running: list[int], kept: list[int | None], n_returned: int) -> None:
    """Recompute every node's ``status`` and ``returned`` from scratch.

    ``running``: the last node of each running beam (empty once the search is done);
    ``kept``: the last node of each hypothesis slot, best first, None for a slot holding no
    finished hypothesis; the first ``n_returned`` slots are the returned sequences (0 until done).
    """
    for n in nodes:
        n.status, n.returned = "pruned", None
    nodes[0].status = "alive"

    def mark(node: int, end_status: str, returned: int | None = None) -> None:
        first = True
        n: int | None = node
        while n is not None:
            nd = nodes[n]
            if first:
                if nd.status != "finished":
                    nd.status = end_status
            elif nd.status == "pruned":
                nd.status = "alive"
            if returned is not None and (nd.returned is None or returned < nd.returned):
                nd.returned = returned
            first = False
            n = nd.parent

    for node in running:
        if node != 0:
            mark(node, "alive")
    for j, slot_node in enumerate(kept):
        if slot_node is not None:
            mark(slot_node, "finished", j if j < n_returned else None)
