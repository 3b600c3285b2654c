"""One head at full resolution, old (the whole T x T in memory) vs streamed (row bands), side by side.

A Llama-style GQA model (2 layers x 8 heads over 2 KV heads, head size 64: bench_views.py's layer
shape, fewer layers), random weights, a prompt of random ids so the cache holds T positions; the run
is saved as a trace once per T. Each export then runs in a child process of its own that loads the
trace, warms matplotlib up on a small figure, resets its peak (VmHWM, via /proc/self/clear_refs)
and writes one head, so every row's peak is the export's alone:

  old       figures.head_figure(..., full_resolution=True) + figures.save: the cells as one
            (T, T, 4) buffer, the figure drawn whole (Agg's canvas; matplotlib's SVG and PDF writers);
            with --old-tree DIR, that checkout's render_heatmap(..., full_resolution=True) instead
  streamed  export.render_heatmap(..., full_resolution=True): figures.stream, the cells computed and
            written in row bands

Per T and format it prints time, peak added resident memory (VmHWM above the level before) and the
file size of each, and the ratios; with --compare, whether the two PNGs decode to the same pixels.

    python benchmarks/bench_export.py [--lengths 4096] [--with-16k] [--kinds probs] [--formats png,svg,pdf] [--old-tree DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from bench_views import build_model  # noqa: E402  # the benchmarks' Llama-style model, here with 2 layers

LAYER, HEAD, SCALE = 1, 3, 2.0


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def child(trace: str, fmt: str, way: str, kind: str, out: str, tree: str) -> None:
    """One export in this process; prints {"s": seconds, "mb": peak added MiB, "file_mb": ...} as JSON.

    ``tree``: the checkout whose gpt_inspector runs the old way (its render_heatmap, before streaming).
    """
    if way == "old" and tree:
        sys.path.insert(0, tree)
    from gpt_inspector import export, figures, load_trace

    src = load_trace(trace)
    dpi = SCALE * figures.DPI
    warm = Path(out).with_name("warm." + fmt)  # fonts, matplotlib's caches: not the export's memory
    export.render_heatmap(src, 0, 0, kind, warm, scale=SCALE)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _status_kb("VmRSS")
    t0 = time.perf_counter()
    if way == "old" and tree:
        export.render_heatmap(src, LAYER, HEAD, kind, out, scale=SCALE, full_resolution=True)
    elif way == "old":
        fig = figures.head_figure(src, LAYER, HEAD, kind, dpi=dpi, full_resolution=True, vector=fmt != "png")
        try:
            figures.save(fig, out, dpi)
        finally:
            figures.close(fig)
    else:
        export.render_heatmap(src, LAYER, HEAD, kind, out, scale=SCALE, full_resolution=True)
    seconds = time.perf_counter() - t0
    print(
        json.dumps({"s": seconds, "mb": (_status_kb("VmHWM") - base) / 1024, "file_mb": os.path.getsize(out) / 2**20})
    )


def run_child(trace: Path, fmt: str, way: str, kind: str, out: Path, tree: str) -> dict:
    cmd = [sys.executable, __file__, "--child", str(trace), fmt, way, kind, str(out), tree]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def same_png(a: Path, b: Path) -> bool:
    import numpy as np
    from matplotlib.image import imread

    x, y = imread(a), imread(b)
    return x.shape == y.shape and bool(np.array_equal(x, y))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096")
    ap.add_argument("--with-16k", action="store_true", help="add T = 16,384 (minutes, and the old PDF takes ~6 GB)")
    ap.add_argument("--kinds", default="probs", help="comma-separated: probs needs one pass, the rest two")
    ap.add_argument("--formats", default="png,svg,pdf")
    ap.add_argument("--compare", action="store_true", help="decode both PNGs and compare (T <= 8192)")
    ap.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "gpt-inspector-bench-export-llama"))
    ap.add_argument(
        "--old-tree",
        default="",
        help="a checkout from before streaming (its render_heatmap is the old way); "
        "default: this tree's in-memory figure (head_figure + save)",
    )
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return 0

    import numpy as np

    from gpt_inspector import Session, load_model
    from gpt_inspector.core.trace import save_trace

    lengths = [int(x) for x in args.lengths.split(",")] + ([16384] if args.with_16k else [])
    lm = load_model(build_model(Path(args.model_dir), 16384 + 64, layers=2), device="cpu")
    print(
        f"model: {lm.describe()}; layer {LAYER} head {HEAD}, scale {SCALE:g}; old way: {args.old_tree or 'this tree'}"
    )
    with tempfile.TemporaryDirectory() as folder:
        for T in lengths:
            ids = np.random.default_rng(0).integers(0, lm.vocab_size - 1, T).tolist()
            s = Session(lm, prompt_ids=ids)
            t0 = time.perf_counter()
            s.step()  # the prefill: T positions in the cache (the last one the step's)
            trace = save_trace(s, Path(folder) / f"t{T}.safetensors")
            print(f"\nT = {s.cache_length}: prefill + trace {time.perf_counter() - t0:.1f} s, "
                  f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
            del s
            for kind in args.kinds.split(","):
                for fmt in args.formats.split(","):
                    r = {w: run_child(trace, fmt, w, kind, Path(folder) / f"{w}.{fmt}", args.old_tree)
                         for w in ("old", "streamed")}  # fmt: skip
                    if any("error" in x for x in r.values()):
                        print(
                            f"  {kind} {fmt.upper()}: "
                            + "; ".join(f"{w}: {x.get('error', 'ok')}" for w, x in r.items())
                        )
                        continue
                    o, n = r["old"], r["streamed"]
                    same = ""
                    if args.compare and fmt == "png" and T <= 8192:
                        same = (
                            " · same pixels"
                            if same_png(Path(folder) / "old.png", Path(folder) / "streamed.png")
                            else " · PIXELS DIFFER"
                        )
                    print(f"  {kind} {fmt.upper()}: old {o['s']:.1f} s, +{o['mb']:.0f} MB, {o['file_mb']:.1f} MB file · "
                          f"streamed {n['s']:.1f} s, +{n['mb']:.0f} MB, {n['file_mb']:.1f} MB file · "
                          f"streamed/old: time {n['s'] / o['s']:.2f}x, peak {n['mb'] / max(o['mb'], 1e-9):.2f}x, "
                          f"file {n['file_mb'] / o['file_mb']:.2f}x{same} (load {os.getloadavg()[0]:.1f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
