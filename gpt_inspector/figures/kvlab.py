"""The KV cache lab as figures: a sweep's frontier (cache bytes against KL and against probe
recovery, ``core.kvlab.sweep.SweepResult``) and one lab run's per-step fidelity."""

from __future__ import annotations

import numpy as np
from matplotlib.ticker import FuncFormatter

from .drawing import HeatmapFigure, _new_figure, _style
from .labels import display_model_name

# plain numbers on the log axes: the house style keeps math text off (token labels are text)
_PLAIN = FuncFormatter(lambda v, _: "0" if v == 0 else f"{v:g}")

_COLORS = ["#4285f4", "#db4437", "#f4b400", "#0f9d58", "#ab47bc", "#00acc1", "#ff7043", "#9e9d24", "#5c6bc0", "#8d6e63"]


def frontier_figure(result) -> HeatmapFigure:
    """Two panels sharing the x axis (the policy's cache as a fraction of the full cache): mean
    KL(reference || policy) per step, and the share of prompt tokens the probe recovers."""
    points = result.points()
    probed = any(p["recovered_fraction"] is not None for p in points)
    needled = any("needle_found" in p for p in points)
    n_panels = 1 + probed + needled
    with _style():
        fig = _new_figure(2.6 + 3.2 * n_panels if n_panels > 1 else 6.4, 4.0)
        gs = fig.add_gridspec(1, n_panels, wspace=0.32, left=0.1 if n_panels > 1 else 0.16, right=0.98, top=0.8,
                              bottom=0.14)  # fmt: skip
        axes = [fig.add_subplot(gs[0, i]) for i in range(n_panels)]
        names = list(dict.fromkeys(p["policy"] for p in points))
        for i, name in enumerate(names):
            mine = sorted((p for p in points if p["policy"] == name), key=lambda p: p["bytes_ratio"])
            x = np.array([p["bytes_ratio"] for p in mine])
            color = _COLORS[i % len(_COLORS)]
            marker = "o" if mine[0]["budget"] is not None else "s"
            ys = [np.array([p["mean_kl"] for p in mine])]
            if probed:
                ys.append(
                    np.array([np.nan if p["recovered_fraction"] is None else p["recovered_fraction"] for p in mine])
                )
            if needled:
                ys.append(np.array([p.get("needle_found", np.nan) for p in mine]))
            for ax, y in zip(axes, ys):
                ax.plot(x, y, marker=marker, color=color, label=name, linewidth=1.2, markersize=4)
                for p, xi, yi in zip(mine, x, y):
                    if p["budget"] is not None:
                        ax.annotate(str(p["budget"]), (xi, yi), textcoords="offset points", xytext=(3, 3), fontsize=6,
                                    color=color)  # fmt: skip
        axes[0].set_ylabel("mean KL(reference ‖ policy), nats")
        axes[0].set_yscale("symlog", linthresh=1e-4)
        axes[0].yaxis.set_major_formatter(_PLAIN)
        if probed:
            axes[1].set_ylabel("prompt tokens the cache probe recovers")
            axes[1].set_ylim(-0.03, 1.03)
        if needled:
            # what a user would lose: a fact planted early in the prompt, answered greedily or not
            ref = max((p.get("needle_reference_found", 0.0) for p in points), default=0.0)
            axes[-1].set_ylabel(f"needles answered (full cache: {ref:.0%})")
            axes[-1].set_ylim(-0.03, 1.03)
        for ax in axes:
            ax.set_xlabel("policy cache / full cache (bytes)")
            ax.set_xlim(0, 1.05)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7, loc="upper right")
        fig.heading = f"{display_model_name(result.model_name)} · KV cache policies · {len(result.prompts)} prompt(s), {result.steps} steps"
        fig.subheading = "points labelled by budget (entries per KV head); squares: quantization; teacher-forced"
        fig.suptitle(fig.heading + "\n" + fig.subheading, fontsize=9, x=0.02, ha="left")
        fig.heatmaps, fig.panel_values = [], ys if points else []
    return fig


def lab_figure(lab) -> HeatmapFigure:
    """One lab run: KL per step (log scale) and the bytes ratio, the first divergence marked."""
    h = lab.history
    with _style():
        fig = _new_figure(7.0, 3.6)
        ax = fig.add_axes((0.12, 0.15, 0.74, 0.62))
        idx = np.array([s.index + 1 for s in h])  # steps count from 1, as the window and the commands print them
        kl = np.array([s.kl for s in h])
        ax.plot(idx, kl, marker="o", markersize=3, color="#4285f4", label="KL(reference ‖ policy)")
        ax.set_yscale("symlog", linthresh=1e-4)
        ax.yaxis.set_major_formatter(_PLAIN)
        ax.set_xlabel("step")
        ax.set_ylabel("KL, nats")
        ax2 = ax.twinx()
        ax2.plot(idx, [s.bytes_ratio for s in h], color="#0f9d58", linewidth=1, label="cache bytes / full")
        ax2.set_ylim(0, 1.05)
        ax2.set_ylabel("cache bytes / full")
        lines = ax.get_lines() + ax2.get_lines()
        ax.legend(lines, [x.get_label() for x in lines], fontsize=7, loc="lower right")
        k = None if lab.first_divergence is None else lab.first_divergence + 1
        if k is not None:
            ax.axvline(k, color="#db4437", linestyle="--", linewidth=1)
            ax.annotate(f"top-1 differs from step {k}", (k, 0.95), xycoords=("data", "axes fraction"), fontsize=7,
                        color="#db4437", xytext=(3, 0), textcoords="offset points")  # fmt: skip
        fig.heading = f"{display_model_name(lab.lm.name)} · {lab.policy.describe()}"
        fig.subheading = f"{len(h)} steps, {'free-running' if lab.free_running else 'teacher-forced'}"
        fig.suptitle(fig.heading + "\n" + fig.subheading, fontsize=9, x=0.02, ha="left")
        fig.heatmaps, fig.panel_values = [], [kl]
    return fig
