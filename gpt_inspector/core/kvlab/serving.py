"""Serving constraints on an eviction policy: when it evicts (its schedule), in what unit (entries or
whole pages, as a paged cache allocates them), and who shares a budget (each KV head, or a layer's
heads together, AdaKV-style). ``policy.Eviction`` holds the settings; the rules are here.

Rules (the README states them the same way):

- **Schedule.** ``step``: cut to the budget after the prompt's forward and after every decode step;
  ``prefill``: after the prompt's forward only (every generated entry is kept); ``N`` (every N
  steps): after the prompt's forward and after decode steps N, 2N, ..., each time down to the
  budget, the cache growing by N - 1 entries in between; ``append``: never (no scoring, just the
  accounting). An accumulating scorer (H2O) adds every forward's score whether or not it evicts.
- **Pages.** With ``page`` S > 1 a KV head's cache is pages of S positions (page i holds positions
  iS .. iS + S - 1) and only whole pages go. A budget of B entries holds B // S pages, the page being
  filled counting as a whole one. Pages are ranked by the mean score of their entries; protected:
  the first ceil(sinks / S) pages, the newest ceil(recent / S) pages and always the page being
  filled (StreamingLLM: every page the sink pages leave of the budget, newest first). Ties go to
  the older page.
- **Shared (AdaKV).** ``share="layer"``: a layer's budget is the sum of its KV heads' budgets, and
  the heads compete for it: each head keeps its protected units and its own best
  floor(safeguard x room) (AdaKV's safeguard, 0.2 as in kvpress), and the layer's remaining room goes
  to the best remaining units of any head (ties: the lower head, then the older unit). A layer
  then holds exactly its budget whenever it evicts.
- **Paged bytes.** Beside the exact bytes, what a paged cache of S-position pages holds: per KV
  head every page with an entry still held counts S entries (``paged_entries``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InspectorError

SCHEDULES = ("step", "prefill", "append")  # or a whole number N: every N decode steps
SHARES = ("head", "layer")
SAFEGUARD = 0.2  # AdaKV's alpha_safeguard (kvpress's default): each head keeps this share of its own room


@dataclass(frozen=True)
class Serving:
    """An eviction policy's schedule, eviction unit and budget sharing (the module's rules)."""

    schedule: str | int = "step"
    page: int = 1
    share: str = "head"

    @classmethod
    def checked(cls, schedule="step", page=None, share="head") -> Serving:
        if page is not None and (isinstance(page, bool) or not isinstance(page, (int, np.integer)) or page < 1):
            raise InspectorError(f"page must be a whole number of positions >= 1, got {page!r}")
        if share not in SHARES:
            raise InspectorError(f"share must be {' or '.join(SHARES)} (layer: AdaKV, a layer's heads share its "
                                 f"budget), got {share!r}")  # fmt: skip
        return cls(check_schedule(schedule), int(page or 1), share)

    def describe(self, name: str, budget: int | None) -> str:
        if self.schedule == "append":
            return f"{name} append-only" + (f", pages of {self.page}" if self.page > 1 else "")
        out = f"{name} budget {'unlimited' if budget is None else budget}"
        if self.schedule != "step":
            out += ", at prefill only" if self.schedule == "prefill" else f", every {self.schedule} steps"
        if self.page > 1:
            out += f", pages of {self.page}"
        return out + (", shared across a layer's heads (AdaKV)" if self.share == "layer" else "")

    def settings(self) -> dict:
        """As the JSON outputs record them."""
        return {"schedule": self.schedule, "page": self.page, "share": self.share}

    def due(self, step: int) -> bool:
        return due(self.schedule, step)

    def check_pages(self, layer: int, low: int, sinks: int, recent: int, recent_is_the_rest: bool) -> None:
        """Refuse a smallest budget ``low`` that leaves no page beyond the protected ones."""
        s = self.page
        pages = low // s
        protected = math.ceil(sinks / s) + (0 if recent_is_the_rest else max(1, math.ceil(recent / s)))
        if pages <= protected:
            raise InspectorError(f"layer {layer}: a budget of {low} entries is {pages} pages of {s}, no room beyond the "
                                 f"{protected} protected pages (sinks, recent window, the page being filled); "
                                 "raise the budget or shrink the page")  # fmt: skip

    def evict(self, ev: torch.Tensor, score: torch.Tensor, budget: torch.Tensor, tk: int, sinks: int,
              recent: list[int], recent_is_the_rest: bool) -> None:  # fmt: skip
        """Evict whole pages, or down to a layer's shared budget, from ``ev`` (Hkv, Tk) long evicted_at
        (in place: an entry evicted now holds ``tk``); ``budget`` (Hkv,) entries, ``recent`` per head."""
        never = torch.iinfo(torch.long).max
        s = self.page
        held, unit_score = page_view(ev == never, score, s)  # (Hkv, U) each
        units = budget // s  # (Hkv,)
        over = held.sum(1) > units  # (Hkv,)
        if not (bool(over.any()) if self.share == "head" else int(held.sum()) > int(units.sum())):
            return
        n = held.shape[1]
        if s > 1 and recent_is_the_rest:  # StreamingLLM: every page the sink pages leave of the budget
            recent = [(int(b) // s - math.ceil(sinks / s)) * s for b in budget]
        protect = torch.stack([protected_units(n, sinks, r, s, s > 1, ev.device) for r in recent])  # (Hkv, U)
        keep = keep_units(held, unit_score, protect, units, self.share == "layer")  # (Hkv, U)
        gone = held & ~keep
        if self.share == "head":
            gone &= over[:, None]
        drop = gone.repeat_interleave(s, 1)[:, :tk] & (ev == never)  # (Hkv, Tk)
        ev[drop] = tk  # masked from the next query position on


def check_schedule(v) -> str | int:
    """``step``, ``prefill``, ``append`` or a whole number N >= 1 (``"4"``, ``"every 4"`` too); N = 1 is ``step``."""
    if isinstance(v, str):
        text = v.strip().lower().removeprefix("every").strip().removesuffix("steps").strip()
        if text in SCHEDULES:
            return text
        try:
            v = int(text)
        except ValueError:
            raise InspectorError(f"schedule must be step, prefill, append or every N steps, got {v!r}") from None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InspectorError(f"schedule must be step, prefill, append or a whole number of steps >= 1, got {v!r}")
    return "step" if v == 1 else int(v)


def due(schedule: str | int, step: int) -> bool:
    """Whether the forward that leaves decode step ``step`` done (0: the prompt's) evicts."""
    if schedule == "append":
        return False
    if step == 0 or schedule == "step":
        return True
    if schedule == "prefill":
        return False
    return step % int(schedule) == 0


def protected_units(n_units: int, sinks: int, recent: int, page: int, newest: bool,
                    device: torch.device | str = "cpu") -> torch.Tensor:  # fmt: skip
    """(n_units,) bool: the first ceil(sinks / page) units, the newest ceil(recent / page) and, with
    ``newest``, the last one (the page being filled)."""
    u = torch.arange(n_units, device=device)
    out = (u < math.ceil(sinks / page)) | (u >= n_units - math.ceil(recent / page))
    if newest and n_units:
        out[-1] = True
    return out


def page_view(held: torch.Tensor, score: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head and page: whether any entry is held, and the mean score of its held entries.

    held (Hkv, T) bool, score (Hkv, T) float64 -> ((Hkv, U) bool, (Hkv, U) float64), U = ceil(T / page).
    """
    hkv, t = held.shape
    u = -(-t // page)
    pad = u * page - t
    h = torch.nn.functional.pad(held, (0, pad)).reshape(hkv, u, page)  # (Hkv, U, S)
    s = torch.nn.functional.pad(score, (0, pad)).reshape(hkv, u, page)
    n = h.sum(-1)  # (Hkv, U)
    mean = (s * h).sum(-1) / n.clamp_min(1)
    return n > 0, mean


def keep_units(held: torch.Tensor, score: torch.Tensor, protect: torch.Tensor, budget: torch.Tensor,
               shared: bool, safeguard: float = SAFEGUARD) -> torch.Tensor:  # fmt: skip
    """(Hkv, U) bool: the units kept of those ``held``, each head (or, ``shared``, the layer) at most
    its ``budget`` (Hkv,) units. ``protect`` (Hkv, U) or (U,) bool; ``score`` (Hkv, U), higher kept."""
    hkv, u = held.shape
    prot = held & protect  # (Hkv, U)
    cand = held & ~prot
    room = (budget - prot.sum(1)).clamp_min(0)  # (Hkv,)
    s = score.masked_fill(~cand, -math.inf)
    order = torch.sort(-s, dim=1, stable=True).indices  # (Hkv, U) best first, ties to the older unit
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(u, device=held.device).expand(hkv, u).contiguous())
    if not shared:
        return prot | (cand & (rank < room[:, None]))
    own = cand & (rank < torch.floor(safeguard * room.double()).long()[:, None])  # each head's safeguard
    left = int(room.sum() - own.sum())
    rest = cand & ~own
    flat = s.masked_fill(~rest, -math.inf).flatten()  # head-major: ties go to the lower head, then the older unit
    grank = torch.empty(flat.numel(), dtype=torch.long, device=held.device)
    grank[torch.sort(-flat, stable=True).indices] = torch.arange(flat.numel(), device=held.device)
    return prot | own | (rest & (grank.reshape(hkv, u) < left))


def paged_entries(held: torch.Tensor, lo: int, page: int) -> int:
    """Entries a paged cache allocates for ``held`` (Hkv, T) bool, positions before ``lo`` not held
    by the model's own cache (a sliding window): per KV head, page size x pages with an entry held."""
    h = held.clone()
    h[:, :lo] = False
    t = h.shape[1]
    u = -(-t // page)
    return int(torch.nn.functional.pad(h, (0, u * page - t)).reshape(h.shape[0], u, page).any(-1).sum()) * page
