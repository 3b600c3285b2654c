"""Beam search one step at a time, the same search as transformers' ``generate(num_beams=...)``.

- ``tree``: what the search leaves behind (nodes, hypotheses, steps, results) and node status;
- ``search``: ``BeamSearch``, the port of HF's ``_beam_search`` loop;
- ``view``: ``BeamView``, one beam seen with a Session's read-only accessors.

Greedy vs beams vs a sample on one prompt lives in ``gpt_inspector.core.compare``.
"""

from .search import BeamSearch, resolve_max_length
from .tree import BeamNode, BeamResult, BeamStep, Hypothesis, first_difference
from .view import BeamView

__all__ = [
    "BeamSearch", "BeamView", "BeamNode", "BeamStep", "BeamResult", "Hypothesis", "first_difference",
    "resolve_max_length",
]  # fmt: skip
