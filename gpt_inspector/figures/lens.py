"""The logit lens as a figure: the chosen token's probability after every layer, the layers' top
tokens, and each head's direct push on the chosen token (``core.lens.LensResult``)."""

from __future__ import annotations

import matplotlib
import numpy as np
from matplotlib.colors import TwoSlopeNorm

from .drawing import HeatmapFigure, _new_figure, _style
from .labels import clean_label, display_model_name


def lens_figure(result, model_name: str = "", *, top: int = 3, unverified: str | None = None) -> HeatmapFigure:
    """Two panels: p(chosen) per layer with each layer's top tokens written beside it, and the
    L x H attribution map (diverging, zero at white) when the architecture has one.

    ``unverified``: why the model failed its fidelity self-test; drawn as a red band on top."""
    L = len(result.layers)
    has_map = result.attribution is not None
    H = result.attribution.shape[1] if has_map else 0
    with _style():
        band = 0.3 if unverified else 0.0  # inches for the UNVERIFIED band
        h_in = max(3.0, 0.42 * L + 1.9) + band
        fig = _new_figure(9.0 if has_map else 6.0, h_in)
        gs = fig.add_gridspec(
            1,
            2 if has_map else 1,
            width_ratios=[1.4, 1] if has_map else [1],
            wspace=0.45,
            left=0.1,
            right=0.93,
            top=1 - (0.85 + band) / h_in,
            bottom=0.6 / h_in,
        )  # headings' room
        ax = fig.add_subplot(gs[0, 0])
        probs = np.array([x.prob for x in result.layers])
        ax.barh(np.arange(L), probs, color="#4285f4")
        ax.set_xlim(0, 1.6)
        ax.set_ylim(L - 0.5, -0.5)
        ax.set_yticks(np.arange(L), [f"layer {i}" for i in range(L)])
        ax.set_xticks([0, 0.5, 1.0])
        ax.set_xlabel(f"p({clean_label(result.label)}) through each layer's lens")
        for i, x in enumerate(result.layers):
            words = ", ".join(f"{clean_label(e.label)} {e.prob:.2f}" for e in x.top[:top])
            ax.text(1.02, i, words, va="center", fontsize=7, color="#333333")
        fig.heatmaps, fig.panel_values = [], [probs]
        if has_map:
            a = np.asarray(result.attribution, dtype=np.float64)
            m = float(np.abs(a).max()) or 1.0
            ax2 = fig.add_subplot(gs[0, 1])
            im = ax2.imshow(a, cmap=matplotlib.colormaps["RdBu_r"], norm=TwoSlopeNorm(0.0, -m, m), aspect="auto")
            ax2.set_xticks(np.arange(H), [str(h) for h in range(H)])
            ax2.set_yticks(np.arange(L), [str(i) for i in range(L)])
            ax2.set_xlabel("head")
            ax2.set_ylabel("layer")
            cb = fig.colorbar(im, ax=ax2, fraction=0.08, pad=0.04)
            cb.set_label("direct push on the logit")
            fig.heatmaps, fig.panel_values = [ax2], [probs, a]
        name = f"{display_model_name(model_name)} · " if model_name else ""
        fig.heading = f"{name}logit lens · step {result.step + 1} · position {result.position} · chose {clean_label(result.label)}"
        fig.subheading = (f"heads' sum {float(result.attribution.sum()):+.3f}, everything else {result.remainder:+.3f}; "
                          + result.note) if has_map else result.note  # fmt: skip
        fig.suptitle(fig.heading + "\n" + fig.subheading, fontsize=9, x=0.02, ha="left", y=0.98 - band / h_in,
                     va="top")  # fmt: skip
        if unverified:
            fig.text(0.02, 1 - 0.04 / h_in, clean_label(f"UNVERIFIED: these numbers may not be the model's own ({unverified})")[:160],
                     ha="left", va="top", fontsize=9, weight="bold", color="white",
                     bbox={"boxstyle": "square,pad=0.3", "facecolor": "#b00020", "edgecolor": "none"})  # fmt: skip
            fig.unverified = unverified
        fig.row_labels = [f"layer {i}" for i in range(L)]
        fig.col_labels = [str(h) for h in range(H)]
    return fig
