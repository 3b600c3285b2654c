"""Trace file size against the KV cache it describes, GPT-2-small shapes (or the GQA Llama) at T = 1,024.

GPT2Config() defaults (124M parameters, random weights; ``--family llama-gqa``: issue 15's model, 8
heads over 2 KV heads, where q per query head alone is 2x the cache), a prompt of ``T - new`` tokens and
``new`` generated steps, float32 on the CPU. Prints the file size, the KV cache size and their
ratio, split into the primitives (q, K, V, head outputs) and the per-step logits, and the same
with ``derived=True`` (the matrices written too, the v1 layout's size).

    python benchmarks/bench_trace.py [--t 1024] [--new 24] [--derived] [--family gpt2|llama-gqa]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, default=1024)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--family", choices=["gpt2", "llama-gqa"], default="gpt2")
    ap.add_argument("--derived", action="store_true", help="also time and size the opt-in derived matrices")
    args = ap.parse_args()

    from bench_step import build, build_llama_gqa

    import gpt_inspector as gi

    tmp = Path(tempfile.mkdtemp())
    folder = build(tmp / "m") if args.family == "gpt2" else build_llama_gqa(tmp / "m", args.t + 64)
    lm = gi.load_model(folder, device="cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, lm.vocab_size, (args.t - args.new + 1,), generator=g).tolist()
    ids = [i for i in ids if i not in lm.eos_token_ids] + [0] * sum(i in lm.eos_token_ids for i in ids)
    s = gi.Session(lm, prompt_ids=ids)
    s.run(args.new)
    assert s.cache_length == args.t, s.cache_length
    kv = s.kv_kept_bytes()  # the cache the session keeps (every position), which the trace stores
    logits = args.new * lm.vocab_size * 4
    print(f"model: {lm.describe()}; T = {s.cache_length}, {s.n_steps} steps")
    print(f"KV cache: {kv / 2**20:.1f} MiB")
    for derived in (False, True) if args.derived else (False,):
        path = tmp / f"t{int(derived)}.safetensors"
        t0 = time.perf_counter()
        s.save_trace(path, derived=derived)
        t_save = time.perf_counter() - t0
        t0 = time.perf_counter()
        tr = gi.load_trace(path)
        tr.attention(0, 0)
        t_load = time.perf_counter() - t0
        size = path.stat().st_size
        label = "trace v2 + derived matrices" if derived else "trace v2"
        print(f"{label}: {size / 2**20:.1f} MiB = {size / kv:.2f}x the KV cache "
              f"(step logits {logits / 2**20:.1f} MiB = {logits / kv:.2f}x; the rest {(size - logits) / kv:.2f}x); "
              f"save {t_save:.2f} s, load + first matrix {t_load:.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
