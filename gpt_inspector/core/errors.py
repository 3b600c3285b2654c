"""The one error type every front door knows how to present (CLI: exit 2, window: a dialog)."""


class InspectorError(ValueError):
    """A problem the user can fix: bad input, a missing model, a corrupt file.

    Front doors show ``str(err)`` as-is, so messages are one line and say what to do.
    """


class StepFailed(RuntimeError):
    """A fault inside the model's forward pass; the session is left at its last good step."""

    def __init__(self, message: str, remedy: str = ""):
        super().__init__(message + (f" ({remedy})" if remedy else ""))
        self.remedy = remedy


def check_index(value, n: int, what: str) -> int:
    """``value`` as an int in [0, n), or an InspectorError naming ``what`` (layer, head, ...)."""
    import numpy as np

    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < n:
        raise InspectorError(f"{what} must be in [0, {n}), got {value!r}")
    return int(value)


class Cancelled(InspectorError):
    """The user stopped a long recompute; everything is exactly as it was before it began."""
