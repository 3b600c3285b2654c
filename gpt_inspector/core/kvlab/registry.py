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

# each built-in policy's rule in one paragraph: what it ranks and over what unit, how scores are pooled,
# which entries are protected, when it runs, and the kvpress-compatible variant (``presses``, run with
# ``from_press``). The README's KV cache lab section and the window's policy picker show these texts.
RULES = {
    "streaming": "Position alone decides, per KV head: the first `sinks` entries (default 4, fewer under a "
    "tiny budget) and the newest budget − sinks are kept. Runs after the prompt's forward and after every "
    "step. kvpress-compatible: `presses.StreamingLLMPress` (the same rule, once, on the context at prefill, "
    "to a compression ratio).",
    "h2o": "Ranks each entry per KV head by the attention it has received, summed over every query so far "
    "(all forwards) and over the query heads sharing the KV head; a recent window of budget / 2 is "
    "protected, no sinks. Runs after the prompt's forward and after every step. kvpress has no H2O; its "
    "nearest is `presses.ObservedAttentionPress` (the context's attention averaged over the queries that "
    "could see each entry and over the group, once at prefill, no recent window).",
    "snapkv": "Ranks each prompt entry per KV head by the attention of the prompt's last `window` (8) "
    "queries, summed over the window and the group, average-pooled over `kernel` (5) neighbours of the "
    "prefix without counting padding; the window itself is protected. Runs once, after the prompt's "
    "forward; generated entries are all kept. kvpress-compatible: `presses.SnapKVPress` (mean over the "
    "window and the group, padding counted in the pooling, window 64 by default).",
    "tova": "Ranks entries per KV head by the newest query's attention, summed over the query heads "
    "sharing the KV head; nothing protected. Runs after the prompt's forward and after every step. "
    "kvpress-compatible: `presses.TOVAPress` (one ranking for the whole layer, the last context query's "
    "attention averaged over all query heads, the last entry always kept, once at prefill).",
    "keynorm": "Ranks entries per KV head by minus the L2 norm of the key (a low norm goes with high "
    "attention), in float64; nothing protected. Runs after the prompt's forward and after every step. "
    "kvpress-compatible: `presses.KnormPress` (the same rank in float32, once at prefill, to a ratio).",
    "custom": "Ranks entries per KV head by your function `scorer(layer, keys, probs) -> (kv_heads, T)` "
    "over each forward's attention and keys, with the sinks and recent window you name; runs after every "
    "forward. A kvpress-style press runs instead with `from_press(press)`.",
}
QUANT_RULE = ("Quantization, no eviction: KIVI-style (keys per channel over groups of `group` tokens, values "
              "per token over groups of `group` channels, min-max rounding; the newest `residual` entries in "
              "full precision), or `--scheme transformers`: transformers' `QuantizedCache` with quanto, step "
              "for step; fp8 casts each element. The prompt's forward attends in full precision.")  # fmt: skip


def rule(name: str) -> str:
    """The one-paragraph rule of the policy ``name`` (a quantization's: the shared one)."""
    return QUANT_RULE if kind(name) == "quantization" else RULES.get(name, "a registered scorer of your own")


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
