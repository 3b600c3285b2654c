"""The window's own work at long T: the worker's build after a step and its ready pixels against before.

Issue 31's Llama-style model (``bench_views.build_model``; ``--layers 2`` for a quicker run: the
window's work depends on T, not on the layer count, except the overview's thumbnails), a prompt of
random ids so the cache holds T positions, the view model's overview complete first (as
``bench_long.py`` does). Then the real window (offscreen, its worker) in two modes, alternating,
``--reps`` times each, in one process on the same session:
  before   ``--before build`` (the default): the worker's build after a step as it was, the step's
           overview row computed before the picture and the KV cache view pooled whole at each build,
           a zoom's tile behind a streamed slice and a chunk of the pooled matrix (``before_build``);
           ``--before paint``: that, and the worker publishes each build as it is and the images are
           pyqtgraph's ImageItem's own (``paint.prepare`` and ``ColourImage.render`` swapped back):
           every view re-set on every snapshot, the score matrix's NaN cells located at each new
           matrix on the GUI thread; the token axes measure every label again and the label-less
           axes keep pyqtgraph's SI prefix (the KV cache's title, now set only when it changes, stays)
  now      the step's picture first (its overview row in the next idle slice), the cache view's new
           rows pooled; ``paint.prepare``: unchanged parts kept, the pixels made by the worker
Per mode (medians over the reps): step end -> snapshot built / applied / repainted, and repainted
with the step's overview row, the GUI thread's own apply and repaint per step, and while the selected head's pooled matrix streams in the GUI
thread's longest stall (a 20 ms timer's latest tick) and the share of the time it spent applying and
repainting; a head switch -> painted; a zoom -> exact cells painted. With the load average.

    python benchmarks/bench_paint.py [--t 16384] [--layers 8] [--steps 4] [--reps 2] [--cap 120]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("GPT_INSPECTOR_SETTINGS", str(Path(tempfile.gettempdir()) / "gpt-inspector-bench.ini"))
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(Path(__file__).resolve().parent)]


@contextlib.contextmanager
def before_build():
    """The worker's build after a step as it was: the step's overview row computed before the picture
    (``build``'s ``defer`` ignored), the KV cache view's whole cache pooled again at every build, the
    score matrix's row block that the old T cut through computed whole again, a zoom's build adding
    a chunk of a pooled matrix still streaming in, a streamed slice run before a command posted
    after it was queued."""
    from gpt_inspector.core import pooling
    from gpt_inspector.gui import viewdata
    from gpt_inspector.gui import worker as worker_mod

    def kv_pooled(self, layer, keys, values, block, plain):
        return tuple(viewdata.pool_rows(viewdata._heads_side_by_side(x), block) for x in (keys, values))

    vm, w, pm = viewdata.ViewModel, worker_mod.Worker, pooling.PooledMatrix
    saved = vm.build, vm._kv_pooled, vm._pooled_matrix, w._refine_slice, pm.update

    def update(self, source, budget=None):  # the whole row block the old T cut through computed again
        self.done = min(self.done, self.T // self.block * self.block)
        return saved[4](self, source, budget)

    def refine_slice(self):
        self._dispatched = self._serial  # no command seen waiting
        return saved[3](self)

    vm.build = lambda self, selection=None, defer=False: saved[0](self, selection)
    vm._kv_pooled = kv_pooled
    vm._pooled_matrix = lambda self, layer, head, kind, hurry=False: saved[2](self, layer, head, kind)
    w._refine_slice = refine_slice
    pm.update = update
    try:
        yield
    finally:
        vm.build, vm._kv_pooled, vm._pooled_matrix, w._refine_slice, pm.update = saved


@contextlib.contextmanager
def before_paint():
    """The window as it was before gui.paint: every build published as it is, ImageItem's own render."""
    import pyqtgraph as pg

    from gpt_inspector.gui import paint
    from gpt_inspector.gui.views import common, kv_cache, qkv, score_matrix, softmax_rows
    from gpt_inspector.gui.views.image import ColourImage

    def set_labels(self, labels) -> None:  # as it was: every label measured again at each step
        labels = list(labels)
        if labels != self.labels:
            self.labels = labels
            self.longest = max(map(len, labels), default=1)
            self.picture = None
            self.update()

    views = (kv_cache, qkv, score_matrix, softmax_rows)
    saved = paint.prepare, ColourImage.render, common.TokenAxis.set_labels, [m.unprefixed for m in views]
    paint.prepare = lambda prev, snap: snap
    ColourImage.render = pg.ImageItem.render
    common.TokenAxis.set_labels = set_labels
    for m in views:
        m.unprefixed = lambda *plots: None  # pyqtgraph's SI prefixes left on
    try:
        with before_build():
            yield
    finally:
        paint.prepare, ColourImage.render, common.TokenAxis.set_labels = saved[:3]
        for m, fn in zip(views, saved[3]):
            m.unprefixed = fn


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--cap", type=float, default=120.0, help="seconds a streamed matrix may take")
    ap.add_argument("--before", choices=("build", "paint"), default="build",
                    help="what 'before' restores: the worker's build after a step, or that and gui.paint")  # fmt: skip
    args = ap.parse_args()

    import numpy as np
    from bench_views import build_model, window_steps

    from gpt_inspector import Session, load_model
    from gpt_inspector.gui.viewdata import Selection, ViewModel

    name = "gpt-inspector-bench-llama-gqa-32k" if args.layers == 8 else f"gpt-inspector-bench-llama-gqa-{args.layers}l"
    folder = build_model(Path(tempfile.gettempdir()) / name, max(32768, args.t) + 64, layers=args.layers)
    lm = load_model(folder, device="cpu")
    layer = min(5, args.layers - 1)
    ids = np.random.default_rng(0).integers(0, lm.vocab_size - 1, args.t - 1 - args.steps * 2 * args.reps).tolist()
    s = Session(lm, prompt_ids=ids)
    t0 = time.perf_counter()
    s.step()
    print(f"model: {lm.describe()}; T = {s.cache_length}, prefill {time.perf_counter() - t0:.1f} s", flush=True)
    vm = ViewModel(s)
    vm.build(Selection(layer=layer, head=3))
    while not vm.refine(deadline=time.perf_counter() + 0.5):
        pass
    got: dict[str, list[dict]] = {"before": [], "now": []}
    for rep in range(args.reps):
        for mode in ("before", "now") if rep % 2 == 0 else ("now", "before"):
            undo = before_build if args.before == "build" else before_paint
            with undo() if mode == "before" else contextlib.nullcontext():
                w = window_steps(s, args.steps, args.cap, layer=layer, view_model=vm, extras=True)
            w["load"] = os.getloadavg()[0]
            got[mode].append(w)
            print(f"  {mode:6s} T={s.cache_length}: step end -> built {1000 * w['built']:.0f} / applied "
                  f"{1000 * w['applied']:.0f} / repainted {1000 * w['painted']:.0f} ms (max "
                  f"{1000 * w['painted_max']:.0f}), with its overview row {1000 * w['overview_row']:.0f} ms; GUI thread: apply "
                  f"{1000 * w['gui_apply']:.1f} ms, repaint {1000 * w['gui_paint']:.1f} ms; streaming "
                  f"{w['streamed']:.1f} s: longest stall {1000 * w['stall']:.0f} ms, GUI busy "
                  f"{100 * w['stream_gui']:.0f}% (longest {1000 * w['stream_gui_max']:.0f} ms); switch "
                  f"{w['switch']:.2f} s, zoom {w['zoom']:.2f} s; load {w['load']:.1f}", flush=True)  # fmt: skip
    keys = (
        "built",
        "applied",
        "painted",
        "overview_row",
        "gui_apply",
        "gui_paint",
        "stall",
        "stream_gui",
        "switch",
        "zoom",
        "load",
    )
    med = {m: {k: statistics.median(w[k] for w in runs) for k in keys} for m, runs in got.items()}
    print(
        "\n| median of reps | step end -> built / applied / repainted | + overview row | GUI apply / repaint per step | "
        "stall while streaming | GUI busy while streaming | switch -> painted | zoom -> exact cells | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for m, r in med.items():
        print(f"| {m} | {1000 * r['built']:.0f} / {1000 * r['applied']:.0f} / {1000 * r['painted']:.0f} ms | "
              f"{1000 * r['overview_row']:.0f} ms | "
              f"{1000 * r['gui_apply']:.1f} / {1000 * r['gui_paint']:.1f} ms | {1000 * r['stall']:.0f} ms | "
              f"{100 * r['stream_gui']:.0f}% | {r['switch']:.2f} s | {r['zoom']:.2f} s | {r['load']:.1f} |")  # fmt: skip
    b, n = med["before"], med["now"]
    print(f"now / before: repainted {n['painted'] / b['painted']:.2f}x, GUI apply + repaint "
          f"{(n['gui_apply'] + n['gui_paint']) / (b['gui_apply'] + b['gui_paint']):.2f}x, stall {n['stall'] / b['stall']:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
