"""How long after a step's model work until every visible view shows it (target: <= 50 ms).

GPT-2-small shapes (GPT2Config() defaults: 12 layers x 12 heads, d=64, context 1024), random
weights saved to a temp folder, a ~1018-token prompt of random ids, so T reaches 1024. The
window is the real one (offscreen unless a display is set), with its worker thread.

Measured per step, from the engine's "step" event (end of the forward and decoding) to:
  build   - the worker's Snapshot ready (overview row update, T x T matrix, K/V copies)
  queued  - the GUI thread picks it up
  applied - every view has its new data (setImage, ticks, labels)
  painted - the whole window repainted (a forced repaint of every visible widget: an upper bound
            on what Qt repaints by itself, which is only the regions that changed)
Prints medians (and max) over the measured steps. Not a test: figures depend on the machine.

    python benchmarks/bench_gui.py [--prompt 1018] [--cycles 6]
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(REPO / "tests"))


def build_model(folder: Path) -> Path:
    import tiny_models
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    if (folder / "config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tiny_models.build_tokenizer(folder)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(GPT2Config()).save_pretrained(folder, safe_serialization=True)
    return folder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=1018, help="prompt length in tokens (T ends near 1024)")
    ap.add_argument("--cycles", type=int, default=6, help="extra step-back/step cycles at the end of the context")
    ap.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "gpt-inspector-bench-gpt2small"))
    args = ap.parse_args()

    import numpy as np
    from PySide6.QtCore import QEventLoop
    from PySide6.QtWidgets import QApplication

    from gpt_inspector import Session, load_model
    from gpt_inspector.gui.main_window import MainWindow
    from gpt_inspector.gui.views.common import apply_theme

    folder = build_model(Path(args.model_dir))
    lm = load_model(folder, device="cpu")
    print(f"model: {lm.describe()}")
    ids = np.random.default_rng(0).integers(0, 320, args.prompt).tolist()

    from gpt_inspector.gui import _pyside_fix

    _pyside_fix.install()
    app = QApplication.instance() or QApplication([])
    apply_theme(app)
    win = MainWindow(restore_layout=False)
    win.headless_errors = True  # an error prints instead of waiting on a dialog nobody sees
    win.persist_layout = False
    win.worker.autosave = False  # a benchmark's random prompt is nobody's session to restore
    win.resize(1600, 1000)
    win.show()
    rows: list[tuple[int, float, float, float, float]] = []
    measuring = {"on": False}

    def painted(snap):
        win.grab() if os.environ.get("BENCH_GRAB") else win.repaint()  # synchronous: every visible dock paints now
        t = time.perf_counter()
        if measuring["on"] and snap.t_model_done:
            done, built, applied = win.apply_log[-1]
            rows.append((snap.T, built - done, win._t_received - done, applied - done, t - done))

    ctl = win.controller
    received = ctl.take_snapshot

    def take():  # the controller's snapshot_ready slot looks take_snapshot up at call time
        win._t_received = time.perf_counter()
        received()

    ctl.take_snapshot = take
    win.snapshot_changed.connect(painted)

    def wait():
        # sleep in the event loop until something arrives, as the app's own exec() does: a loop that
        # polls processEvents would keep a core busy and slow the worker it is waiting for
        while win.busy:
            app.processEvents(QEventLoop.ProcessEventsFlag.WaitForMoreEvents)
        app.processEvents()

    t0 = time.perf_counter()
    win.show_source(Session(lm, prompt_ids=ids))
    wait()
    win.select(layer=5, head=3)
    win.step()  # the prefill: every thumbnail row at once
    wait()
    t1 = time.perf_counter()
    print(f"prefill of {len(ids)} tokens + first snapshot: {t1 - t0:.1f} s")
    while win.snapshot.thumb_rows < win.snapshot.T:  # the overview streams in behind; steps are measured after it
        app.processEvents(QEventLoop.ProcessEventsFlag.WaitForMoreEvents)
    print(f"overview complete {time.perf_counter() - t1:.1f} s later (the window stayed responsive)")
    measuring["on"] = True
    while not win.snapshot.finished:
        win.step()
        wait()
    for _ in range(args.cycles):
        measuring["on"] = False
        win.step_back()  # recomputing the cut bin is step-back work, not measured
        wait()
        measuring["on"] = True
        win.step()
        wait()
    win.close()
    if not rows:
        print("no steps measured")
        return 1
    cols = list(zip(*rows))
    ms = lambda xs: f"{statistics.median(xs) * 1000:6.1f} ms (max {max(xs) * 1000:6.1f})"  # noqa: E731
    print(f"measured {len(rows)} steps at T = {min(cols[0])}..{max(cols[0])}, 12 layers x 12 heads, window 1600x1000")
    print(f"  snapshot built (worker)  {ms(cols[1])}")
    print(f"  picked up by GUI thread  {ms(cols[2])}")
    print(f"  every view updated       {ms(cols[3])}")
    print(f"  window repainted         {ms(cols[4])}   <- step end to pixels; target <= 50 ms")
    print(f"load average {os.getloadavg()[0]:.2f} (2 cores shared)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
