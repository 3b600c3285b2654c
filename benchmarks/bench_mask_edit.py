"""A mask edit at position 5 of a long run against an HF plain prefill of the same T, side by side.

Issue 15's Llama-style model (8 layers x 8 heads, 2 KV heads, head size 64, float32, random
weights). The Session holds T positions (a T-token prompt and 2 steps); blocking query 5 -> key 2
in every layer and head recomputes positions 5..T-1 over the kept 5-position cache, in chunks of
1,024. The reference (the target's, <= 1.1x) is transformers' own model (sdpa) prefilling all T
positions into an empty cache, keeping the last logits, as generate's prefill does. Clearing the
edit (the restore) recomputes the same span and is timed too. Each rep runs plain, edit, plain,
clear: every edit and clear sits between two prefills, and its ratio is taken against their mean,
so the machine's load hits both sides alike; the medians of those ratios are printed with the load
average, in wall time and in the process's CPU time (steadier on a shared machine with one torch
thread). ``--span`` adds HF's forward of the span 5..T-1 after a 5-position cache (the reference of
rounds before 2026-11-28; sdpa takes its explicit-mask path there).

    python benchmarks/bench_mask_edit.py [--t 1024 4096 8192] [--reps 3] [--threads N] [--span]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# this checkout's package and test helpers, not whichever gpt_inspector the environment installed
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

EDIT_AT = 5


def _timed(fn) -> tuple[float, float]:
    """(wall, process CPU) seconds of fn()."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    ap.add_argument("--span", action="store_true", help="also time HF's forward of the span after a 5-position cache")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import bench_step
    from transformers import AutoModelForCausalLM, DynamicCache

    import gpt_inspector as gi
    from gpt_inspector.core.hf import call as hf_call

    folder = bench_step.build_llama_gqa(Path(tempfile.mkdtemp()) / "llama-gqa-random", max(args.t) + 64)
    lm = gi.load_model(folder, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    print(f"model: {lm.describe()}; torch threads {torch.get_num_threads()}", flush=True)
    g = torch.Generator().manual_seed(0)
    edit = [gi.MaskEdit(query=EDIT_AT, key=2)]
    for t in args.t:
        ids = [i for i in torch.randint(0, 300, (t - 2,), generator=g).tolist() if i not in lm.eos_token_ids]
        s = gi.Session(lm, prompt_ids=ids)
        s.run(3)  # T positions in the cache
        whole = torch.tensor([s.tokens[: s.cache_length]])
        head, rest = torch.tensor([s.tokens[:EDIT_AT]]), torch.tensor([s.tokens[EDIT_AT : s.cache_length]])

        def plain():
            with torch.inference_mode():
                hf_call(hf, DynamicCache(), input_ids=whole, use_cache=True, logits_to_keep=1)

        def do_edit():
            rep = s.set_mask_edits(edit)
            assert rep.earliest_position == EDIT_AT and rep.recomputed == s.cache_length - EDIT_AT

        times: dict[str, list[tuple[float, float]]] = {"plain": [], "edit": [], "clear": [], "span": []}
        ratios: dict[str, list[tuple[float, float]]] = {"edit": [], "clear": [], "span": []}
        for _ in range(args.reps):
            p0 = _timed(plain)
            times["edit"].append(_timed(do_edit))
            p1 = _timed(plain)
            times["clear"].append(_timed(s.clear_mask_edits))
            p2 = _timed(plain)
            times["plain"] += [p0, p1, p2]
            for name, around in (("edit", (p0, p1)), ("clear", (p1, p2))):
                ratios[name].append(tuple(x / ((a + b) / 2) for x, a, b in zip(times[name][-1], *around)))
            if args.span:
                with torch.inference_mode():
                    cache = DynamicCache()
                    hf_call(hf, cache, input_ids=head, use_cache=True, logits_to_keep=1)
                    times["span"].append(
                        _timed(lambda: hf_call(hf, cache, input_ids=rest, use_cache=True, logits_to_keep=1))
                    )
                    del cache
                ratios["span"].append(tuple(x / y for x, y in zip(times["span"][-1], p2)))

        def med(xs, i):
            return statistics.median(x[i] for x in xs)

        line = [f"T {s.cache_length:5d}: HF plain prefill {med(times['plain'], 0):6.2f} s wall"]
        for name in ("edit", "clear", "span") if args.span else ("edit", "clear"):
            line.append(f"{name} {med(times[name], 0):6.2f} s, ratio {med(ratios[name], 0):.2f} wall / "
                        f"{med(ratios[name], 1):.2f} CPU (reps {', '.join(f'{r[0]:.2f}' for r in ratios[name])})")  # fmt: skip
        print("; ".join(line) + f"; target <= 1.1; load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
