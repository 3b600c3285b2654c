"""One small class per eviction method: a score per cache entry (higher kept) and what it needs to see.

The shape of kvpress's ``ScorerPress``: a scorer declares what it reads of a forward (this forward's
attention rows: which ones; the keys) and how its policy protects entries by default (sinks, a
recent window); ``score(seen)`` returns one number per KV head and entry. Everything else (budgets,
protected entries, when to evict, batching a decode step's layers into one pass, step back) is the
one policy's (``policy.Eviction``), so a new method is a class here and a line in ``registry``.

A scorer marked ``batched`` is written for any number of leading dimensions: on a decode step the
policy stacks its layers in front and scores them in one call (per layer, a dozen tiny tensor
operations cost mostly their fixed overhead). A user's scorer may be written for one layer only:
leave ``batched`` False.

GQA convention: a budget counts entries per KV head, query heads sharing a KV head share its
evictions, and scores read from attention are summed over the group (``group_sum``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InspectorError


@dataclass
class Seen:
    """What one forward showed a scorer: one layer, or (the batched pass) several stacked in front."""

    layer: int | list[int]  # the layer, or the layers along the first dimension
    keys: torch.Tensor | None  # (..., Hkv, Tk, d) each KV head's keys, if the scorer reads them
    attention: torch.Tensor | None  # (..., H, n, Tk) float32: the rows the scorer's ``rows`` chose, if it reads them
    shape: tuple[int, ...]  # (..., Hkv, Tk): the shape of the scores to return
    device: torch.device


def group_sum(x: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """(..., H, Tk) -> (..., Hkv, Tk): summed over the query heads that read one KV head."""
    return x.reshape(*x.shape[:-2], n_kv_heads, -1, x.shape[-1]).sum(-2)


class Scorer:
    """Base: one eviction method's rule. Subclasses set the fields they need and write ``score``."""

    name = ""
    needs_attention = False  # reads this forward's attention probabilities (the rows ``rows`` picks)
    reads_keys = False  # reads the keys
    prompt_only = False  # scores once, after the prompt's forward; later entries are all kept (SnapKV)
    accumulates = False  # each forward's score adds to the last ones (H2O); the policy keeps the sum
    batched = False  # ``score`` takes leading dimensions (see the module's docstring)
    trusted = False  # a built-in rule; a user's scorer has its output checked and its errors made one line
    recent_is_the_rest = False  # the recent window is what the sinks leave of the budget (StreamingLLM)
    options: tuple[str, ...] = ()  # the policy options its constructor takes, by keyword

    def rows(self, tq: int) -> range:
        """The query rows of a forward of ``tq`` queries whose attention it reads (default: all)."""
        return range(tq)

    def default_sinks(self, low_budget: int) -> int:
        """First entries always kept when the user names none; ``low_budget``: the smallest budget."""
        return 0

    def default_recent(self, budget: int, sinks: int) -> int:
        """Newest entries always kept when the user names none."""
        return 0

    def score(self, seen: Seen) -> torch.Tensor:
        """(..., Hkv, Tk) float64, higher kept."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class StreamingLLM(Scorer):
    """StreamingLLM (Xiao et al. 2023): attention sinks and a window of the newest entries; position alone decides."""

    name = "streaming"
    batched = trusted = recent_is_the_rest = True

    def default_sinks(self, low_budget: int) -> int:
        return min(4, low_budget - 1)  # its 4 attention sinks, fewer under a tiny budget

    def default_recent(self, budget: int, sinks: int) -> int:
        return budget - sinks

    def score(self, seen: Seen) -> torch.Tensor:
        return torch.zeros(seen.shape, dtype=torch.float64, device=seen.device)


class H2O(Scorer):
    """H2O (Zhang et al. 2023): heavy hitters, the most attention received so far, beside a recent half."""

    name = "h2o"
    needs_attention = accumulates = batched = trusted = True

    def default_recent(self, budget: int, sinks: int) -> int:
        return budget // 2

    def score(self, seen: Seen) -> torch.Tensor:
        # this forward's attention received, summed over its queries (the policy adds it to the sum so far)
        assert seen.attention is not None  # the policy passes attention to a scorer that needs_attention
        return group_sum(seen.attention.sum(-2), seen.shape[-2]).double()  # (..., Hkv, Tk)


class TOVA(Scorer):
    """TOVA (Oren et al. 2024): keep the entries the newest query attends to most."""

    name = "tova"
    needs_attention = batched = trusted = True

    def rows(self, tq: int) -> range:
        return range(tq - 1, tq)

    def score(self, seen: Seen) -> torch.Tensor:
        assert seen.attention is not None  # the policy passes attention to a scorer that needs_attention
        return group_sum(seen.attention[..., -1, :], seen.shape[-2]).double()  # (..., Hkv, Tk)


class KeyNorm(Scorer):
    """Key norm (Devoto et al. 2024): a low L2 norm of the key goes with high attention; keep the lowest."""

    name = "keynorm"
    reads_keys = batched = trusted = True

    def score(self, seen: Seen) -> torch.Tensor:
        assert seen.keys is not None  # the policy passes keys to a scorer that reads_keys
        return -seen.keys.double().norm(dim=-1)  # (..., Hkv, Tk)


class SnapKV(Scorer):
    """SnapKV (Li et al. 2024): the prompt's last ``window`` queries vote (attention pooled over ``kernel``
    neighbours); the prompt is cut to the budget once, the window itself kept, generated entries all kept."""

    name = "snapkv"
    needs_attention = prompt_only = trusted = True
    options = ("window", "kernel")

    def __init__(self, window: int = 8, kernel: int = 5):
        self.window, self.kernel = window, kernel

    def rows(self, tq: int) -> range:
        return range(max(0, tq - self.window), tq)

    def default_recent(self, budget: int, sinks: int) -> int:
        return self.window

    def score(self, seen: Seen) -> torch.Tensor:
        p = seen.attention  # (H, n, Tk)
        assert p is not None  # the policy passes attention to a scorer that needs_attention
        s = group_sum(p.sum(1), seen.shape[0]).double()  # (Hkv, Tk) observation-window votes
        tk = seen.shape[1]
        n = max(0, tk - p.shape[1])  # the prefix before the window (the window itself is kept)
        kern = max(1, self.kernel)
        pooled = torch.zeros_like(s)
        if n:  # pooled over the prefix only, as SnapKV does, so the window's own votes do not bleed in
            pooled[:, :n] = F.avg_pool1d(s[:, None, :n], kern, stride=1, padding=kern // 2,
                                         count_include_pad=False)[:, 0, :n]  # fmt: skip
        return pooled


# a user scoring function: (layer, keys (Hkv, T, d), probs (H, Tq, T) of this forward) -> (Hkv, T), higher keeps
ScoreFunction = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


class FunctionScorer(Scorer):
    """``custom``: a plain function ``scorer(layer, keys, probs) -> (Hkv, T)`` as a scorer, layer by layer."""

    name = "custom"
    needs_attention = reads_keys = True
    options = ("scorer",)

    def __init__(self, scorer: ScoreFunction | None = None):
        if not callable(scorer):
            raise InspectorError("the custom policy needs a scoring function: scorer(layer, keys, probs) -> (Hkv, T)")
        self.fn = scorer

    def score(self, seen: Seen) -> torch.Tensor:
        # a custom scorer is not batched (one layer at a time) and needs both keys and attention
        assert isinstance(seen.layer, int) and seen.keys is not None and seen.attention is not None
        return self.fn(seen.layer, seen.keys, seen.attention)


def checked(scorer: Scorer, seen: Seen) -> torch.Tensor:
    """A user's scorer called on copies of what it sees, its result checked: (Hkv, Tk) float64, finite."""
    mine = Seen(seen.layer, None if seen.keys is None else seen.keys.detach().clone(),
                None if seen.attention is None else seen.attention.detach().clone(), seen.shape, seen.device)  # fmt: skip
    try:
        out = scorer.score(mine)
    except Exception as e:  # noqa: BLE001  (user code may raise anything; it becomes one clear message)
        raise InspectorError(f"the scoring function raised {type(e).__name__}: {e}") from None
    if not isinstance(out, torch.Tensor):
        out = torch.as_tensor(np.asarray(out))
    if tuple(out.shape) != tuple(seen.shape):
        raise InspectorError(f"the scoring function returned shape {tuple(out.shape)}; "
                             f"expected (kv_heads, positions) = {tuple(seen.shape)}")  # fmt: skip
    out = out.detach().to(seen.device, torch.float64)
    if not bool(torch.isfinite(out).all()):
        raise InspectorError("the scoring function returned NaN or infinite scores")
    return out
