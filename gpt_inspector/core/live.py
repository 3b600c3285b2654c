"""What a run source can execute: ``Live``, its capabilities and each refusal's one line.

Every "can I run this here" question of a front end (the window's panels, the CLI) is
``source.live.can(...)``, never a probe of the source's class or private names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .errors import InspectorError

# what a source may be able to execute, and how a refusal names it
CAPABILITIES: dict[str, str] = {
    "step": "stepping",
    "probe": "the cache probe",
    "recompute": "recomputing the head outputs the run did not keep",
    "lens": "the logit lens",
    "kvlab": "the KV cache lab",
    "compare": "comparing decodings",
}


@dataclass(frozen=True)
class Live:
    """What can be executed on a run source: every capability in ``CAPABILITIES`` but the refused
    ones, each refusal the one line a front end shows. Qt-free and small: snapshots carry it."""

    refused: Mapping[str, str] = field(default_factory=dict)  # capability -> why not

    def __post_init__(self) -> None:
        unknown = set(self.refused) - set(CAPABILITIES)
        if unknown:
            raise ValueError(f"unknown capabilities {sorted(unknown)}; known: {list(CAPABILITIES)}")

    @classmethod
    def nothing(cls, why: str) -> Live:
        """A source on which nothing runs (a trace file): every refusal says ``why``."""
        return cls({c: f"{name} needs a live session: {why}" for c, name in CAPABILITIES.items()})

    def can(self, what: str) -> bool:
        if what not in CAPABILITIES:
            raise ValueError(f"unknown capability {what!r}; known: {list(CAPABILITIES)}")
        return what not in self.refused

    def why_not(self, what: str) -> str | None:
        """The one-line reason ``what`` cannot run here, or None where it can."""
        return None if self.can(what) else self.refused[what]

    def require(self, what: str) -> None:
        """Raise ``InspectorError`` with the one-line reason where ``what`` cannot run here."""
        if not self.can(what):
            raise InspectorError(self.refused[what])
