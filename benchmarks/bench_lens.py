"""What the logit lens costs on GPT-2-small shapes, measured side by side in one run.

- recording: Session.step() with the lens's residual hooks installed vs a session on a model
  without them (alternating, same prompt), per decode token;
- computing: lens() for the current step (every layer's residual through the final norm and the
  unembedding, plus the head attribution) against one step.
- in the window (``--window``): the real window with the Logit lens tab in front against behind
  another tab, a step asked for every 1.5 step-times (a user pressing F10 at a brisk pace): the
  time from the press to the step on screen, and a burst of steps asked for at once. The lens runs
  while the worker is idle and gives way to a step within one slice of its unembedding.

    python benchmarks/bench_lens.py [--prompt 32] [--steps 24] [--reps 3] [--window] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--window", action="store_true", help="also step the real window, lens tab in front vs behind")
    args = ap.parse_args()

    from bench_step import build

    import gpt_inspector as gi
    from gpt_inspector.core import lens as lens_mod

    folder = build(Path(tempfile.mkdtemp()) / "gpt2-small-random")
    plain = gi.load_model(folder, device=args.device)
    hooked = gi.load_model(folder, device=args.device)
    lens_mod.enable(hooked)
    ids = torch.randint(0, plain.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    print(f"model: {plain.describe()}; torch threads {torch.get_num_threads()}")

    def per_step(lm) -> float:
        s = gi.Session(lm, prompt_ids=ids)
        s.step()
        t0 = time.perf_counter()
        s.run(args.steps)
        return (time.perf_counter() - t0) / args.steps

    head = hooked.model.get_output_embeddings()
    row = torch.randn(1, head.in_features, device=hooked.device)

    def one_pass() -> float:  # one row through the head: every byte of the (V, D) matrix read once
        with torch.inference_mode():
            head(row)
            _sync(args.device)
            t0 = time.perf_counter()
            for _ in range(5):
                head(row)
            _sync(args.device)
        return (time.perf_counter() - t0) / 5

    a, b, lens_t, floor = [], [], [], []
    for _ in range(args.reps):
        floor.append(one_pass())
        a.append(per_step(plain))
        b.append(per_step(hooked))
        s = gi.Session(hooked, prompt_ids=ids)
        s.run(4)
        t0 = time.perf_counter()
        for _ in range(5):
            lens_mod.lens(s)
        lens_t.append((time.perf_counter() - t0) / 5)
    step, step_h, lt = statistics.median(a), statistics.median(b), statistics.median(lens_t)
    print(
        f"recording the residual: {step_h * 1e3:.1f} vs {step * 1e3:.1f} ms/token, ratio {step_h / step:.3f} (target <= 1.10)"
    )
    print(
        f"lens + attribution for one step: {lt * 1e3:.1f} ms = {lt / step:.2f} x a step "
        f"({plain.n_layers} unembeddings of {plain.vocab_size} tokens)"
    )
    lo = statistics.median(floor)
    print(
        f"floor for any exact lens: one pass over the unembedding matrix, {lo * 1e3:.1f} ms = {lo / step:.2f} x a step "
        f"(every layer's full distribution needs every row of it at least once)"
    )
    if args.window:
        bench_window(hooked, ids, lt, args)


def bench_window(lm, ids, lens_time: float, args) -> None:
    import os

    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    os.environ.setdefault("GPT_INSPECTOR_SETTINGS", str(Path(tempfile.gettempdir()) / "gpt-inspector-bench.ini"))
    from PySide6.QtCore import QEventLoop
    from PySide6.QtWidgets import QApplication

    import gpt_inspector as gi
    from gpt_inspector.gui import _pyside_fix
    from gpt_inspector.gui.main_window import MainWindow

    _pyside_fix.install()
    app = QApplication.instance() or QApplication([])
    win = MainWindow(restore_layout=False)
    win.headless_errors, win.persist_layout, win.worker.autosave = True, False, False
    win.resize(1366, 768)
    win.show()
    shown = {"n": 0, "t": 0.0}

    def on_snap(snap):
        shown["n"], shown["t"] = snap.n_steps, time.perf_counter()

    win.snapshot_changed.connect(on_snap)

    def pump(until) -> None:
        while not until():
            app.processEvents(QEventLoop.ProcessEventsFlag.WaitForMoreEvents, 5)

    def idle() -> None:
        pump(lambda: not win.busy)
        end = time.perf_counter() + 0.05
        pump(lambda: time.perf_counter() > end)

    def paced(front: bool, pause: float) -> float:
        """Median press-to-screen time of steps pressed ``pause`` seconds after the last one showed."""
        win.show_source(gi.Session(lm, prompt_ids=ids))
        idle()
        win.raise_panel(win.lens_panel if front else win.compare_panel)  # compare: a tab that does no work per step
        win.step()
        idle()
        lat = []
        for _ in range(args.steps):
            n, t0 = shown["n"], time.perf_counter()
            win.step()
            pump(lambda: shown["n"] > n)
            lat.append(shown["t"] - t0)
            end = time.perf_counter() + pause
            pump(lambda: time.perf_counter() > end)  # the lens (tab in front) runs in this pause, or part of it
        idle()
        return statistics.median(lat)

    def burst(front: bool) -> float:
        win.show_source(gi.Session(lm, prompt_ids=ids))
        idle()
        win.raise_panel(win.lens_panel if front else win.compare_panel)
        win.step()
        idle()
        n, t0 = shown["n"], time.perf_counter()
        for _ in range(args.steps):  # a burst: every step asked for at once (F10 held down)
            win.step()
        pump(lambda: shown["n"] >= n + args.steps)
        return (time.perf_counter() - t0) / args.steps

    cases = {"burst": burst, "pause 0.5 lens": lambda f: paced(f, 0.5 * lens_time),
             "pause 1.5 lens": lambda f: paced(f, 1.5 * lens_time)}  # fmt: skip
    res = {(c, f): [] for c in cases for f in (False, True)}
    for _ in range(args.reps):
        for c, fn in cases.items():
            for front in (False, True):
                res[c, front].append(fn(front))
    win.close()
    for c in cases:
        behind, front = statistics.median(res[c, False]), statistics.median(res[c, True])
        what = (
            f"{args.steps} steps at once, per step"
            if c == "burst"
            else f"press to screen, {c[6:]}-times after the last step"
        )
        print(f"window, {what}: {front * 1e3:.1f} ms with the lens tab in front, {behind * 1e3:.1f} ms behind, "
              f"ratio {front / behind:.3f} (target <= 1.10)")  # fmt: skip


if __name__ == "__main__":
    main()
