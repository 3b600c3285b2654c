"""Per-token cost of stepping with the sampler's stage view against HF generate with the same settings.

GPT2Config() defaults (124M parameters, random weights, saved to disk first), a prompt of ``--t``
tokens. For each setting both sides take turns token by token, as in bench_step.py: a logits
processor inside generate notes the clock as each of its tokens arrives and runs one
Session.step() (a forward, then every processor applied one by one with each stage's distribution
summarised) before handing back, so generate's per-token time is the time between processor calls
less the Session step inside, and noise on a shared machine hits both sides alike. Prefills are not
counted. EOS is suppressed on both sides so every run has its full length.

    python benchmarks/bench_sampler.py [--t 32 512] [--reps 3] [--new 24] [--threads N] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "benchmarks")]

SETTINGS = {
    "greedy": dict(),
    "greedy + penalties": dict(repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=4),
    "sampled, warpers": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, typical_p=0.95),
    "sampled, everything": dict(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.02,
        typical_p=0.95,
        epsilon_cutoff=1e-4,
        eta_cutoff=1e-4,
        repetition_penalty=1.3,
        no_repeat_ngram_size=3,
        bad_words_ids=[[11], [12, 13]],
        min_new_tokens=4,
    ),  # fmt: skip
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--t", type=int, nargs="+", default=[32, 512], help="prompt lengths")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: both sides run there")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from bench_step import build, take_turns
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    import gpt_inspector as gi
    from gpt_inspector.core.decoding import Decoding

    folder = build(Path(tempfile.mkdtemp()) / "gpt2-small-random")
    lm = gi.load_model(folder, device=args.device)
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval().to(args.device)
    eos = list(lm.eos_token_ids)
    print(f"model: {lm.describe()}; torch threads {torch.get_num_threads()}")
    g = torch.Generator().manual_seed(0)
    for plen in args.t:
        ids = [i for i in torch.randint(0, 50000, (plen,), generator=g).tolist() if i not in eos]
        for name, kw in SETTINGS.items():
            dec = Decoding(**kw, suppress_tokens=eos)
            sess_tok, hf_tok, n_stages = [], [], 0
            for rep in range(args.reps):
                s = gi.Session(lm, prompt_ids=ids, seed=rep, decoding=dec)
                s.step()  # prefill, not counted
                turns = take_turns(s)
                torch.manual_seed(rep)
                with torch.inference_mode():
                    hf.generate(torch.tensor([ids], device=args.device), max_new_tokens=args.new, pad_token_id=0,
                                logits_processor=LogitsProcessorList([turns]), **dec.generate_kwargs())  # fmt: skip
                assert len(turns.hf) == len(turns.steps) == args.new - 1
                sess_tok.append(statistics.mean(turns.steps))
                hf_tok.append(statistics.mean(turns.hf))
                n_stages = len(s.current.stages)
                del s, turns
            s_ms, h_ms = statistics.median(sess_tok) * 1e3, statistics.median(hf_tok) * 1e3
            print(f"prompt {len(ids):4d} + {args.new} new, {name:20s} ({n_stages} stages): Session.step "
                  f"{s_ms:7.2f} ms/token, HF generate {h_ms:7.2f} ms/token, ratio {s_ms / h_ms:.3f} "
                  f"(best of each {min(sess_tok) / min(hf_tok):.3f})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
