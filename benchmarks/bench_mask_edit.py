"""A mask edit at position 5 of a long run against an HF plain prefill of the same T, side by side.

Issue 15's Llama-style model (8 layers x 8 heads, 2 KV heads, head size 64, float32, random
weights). The Session holds T positions (a T-token prompt and 2 steps); blocking query 5 -> key 2
in every layer and head recomputes positions 5..T-1 over the kept 5-position cache. The reference
(the target's) is transformers' own model (sdpa) prefilling all T positions into an empty cache,
keeping the last logits, as generate's prefill does. Beside it, for comparison with earlier rounds,
HF running only the span 5..T-1 after a 5-position cache (that span forward is itself slower than
the plain prefill: sdpa takes its explicit-mask path once a cache precedes the span). Clearing the
edit (the restore) recomputes the same span and is timed too. Runs alternate so machine noise hits
every side alike; the load average is printed beside each T.

    python benchmarks/bench_mask_edit.py [--t 1024 4096 8192] [--reps 3] [--threads N]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
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
        span = s.tokens[EDIT_AT : s.cache_length]
        with torch.inference_mode():
            head = torch.tensor([s.tokens[:EDIT_AT]])
            rest = torch.tensor([span])
        whole = torch.tensor([s.tokens[: s.cache_length]])
        edit_t, clear_t, hf_t, plain_t = [], [], [], []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            rep = s.set_mask_edits(edit)
            edit_t.append(time.perf_counter() - t0)
            assert rep.earliest_position == EDIT_AT and rep.recomputed == len(span)
            with torch.inference_mode():
                cache = DynamicCache()
                hf_call(hf, cache, input_ids=head, use_cache=True, logits_to_keep=1)
                t0 = time.perf_counter()
                hf_call(hf, cache, input_ids=rest, use_cache=True, logits_to_keep=1)
                hf_t.append(time.perf_counter() - t0)
                del cache
                t0 = time.perf_counter()
                hf_call(hf, DynamicCache(), input_ids=whole, use_cache=True, logits_to_keep=1)
                plain_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            s.clear_mask_edits()
            clear_t.append(time.perf_counter() - t0)
        e, c, h, p = (statistics.median(x) for x in (edit_t, clear_t, hf_t, plain_t))
        print(f"T {s.cache_length:5d}: mask edit at {EDIT_AT} {e:6.2f} s, clear (restore) {c:6.2f} s; HF plain prefill "
              f"of T {p:6.2f} s: ratio edit {e / p:.2f}, clear {c / p:.2f} (target <= 1.1); HF span forward of "
              f"{len(span)} positions after 5 cached {h:6.2f} s ({h / p:.2f}x the plain prefill; edit {e / h:.2f}x it); "
              f"load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
