"""Long contexts (8k / 16k / 32k): every ratio of issue 31's item 1, side by side per T. Opt-in: ``--run``.

The Llama-style model of ``bench_views.py`` (8 layers x 8 heads over 2 KV heads, head size 64,
random weights, float32), a prompt of random ids so the cache holds T positions. Per T, in one
process, each figure with the load average when it was taken (2 shared cores here: read the ratios):
  HF prefill           transformers' own model (sdpa) over the T-token prompt: the reference, run once
  overview             ViewModel (the worker's view model): first snapshot, readable (every bin has
                       rows), complete (every row; capped at --cap), each / the HF prefill
  per-step update      ViewModel.build after Session.step: median of --steps, / the model's step
  head switch          the same layer, another head: first snapshot (the picture readable), and its
                       pooled matrix complete
  zoom                 a 512 x 512 exact tile at the newest rows: first snapshot
  window               the real MainWindow (offscreen) with its worker, taking over the view model
                       above (its overview is not streamed twice): step end -> every view applied ->
                       window repainted (a forced repaint of every visible widget), median of
                       --window-steps; then a head switch and a zoom to the newest 256 x 256 cells,
                       select / view range set -> painted; and the GUI thread's longest stall while
                       the selected head's pooled matrix streamed in; the GUI thread's own apply and
                       repaint per step (bench_paint.py sets them beside the way before gui.paint).
                       Skipped with --no-window. With --softmax-ab, the window runs twice more, the
                       softmax rows drawing every key (as before they drew block maxima) and then
                       block maxima, side by side
Targets (issue 31): view update <= 0.5x a step, step end -> repainted <= 50 ms, overview readable
<= 2 s and complete <= 1x the HF prefill, head switch and zoom <= 0.5 s to a readable picture.
Not a test: minutes at 16k (about 15 on this machine under load) and more at 32k; ``--t`` runs one T.

    python benchmarks/bench_long.py --run [--t 16384 | --lengths 8192,16384,32768] [--steps 4] [--cap 300] [--no-window]
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
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(Path(__file__).resolve().parent)]


def load() -> str:
    return f"load {os.getloadavg()[0]:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="store_true", help="run it (without: print this help and exit)")
    ap.add_argument("--lengths", default="8192,16384,32768")
    ap.add_argument("--t", type=int, help="one T only (overrides --lengths): a run that fits the time")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--window-steps", type=int, default=4)
    ap.add_argument("--cap", type=float, default=300.0, help="seconds the complete overview may take")
    ap.add_argument("--no-window", action="store_true")
    ap.add_argument("--softmax-ab", action="store_true", help="window with the softmax rows' every key vs block maxima")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    ap.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "gpt-inspector-bench-llama-gqa-32k"))
    args = ap.parse_args()
    if not args.run:
        ap.print_help()
        return 0

    import numpy as np
    import torch
    from bench_views import build_model, window_steps
    from transformers import AutoModelForCausalLM

    from gpt_inspector import Session, load_model
    from gpt_inspector.core.hf import DynamicCache
    from gpt_inspector.core.hf import call as hf_call
    from gpt_inspector.gui.viewdata import Selection, ViewModel

    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [args.t] if args.t else [int(x) for x in args.lengths.split(",")]
    folder = build_model(Path(args.model_dir), max(32768, max(lengths)) + 64)
    lm = load_model(folder, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    print(f"model: {lm.describe()}; torch threads {torch.get_num_threads()}; {load()}", flush=True)
    table = []
    for T in lengths:
        ids = np.random.default_rng(0).integers(0, lm.vocab_size - 1, T - args.steps - 1).tolist()
        with torch.inference_mode():
            t0 = time.perf_counter()
            hf_call(hf, DynamicCache(), input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
            hf_prefill = time.perf_counter() - t0
        ld_hf = load()
        s = Session(lm, prompt_ids=ids)
        t0 = time.perf_counter()
        s.step()
        prefill = time.perf_counter() - t0
        print(f"\nT = {s.cache_length}: HF prefill {hf_prefill:.1f} s ({ld_hf}), Session prefill {prefill:.1f} s "
              f"({prefill / hf_prefill:.2f}x); {load()}", flush=True)  # fmt: skip
        r = {"T": T, "hf": hf_prefill}
        sel = Selection(layer=5, head=3)
        vm = ViewModel(s)
        t0 = time.perf_counter()
        vm.build(sel)
        first = time.perf_counter() - t0
        th = vm.thumbs
        while not (th.counts[: th.bins] > 0).all():
            vm.refine(deadline=time.perf_counter() + 0.1)
        readable, readable_rows = time.perf_counter() - t0, th.rows_done
        while not vm.refine(deadline=time.perf_counter() + 0.5) and time.perf_counter() - t0 < args.cap:
            pass
        complete, share = time.perf_counter() - t0, th.rows_done / th.T
        r["overview"] = (readable, complete / hf_prefill, share, load())
        print(f"  overview: first {first:.2f} s, readable {readable:.2f} s ({readable_rows} rows of {th.bins} bins; "
              f"{readable / hf_prefill:.2f}x HF prefill), "
              f"complete {complete:.1f} s ({100 * share:.0f}% of rows; {complete / hf_prefill:.2f}x HF prefill); "
              f"{load()}", flush=True)  # fmt: skip
        vm.refine()
        step_t, view_t = [], []
        for _ in range(args.steps):
            t1 = time.perf_counter()
            s.step()
            t2 = time.perf_counter()
            vm.build(sel)
            step_t.append(t2 - t1)
            view_t.append(time.perf_counter() - t2)
        step, view = statistics.median(step_t), statistics.median(view_t)
        r["view"] = (view / step, load())
        print(f"  per step: view update {1000 * view:.0f} ms vs model step {1000 * step:.0f} ms: "
              f"{view / step:.2f}x; {load()}", flush=True)  # fmt: skip
        t1 = time.perf_counter()
        vm.build(Selection(layer=5, head=4))
        switch_first = time.perf_counter() - t1
        while not vm.refine(deadline=time.perf_counter() + 0.5) and time.perf_counter() - t1 < args.cap:
            pass
        switch_done = time.perf_counter() - t1
        t = s.cache_length
        t1 = time.perf_counter()
        vm.build(Selection(layer=5, head=4, view=(t - 512, t, t - 512, t)))
        zoom = time.perf_counter() - t1
        r["switch"] = (switch_first, switch_done, zoom, load())
        print(f"  head switch: first picture {switch_first:.2f} s, pooled matrix complete {switch_done:.2f} s; "
              f"zoom to 512 x 512 exact cells {zoom:.2f} s; {load()}", flush=True)  # fmt: skip
        r["win"] = None
        if not args.no_window:
            win = window_steps(s, args.window_steps, args.cap, view_model=vm, extras=True)
            r["win"] = (win, load())
            print(f"  window: pooled matrix streamed in {win['streamed']:.1f} s, GUI thread's longest stall meanwhile "
                  f"{1000 * win['stall']:.0f} ms (busy {100 * win['stream_gui']:.0f}% of the time applying and "
                  f"repainting); step end -> built {1000 * win['built']:.0f} ms, applied "
                  f"{1000 * win['applied']:.0f} ms, repainted {1000 * win['painted']:.0f} ms (max "
                  f"{1000 * win['painted_max']:.0f}; the GUI thread's own apply {1000 * win['gui_apply']:.1f} ms + "
                  f"repaint {1000 * win['gui_paint']:.1f} ms); head switch -> painted {win['switch']:.2f} s, zoom -> "
                  f"exact cells painted {win['zoom']:.2f} s; {load()}", flush=True)  # fmt: skip
        if args.softmax_ab and not args.no_window:
            import gpt_inspector.gui.views.softmax_rows as rows_mod

            saved = rows_mod.BARS_PER_PIXEL
            for name, per_pixel in (("every key", 1e12), ("block maxima", saved)):
                rows_mod.BARS_PER_PIXEL = per_pixel
                ab = window_steps(s, args.window_steps, args.cap, view_model=vm)
                print(f"  window, softmax rows {name}: step end -> applied {1000 * ab['applied']:.0f} ms, repainted "
                      f"{1000 * ab['painted']:.0f} ms (max {1000 * ab['painted_max']:.0f}); {load()}", flush=True)  # fmt: skip
            rows_mod.BARS_PER_PIXEL = saved
        table.append(r)
        del vm, s
    print("\n| T | HF prefill | view update / step | step end -> repainted (window) | overview readable / complete "
          "vs HF prefill | head switch: first / complete (view model); painted (window) | zoom: view model; "
          "window | GUI stall while streaming |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        rd, cp, share, ld_o = r["overview"]
        sf, sd, zm, ld_s = r["switch"]
        w, ld_w = r["win"] if r["win"] is not None else ({}, "")
        ms = lambda k: "-" if k not in w else f"{1000 * w[k]:.0f} ms"  # noqa: E731
        sec = lambda k: "-" if k not in w else f"{w[k]:.2f} s"  # noqa: E731
        print(f"| {r['T']:,} | {r['hf']:.0f} s | {r['view'][0]:.2f}x ({r['view'][1]}) | {ms('painted')} ({ld_w}) "
              f"| {rd:.2f} s / {cp:.2f}x ({100 * share:.0f}%) ({ld_o}) | {sf:.2f} s / {sd:.1f} s; {sec('switch')} "
              f"({ld_s}) | {zm:.2f} s; {sec('zoom')} | {ms('stall')} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
