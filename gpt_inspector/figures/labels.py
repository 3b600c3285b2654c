"""Labels and colour-bar ticks for the heatmaps: plain text and numpy, no drawing (pooling: core/pooling.py)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np


# ---------------------------------------------------------------------- text
def clean_label(text) -> str:
    """Make any token label drawable and valid inside XML: control characters become visible."""
    out = []
    for ch in str(text):
        o = ord(ch)
        if o < 0x20 or o == 0x7F:
            out.append(f"<0x{o:02X}>")  # the style token labels use for undecodable bytes
        elif 0x80 <= o <= 0x9F or 0xD800 <= o <= 0xDFFF or o in (0xFFFE, 0xFFFF):
            out.append(f"U+{o:04X}")
        else:
            out.append(ch)
    return "".join(out) or "∅"


def _elide(text: str, n: int = 18) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def display_model_name(name) -> str:
    # a local folder's full path says little and can be very long; hub ids stay as they are
    s = str(name)
    if os.path.isabs(s) or s.startswith((".", "~")) or os.sep in s and Path(s).expanduser().exists():
        return Path(s).name or s
    return s


def token_labels(source, t: int) -> list[str]:
    labels = [str(x) for x in list(source.token_labels())[:t]]
    return labels + [str(i) for i in range(len(labels), t)]


def nice_step(x: float, mantissas: tuple[float, ...] = (1.0, 2.0, 5.0)) -> float:
    """The smallest m x 10^e >= x, m one of ``mantissas`` (ascending, in [1, 10)): every tick step.

    The window's axes and the figures' label thinning take every k-th label (1, 2, 5, 10, 20, ...;
    ``int(nice_step(max(1.0, x)))``); the colour bars' value ticks also allow 2.5.
    """
    e = math.floor(math.log10(x))
    for m in mantissas:
        if m * 10.0**e >= x * (1 - 1e-9):
            return m * 10.0**e
    return 10.0 ** (e + 1)


def _ticks(labels: Sequence[str], extent_in: float, fontsize: float, numbered: bool) -> tuple[list[int], list[str]]:
    n = len(labels)
    # every step-th label, so labels a pitch apart get the room their font needs
    pitch, room = extent_in * 72.0 / max(n, 1), fontsize * 1.25
    step = 1 if n <= 1 else int(nice_step(max(1.0, room / pitch)))
    pos = list(range(0, n, step))
    text = [_elide(clean_label(labels[i])) for i in pos]
    if step > 1 and numbered:  # a thinned label says which position it belongs to
        text = [f"{i} {s}" for i, s in zip(pos, text)]
    return pos, text


def ticks(vmin: float, vmax: float, n: int = 5) -> list[tuple[float, str]]:
    """About ``n`` (never fewer than 3) round values inside [vmin, vmax], labelled with just enough decimals."""
    span = vmax - vmin
    if not span > 0:
        return [(vmin, f"{vmin:.4g}")]
    raw = span / max(1, n - 1)
    while True:
        step = nice_step(raw, (1.0, 2.0, 2.5, 5.0))
        e = math.floor(math.log10(step) + 1e-9)
        quarter = round(step / 10.0**e, 6) == 2.5
        decimals = max(0, -e + quarter)  # the decimals its multiples need
        first, last = math.ceil(vmin / step - 1e-9), math.floor(vmax / step + 1e-9)
        if last - first + 1 >= 3:
            break
        raw = step / 2.1  # the next finer round step
    top = max(abs(vmin), abs(vmax))
    compact = top >= 1e5 or decimals > 4
    # significant digits that still tell neighbouring ticks apart
    sig = max(1, math.floor(math.log10(top)) - math.floor(math.log10(step) + 1e-9) + 1 + quarter)
    out = []
    for k in range(first, last + 1):
        v = k * step
        v = 0.0 if abs(v) < step * 1e-9 else v
        out.append((v, f"{v:.{sig}g}" if compact else f"{v:.{decimals}f}"))
    return out


# ---------------------------------------------------------------------- values
def _finite_span(values: np.ndarray, masked: np.ndarray):
    ok = np.isfinite(values) & ~masked
    if not ok.any():
        return None
    shown = values[ok]
    return float(shown.min()), float(shown.max())


def value_range(spans, kind: str | None) -> tuple[float, float]:
    """Probabilities always span [0, 1] so heads compare; other values span what is shown."""
    if kind == "probs":
        return 0.0, 1.0
    spans = [s for s in spans if s is not None]
    if not spans:
        return 0.0, 1.0
    lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
    if hi - lo <= 0:
        pad = max(abs(lo) * 0.05, 0.5)
        return lo - pad, hi + pad
    return lo, hi
