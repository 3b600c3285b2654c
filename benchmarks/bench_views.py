"""The views at long contexts: first overview, per-step view update, a mask edit and a grid export.

Llama-style GQA model (8 layers x 8 heads, 2 KV heads, head size 64, random weights, float32),
a prompt of random ids so the cache holds T positions. Headless: the view model the window's
worker runs (``gui.viewdata.ViewModel``) and the figures the exports write; no Qt.

Per T it prints, side by side:
  prefill              the model's own forward over the prompt (for scale; not view work)
  overview: first      the first snapshot (the build adds a budget of rows, the rest streams)
            readable   every thumbnail bin has rows (refinement order: a few rows of every bin first)
            complete   every query row in (exact); capped at --cap seconds, else the share done
            one pass   the old way, every row at once, for comparison (only T <= --one-pass-max)
  step view update     ViewModel.build after a step (median of --steps): the per-step cost of the views
  mask edit at pos 5   Session.set_mask_edits (engine recompute) and the first snapshot after it
  grid export          whole-model grid figure + PNG bytes (pooled, labelled), and the one-pass way
  one-head export      layer 5 head 3 as PNG / SVG / PDF at scale 2: pooled (the default) and full resolution
                       (every T x T cell, figures.fullres), side by side: time, peak memory, image and file size
  window               the real window (offscreen, its worker): step end -> every view applied -> repainted
                       (``--window-steps``, 0 to skip), the per-step view update above plus the window's own work
with peak resident memory above the level before each operation (VmHWM after a reset of it; see PeakRSS).

    python benchmarks/bench_views.py [--lengths 1024,4096,8192] [--steps 8] [--window-steps 4] [--cap 120] [--only-head-export]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("GPT_INSPECTOR_SETTINGS", str(Path(tempfile.gettempdir()) / "gpt-inspector-bench.ini"))
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def build_model(folder: Path, context: int, layers: int = 8) -> Path:
    """Issue 15's Llama-style benchmark model (8 layers x 8 heads over 2 KV heads, head size 64) in
    ``folder``, built once; ``layers`` fewer where a benchmark needs only a head or two."""
    import tiny_models
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if (folder / "config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tok = tiny_models.build_tokenizer(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1376, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=context,
                      bos_token_id=len(tok) - 1, eos_token_id=len(tok) - 1)  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder, safe_serialization=True)
    return folder


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


class PeakRSS:
    """Peak resident memory above the level at entry: the kernel's own high-water mark (VmHWM).

    Writing 5 to /proc/self/clear_refs resets VmHWM to the current RSS, so the peak is the kernel's
    count of pages in use at the worst moment: memory the allocator frees and reuses within the
    operation counts, which a sampler can miss. Where the reset is refused, RSS is sampled every 2 ms.
    """

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm = True
        except OSError:
            self.hwm = False
        self.base = self.peak = self._rss()
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        if not self.hwm:
            self._t.start()
        return self

    def _rss(self) -> int:
        return _status_kb("VmRSS") * 1024

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop = True
        if self.hwm:
            self.peak = _status_kb("VmHWM") * 1024
        else:
            self._t.join()
            self.peak = max(self.peak, self._rss())

    @property
    def mb(self) -> float:
        return (self.peak - self.base) / 2**20


def window_steps(session, steps: int, cap: float, layer: int = 5, head: int = 3, view_model=None,
                 extras: bool = False) -> dict[str, float]:  # fmt: skip
    """Step ``session`` in the real window: medians of step end -> built / applied / repainted (seconds).

    The window's overview (and the selected head's pooled matrix) streams in first (at most ``cap``
    seconds), as a user would wait for it. ``view_model``: a ViewModel of ``session`` already built
    (its overview complete) for the worker to take over instead of streaming it again. ``extras``:
    also, after the steps, a head switch (select -> the new head's first picture painted) and a zoom
    to the newest 256 x 256 cells, up to 512 on the long side (the view range set -> their exact
    tile painted, the matrix's own 120 ms settle included), and the GUI thread's longest stall while
    the window streamed (a 20 ms timer's longest late tick): whether it answered input. Also the GUI
    thread's own share per step (``gui_apply``: snapshot taken -> every view applied; ``gui_paint``:
    the forced repaint) and, while streaming, the share of time it spent applying and repainting
    snapshots (``stream_gui``) and its longest such stretch (``stream_gui_max``).
    """
    from PySide6.QtCore import QEventLoop, QTimer
    from PySide6.QtWidgets import QApplication

    from gpt_inspector.gui import _pyside_fix
    from gpt_inspector.gui import worker as worker_mod
    from gpt_inspector.gui.main_window import MainWindow
    from gpt_inspector.gui.views.common import apply_theme

    _pyside_fix.install()
    app = QApplication.instance() or QApplication([])
    apply_theme(app)
    made = worker_mod.ViewModel
    if view_model is not None:  # the worker builds its view model on showing the session: hand it this one
        worker_mod.ViewModel = lambda obj, *a, **k: view_model if obj is session else made(obj, *a, **k)
    win = MainWindow(restore_layout=False)
    win.headless_errors, win.persist_layout, win.worker.autosave = True, False, False
    win.resize(1600, 1000)
    win.show()
    rows: list[tuple[float, float, float, float, float]] = []
    measuring = {"on": False}
    painted_at: list[tuple[float, object]] = []
    taken: dict = {"at": 0.0}
    whole: list[float] = []  # step end -> painted with the step's overview row (it may follow the picture)
    gui: list[float] = []  # the GUI thread's apply + repaint of each snapshot while the matrix streams
    take = win.controller.take_snapshot

    def timed_take():  # the GUI thread takes the snapshot: its own work starts here
        taken["at"] = time.perf_counter()
        take()

    win.controller.take_snapshot = timed_take

    def painted(snap):
        win.repaint()  # synchronous: every visible dock paints now
        t = time.perf_counter()
        painted_at.append((t, snap))
        done, built, applied = win.apply_log[-1]
        gui.append(t - taken["at"])
        if measuring["on"] and snap.t_model_done:
            if snap.state_version != taken.get("version"):  # a step's first picture (later ones: its overview row)
                taken["version"] = snap.state_version
                rows.append((built - done, applied - done, t - done, applied - taken["at"], t - applied))
            if snap.thumb_rows >= snap.T and snap.state_version != taken.get("whole"):
                taken["whole"] = snap.state_version
                whole.append(t - done)

    win.snapshot_changed.connect(painted)
    stall = {"last": time.perf_counter(), "max": 0.0}

    def tick():
        now = time.perf_counter()
        stall["max"] = max(stall["max"], now - stall["last"] - 0.02)
        stall["last"] = now

    timer = QTimer(interval=20)
    timer.timeout.connect(tick)

    def wait():
        while win.busy:
            app.processEvents(QEventLoop.ProcessEventsFlag.WaitForMoreEvents)
        app.processEvents()

    def until(ok, limit):
        t0 = time.perf_counter()
        while not ok() and time.perf_counter() - t0 < limit:
            app.processEvents(QEventLoop.ProcessEventsFlag.WaitForMoreEvents)
        return time.perf_counter() - t0

    try:
        win.show_source(session)
        wait()
        win.select(layer=layer, head=head)
        wait()
        timer.start()
        stall["last"] = time.perf_counter()
        gui.clear()
        streamed = until(lambda: win.snapshot.thumb_rows >= win.snapshot.T
                         and win.snapshot.scores.matrix_rows >= win.snapshot.T, cap)  # fmt: skip
        timer.stop()
        out = {"streamed": streamed, "stall": stall["max"] if streamed > 0.1 else float("nan"),
               "stream_gui": sum(gui) / streamed if streamed > 0.1 else float("nan"),
               "stream_gui_max": max(gui, default=float("nan"))}  # fmt: skip
        measuring["on"] = True
        for _ in range(steps):
            win.step()
            wait()
        until(lambda: win.snapshot.thumb_rows >= win.snapshot.T, cap)  # rows a step's picture left to idle slices
        measuring["on"] = False
        if extras:
            other = (head + 1) % session.n_heads
            t0 = time.perf_counter()
            win.select(layer=layer, head=other)
            until(lambda: painted_at and painted_at[-1][1].selection.head == other, cap)
            out["switch"] = painted_at[-1][0] - t0
            t, n0 = win.snapshot.T, len(painted_at)
            t0 = time.perf_counter()
            # 256 x 256 asked: the matrix keeps its aspect, so the dock's shape widens one side (to <= 512)
            win.score_matrix.plot.setRange(xRange=(t - 256, t), yRange=(t - 256, t), padding=0)
            until(lambda: any(snap.scores.tile is not None for _, snap in painted_at[n0:]), cap)
            out["zoom"] = next((at for at, snap in painted_at[n0:] if snap.scores.tile is not None), float("nan")) - t0
    finally:
        worker_mod.ViewModel = made
        win.close()
    cols = list(zip(*rows)) or [[float("nan")]] * 5
    out.update(built=statistics.median(cols[0]), applied=statistics.median(cols[1]),
               painted=statistics.median(cols[2]), painted_max=max(cols[2]),
               gui_apply=statistics.median(cols[3]), gui_paint=statistics.median(cols[4]),
               overview_row=statistics.median(whole) if whole else float("nan"))  # fmt: skip
    return out


def head_exports(s, layer: int = 5, head: int = 3, scale: float = 2.0) -> None:
    """One head to PNG, SVG and PDF, pooled (the default) and at full resolution, side by side."""
    from gpt_inspector import export

    with tempfile.TemporaryDirectory() as folder:
        for fmt in ("png", "svg", "pdf"):
            out = {}
            for full in (False, True):
                path = Path(folder) / f"head-{int(full)}.{fmt}"
                with PeakRSS() as mem:
                    t0 = time.perf_counter()
                    export.render_heatmap(s, layer, head, "probs", path, scale=scale, full_resolution=full)
                    out[full] = (time.perf_counter() - t0, mem.mb, path.stat().st_size / 2**20)
            (tp, mp, sp), (tf, mf, sf) = out[False], out[True]
            size = ""
            if fmt == "png":
                import struct

                w, h = struct.unpack(">II", (Path(folder) / "head-1.png").read_bytes()[16:24])
                size = f" · full-resolution image {w}x{h} px"
            print(f"  one head ({fmt.upper()}): pooled {tp:.2f} s, +{mp:.0f} MB, {sp:.1f} MB file · full resolution "
                  f"{tf:.2f} s, +{mf:.0f} MB, {sf:.1f} MB file ({tf / tp:.1f}x the time){size}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,4096,8192")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument(
        "--cap", type=float, default=120.0, help="seconds the complete overview may take before it is cut short"
    )
    ap.add_argument("--window-steps", type=int, default=4, help="steps timed in the real window (0: skip)")
    ap.add_argument("--one-pass-max", type=int, default=4096, help="largest T for the old one-pass figures")
    ap.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "gpt-inspector-bench-llama-gqa"))
    ap.add_argument(
        "--only-head-export", action="store_true", help="time only the one-head exports (pooled vs full resolution)"
    )
    args = ap.parse_args()

    import numpy as np
    import torch

    from gpt_inspector import MaskEdit, Session, figures, load_model
    from gpt_inspector.figures import drawing
    from gpt_inspector.gui.viewdata import Selection, ViewModel, full_thumbnails

    lengths = [int(x) for x in args.lengths.split(",")]
    lm = load_model(build_model(Path(args.model_dir), 16384), device="cpu")
    print(f"model: {lm.describe()}; torch threads {torch.get_num_threads()}; load {os.getloadavg()[0]:.2f}")
    rows = []
    for T in lengths:
        ids = np.random.default_rng(0).integers(0, lm.vocab_size - 1, T - args.steps - 1).tolist()
        s = Session(lm, prompt_ids=ids)
        t0 = time.perf_counter()
        s.step()
        prefill = time.perf_counter() - t0
        if args.only_head_export:
            print(f"\nT = {s.cache_length}: prefill {prefill:.1f} s")
            head_exports(s)
            del s
            continue
        sel = Selection(layer=5, head=3)
        vm = ViewModel(s)
        with PeakRSS() as mem_ov:
            t0 = time.perf_counter()
            vm.build(sel)
            first = time.perf_counter() - t0
            th = vm.thumbs
            readable = None
            while not (th.counts[: th.bins] > 0).all():
                vm.refine(deadline=time.perf_counter() + 0.1)
            readable = time.perf_counter() - t0
            while not vm.refine(deadline=time.perf_counter() + 0.5) and time.perf_counter() - t0 < args.cap:
                pass
            complete = time.perf_counter() - t0
            share = th.rows_done / th.T
        one_pass = None
        if T <= args.one_pass_max:
            t1 = time.perf_counter()
            full_thumbnails(s)
            one_pass = time.perf_counter() - t1
        vm.refine()  # complete (if the cap cut it short) before the steps are timed
        step_times, view_times = [], []
        with PeakRSS() as mem_step:
            for _ in range(args.steps):
                t1 = time.perf_counter()
                s.step()
                t2 = time.perf_counter()
                vm.build(sel)
                step_times.append(t2 - t1)
                view_times.append(time.perf_counter() - t2)
        with PeakRSS() as mem_edit:
            t1 = time.perf_counter()
            s.set_mask_edits([MaskEdit(5, 2)])
            t2 = time.perf_counter()
            vm.build(sel)
            edit_view = time.perf_counter() - t2
            edit_engine = t2 - t1
        with PeakRSS() as mem_grid:
            t1 = time.perf_counter()
            fig = figures.grid_figure(s, None, "probs")
            figures.to_bytes(fig, "png")
            grid = time.perf_counter() - t1
            note = fig.subheading.split(" · ", 2)[-1]
            figures.close(fig)
        grid_old = None
        if T <= args.one_pass_max:
            saved = drawing.LONG_GRID_CELLS
            drawing.LONG_GRID_CELLS = 1 << 62  # the per-head (T, T) path every grid took before
            try:
                t1 = time.perf_counter()
                fig = figures.grid_figure(s, None, "probs")
                figures.to_bytes(fig, "png")
                grid_old = time.perf_counter() - t1
                figures.close(fig)
            finally:
                drawing.LONG_GRID_CELLS = saved
        win = None
        if args.window_steps:
            win = window_steps(s, args.window_steps, args.cap)
        rows.append(dict(win=win, T=s.cache_length, prefill=prefill, first=first, readable=readable, complete=complete,
                         share=share, one_pass=one_pass, mem_ov=mem_ov.mb, step=statistics.median(step_times),
                         view=statistics.median(view_times), view_max=max(view_times), mem_step=mem_step.mb,
                         edit_engine=edit_engine, edit_view=edit_view, mem_edit=mem_edit.mb, grid=grid,
                         grid_old=grid_old, mem_grid=mem_grid.mb, note=note))  # fmt: skip
        del vm
        r = rows[-1]
        fmt = lambda x: "-" if x is None else f"{x:.2f} s"  # noqa: E731
        print(f"\nT = {r['T']}: prefill {r['prefill']:.1f} s")
        print(f"  overview: first snapshot {r['first']:.2f} s · readable (every bin) {r['readable']:.2f} s · "
              f"complete {r['complete']:.1f} s ({100 * r['share']:.0f}% of rows) · one pass, old way {fmt(r['one_pass'])}"
              f" · peak +{r['mem_ov']:.0f} MB")  # fmt: skip
        print(
            f"  per step: view update {1000 * r['view']:.1f} ms median (max {1000 * r['view_max']:.1f}) "
            f"vs the model's step {1000 * r['step']:.0f} ms · peak +{max(0.0, r['mem_step']):.0f} MB"
        )
        if win is not None:
            print(f"  window: step end -> snapshot built {1000 * win['built']:.0f} ms, applied {1000 * win['applied']:.0f} "
                  f"ms, repainted {1000 * win['painted']:.0f} ms median (max {1000 * win['painted_max']:.0f})")  # fmt: skip
        print(
            f"  mask edit at position 5: engine {r['edit_engine']:.2f} s, first snapshot after it "
            f"{r['edit_view']:.2f} s (the rest streams) · peak +{r['mem_edit']:.0f} MB"
        )
        print(
            f"  grid export (PNG): {r['grid']:.2f} s vs old way {fmt(r['grid_old'])} · peak +{r['mem_grid']:.0f} MB · {r['note']}"
        )
        head_exports(s)
        del s
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f} (2 cores shared)")
    if not rows:
        return 0
    print(
        "| T | first overview (readable / complete) | per-step view update | step end -> repainted (window) "
        "| mask edit: engine / view | grid export |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        r["painted"] = "-" if r["win"] is None else f"{1000 * r['win']['painted']:.0f} ms"
        print(
            f"| {r['T']:,} | {r['readable']:.2f} s / {r['complete']:.1f} s ({100 * r['share']:.0f}%), +{r['mem_ov']:.0f} MB "
            f"| {1000 * r['view']:.0f} ms | {r['painted']} "
            f"| {r['edit_engine']:.1f} s / {r['edit_view']:.2f} s | {r['grid']:.2f} s, +{r['mem_grid']:.0f} MB |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
