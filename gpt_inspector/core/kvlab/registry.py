"""Every KV cache policy by name: what the CLI offers, the window's lab lists, a sweep plans and ``make`` builds.

An eviction name maps to its scorer class (``scorers``; the one ``Eviction`` policy runs it), a
quantization name to ``quant``. Built-in classes are named here and imported when a policy is built,
so reading the names imports no torch (the CLI's ``--help``, building the window's panel).
A user's scorer class joins with ``register(cls)`` and is then built by its name like the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import InspectorError

if TYPE_CHECKING:
    from .scorers import Scorer

# name -> the scorer (a class in ``scorers``, or a registered class); "custom" wraps a Python function
SCORERS: dict[str, str | type[Scorer]] = {
    "streaming": "StreamingLLM",
    "h2o": "H2O",
    "snapkv": "SnapKV",
    "tova": "TOVA",
    "keynorm": "KeyNorm",
    "custom": "FunctionScorer",
}
QUANT = ("int8", "int4", "int2", "fp8-e4m3", "fp8-e5m2")
EVICTION = tuple(SCORERS)
NAMES = EVICTION[:-1] + QUANT  # what the CLI offers (custom takes a Python function)

# the options ``make`` passes on, per kind of policy (a sweep gives each policy the ones it takes)
OPTIONS = {
    "eviction": ("sinks", "recent", "window", "kernel", "layer_budgets", "schedule", "page", "share"),
    "quantization": ("group", "residual", "scheme"),
}


def kind(name: str) -> str:
    """ "eviction" or "quantization"; an unknown name is refused in one line."""
    if name in QUANT:
        return "quantization"
    if name in SCORERS:
        return "eviction"
    raise InspectorError(f"unknown policy {name!r}; use one of {', '.join(NAMES)} (or custom with a scorer)")


def takes_budget(name: str) -> bool:
    """Whether the policy is sized by a budget of entries (eviction) rather than by its precision."""
    return kind(name) == "eviction"


def options(name: str) -> tuple[str, ...]:
    """The option names the policy ``name`` takes."""
    return OPTIONS[kind(name)]


def scorer_class(name: str) -> type[Scorer]:
    """The scorer class an eviction policy ``name`` runs."""
    if kind(name) != "eviction":
        raise InspectorError(f"{name} is a quantization, not an eviction policy")
    cls = SCORERS[name]
    if isinstance(cls, str):
        from . import scorers

        cls = SCORERS[name] = getattr(scorers, cls)
    return cls


def register(cls: type) -> type:
    """Make a scorer class (``scorers.Scorer`` with a ``name``) buildable by that name; usable as a decorator."""
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name or name in QUANT:
        raise InspectorError(f"a scorer needs a name of its own to be registered, got {name!r}")
    SCORERS[name] = cls
    return cls
