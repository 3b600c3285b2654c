"""The cache probe's layer-0 search in model steps' worth per probed position, shared vs reference, side by side.

Issue 15's Llama-style model (8 layers x 8 heads, 2 KV heads, head size 64, 32,000-token
vocabulary, random weights) and GPT-2-small shapes (50,257 tokens, learned positions: the shared
search does not apply there, so it runs the reference). For each: a session of ``--positions``
cached positions, the median decode step of that session (the unit), then the probe with the shared
search and with the reference search forced, alternating, with the load average beside each.

    python benchmarks/bench_probe.py [--positions 8] [--reps 1] [--family llama-gqa gpt2] [--threads N]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--positions", type=int, default=8)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--family", nargs="+", default=["llama-gqa", "gpt2"])
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import bench_step

    import gpt_inspector as gi
    from gpt_inspector.core import probe

    for family in args.family:
        root = Path(tempfile.mkdtemp())
        folder = bench_step.build_llama_gqa(root / "m", 1024) if family == "llama-gqa" else bench_step.build(root / "m")
        lm = gi.load_model(folder, device="cpu")
        ids = torch.randint(0, 300, (args.positions - 4,), generator=torch.Generator().manual_seed(0)).tolist()
        s = gi.Session(lm, prompt_ids=[i for i in ids if i not in lm.eos_token_ids])
        s.step()
        steps = []
        while s.cache_length < args.positions:
            t0 = time.perf_counter()
            s.step()
            steps.append(time.perf_counter() - t0)
        step = statistics.median(steps)
        real = probe.position_map
        times: dict[str, list[float]] = {"shared": [], "reference": []}
        results = {}
        chunks = math.ceil(lm.vocab_size / min(lm.vocab_size, 8192))  # the shared search's vocabulary pass
        fixed: list[float] = []
        for _ in range(args.reps):
            for name in ("shared", "reference"):
                probe.position_map = real if name == "shared" else (lambda *a: None)  # type: ignore[assignment]
                load = os.getloadavg()[0]
                t0 = time.perf_counter()
                marks: list[float] = []
                results[name] = probe.probe_session(s, progress=lambda d, t: marks.append(time.perf_counter())).layer(0)
                times[name].append(time.perf_counter() - t0)
                if name == "shared":
                    fixed.append(marks[chunks - 1] - t0)  # through the vocabulary pass, before any position
                print(f"  {family} {name}: {times[name][-1]:.2f} s (load {load:.2f})", flush=True)
        probe.position_map = real
        same = [p.token_id for p in results["shared"].positions] == [p.token_id for p in results["reference"].positions]
        same = same and [p.runner_up_id for p in results["shared"].positions] == [
            p.runner_up_id for p in results["reference"].positions
        ]
        n = s.cache_length
        sh, ref = statistics.median(times["shared"]), statistics.median(times["reference"])
        fx = statistics.median(fixed)
        print(
            f"{family}: vocabulary {lm.vocab_size}, {n} positions, step {1000 * step:.1f} ms; per position: shared "
            f"{sh / n / step:.1f} steps' worth ({fx / step:.1f} steps once for the vocabulary pass, then "
            f"{(sh - fx) / n / step:.2f} per position), reference {ref / n / step:.1f} (ratio {sh / ref:.2f}); "
            f"same tokens and runner-ups: {same}; load {os.getloadavg()[0]:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
