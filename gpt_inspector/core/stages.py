"""The stage vocabulary, one name per stage for the API, the CLI, the window and exports.

Kept apart from ``attention.py`` (which needs torch) so figures and argument parsing can use it
without loading the engine.
"""

from __future__ import annotations

from .errors import InspectorError

STAGES = ("raw", "scores", "masked_scores", "probs")
KINDS = STAGES  # the API's historical name
STAGE_TITLES = {"raw": "raw QKᵀ", "scores": "scaled", "masked_scores": "masked", "probs": "softmax"}
# the name a user types on the command line with what it means: "scores (scaled)"; the window's
# buttons and menus show these, so a stage seen there maps to ``--kind`` at once
STAGE_LABELS = {k: t if t.split()[0] == k else f"{k} ({t})" for k, t in STAGE_TITLES.items()}


def check_stage(kind: str) -> str:
    if kind not in STAGES:
        raise InspectorError(f"unknown kind {kind!r}; use one of {', '.join(STAGES)}")
    return kind
