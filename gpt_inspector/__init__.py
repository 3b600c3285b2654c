"""gpt-inspector: a step-through debugger for GPT-style language models.

    >>> import gpt_inspector as gi
    >>> lm = gi.load_model()                     # the embedded demo model
    >>> s = gi.Session(lm, "She eats apple")
    >>> s.run(5); s.attention(0, 1, "probs")     # (T, T) numpy
"""

from .core import (
    DEMO_MODEL,
    InspectorError,
    LoadedModel,
    MaskEdit,
    Session,
    Step,
    StepFailed,
    Trace,
    load_model,
    load_trace,
    save_trace,
)
from .core.compare import Comparison, compare

__version__ = "0.1.0"


__all__ = [
    "Comparison", "DEMO_MODEL", "InspectorError", "LoadedModel", "MaskEdit", "Session", "Step", "StepFailed", "Trace",
    "compare", "load_model", "load_trace", "save_trace",
]  # fmt: skip
