"""Per-token cost of assisted stepping (core.assisted: every round verified through the capture, the
stage view on every step) against HF ``generate(assistant_model=...)`` / ``prompt_lookup_num_tokens``
with the same settings, side by side.

Target: GPT2Config() defaults (124M parameters, random weights). Proposers: a 2-layer GPT-2 draft
(n_embd 128, random: it disagrees often), the target itself as its own draft (every proposal
accepted), and prompt lookup. Prompt: ``--t`` tokens, a random block repeated so prompt lookup has
matches. Each repetition runs both sides one after the other, in alternating order, for ``--new``
new tokens (prefill included: generate's assisted loop fuses it with the first verification);
the medians of the per-token times are printed with their ratio. Both sides must give the same
tokens (checked).

    python benchmarks/bench_assisted.py [--t 64] [--reps 3] [--new 32] [--tokens 5] [--threads N] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "benchmarks"),
                str(Path(__file__).resolve().parents[1] / "tests")]  # fmt: skip


def build_draft(folder: Path) -> Path:
    import tiny_models
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = tiny_models.build_tokenizer(folder)
    torch.manual_seed(1)
    cfg = GPT2Config(vocab_size=50257, n_layer=2, n_embd=128, n_head=4, bos_token_id=len(tok) - 1,
                     eos_token_id=len(tok) - 1)  # fmt: skip
    GPT2LMHeadModel(cfg).save_pretrained(folder, safe_serialization=True)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--t", type=int, default=64, help="prompt length")
    ap.add_argument("--tokens", type=int, default=5, help="num_assistant_tokens / prompt_lookup_num_tokens")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: both sides run there")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from bench_step import build
    from transformers import AutoModelForCausalLM

    import gpt_inspector as gi

    root = Path(tempfile.mkdtemp())
    target_dir, draft_dir = build(root / "gpt2-small-random"), build_draft(root / "gpt2-draft")
    lm = gi.load_model(target_dir, device=args.device)
    drafts = {"draft 2-layer": gi.load_model(draft_dir, device=args.device), "target as draft": lm}

    def hf_model(folder):
        return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval().to(args.device)

    hf = hf_model(target_dir)
    hf_drafts = {"draft 2-layer": hf_model(draft_dir), "target as draft": hf}
    for m in hf_drafts.values():
        m.generation_config.num_assistant_tokens = args.tokens  # where generate reads it
    eos = set(lm.eos_token_ids)
    g = torch.Generator().manual_seed(0)
    block = [i for i in torch.randint(0, 50000, (args.t // 4,), generator=g).tolist() if i not in eos]
    ids = (block * 4)[: args.t]
    print(f"model: {lm.describe()}; prompt {len(ids)} tokens, {args.new} new, {args.tokens} proposed per round; "
          f"torch threads {torch.get_num_threads()}")  # fmt: skip
    cases = [(name, dict(assistant=drafts[name]), dict(assistant_model=hf_drafts[name])) for name in drafts]
    cases.append(("prompt lookup", dict(prompt_lookup_num_tokens=args.tokens),
                  dict(prompt_lookup_num_tokens=args.tokens)))  # fmt: skip
    for name, ours_kw, hf_kw in cases:
        mine, theirs, rate = [], [], None

        def ours():
            a = gi.assisted(lm, prompt_ids=ids, max_new_tokens=args.new, suppress_tokens=sorted(eos), **ours_kw)
            return a.session.tokens, a.acceptance_rate

        def generate():
            with torch.inference_mode():
                out = hf.generate(torch.tensor([ids], device=args.device), do_sample=False, max_new_tokens=args.new,
                                  suppress_tokens=sorted(eos), pad_token_id=0, **hf_kw)  # fmt: skip
            return out[0].tolist()

        for rep in range(args.reps):
            for side in ("ours", "hf") if rep % 2 == 0 else ("hf", "ours"):
                t0 = time.perf_counter()
                if side == "ours":
                    tokens, rate = ours()
                    mine.append((time.perf_counter() - t0) / args.new)
                else:
                    want = generate()
                    theirs.append((time.perf_counter() - t0) / args.new)
            assert tokens == want, f"{name}: assisted stepping and generate gave different tokens"
        m, h = statistics.median(mine) * 1e3, statistics.median(theirs) * 1e3
        r = "—" if rate is None else f"{rate:.0%}"
        print(f"{name:16s} (acceptance {r:>4s}): assisted stepping {m:8.2f} ms/token, generate {h:8.2f} ms/token, "
              f"ratio {m / h:.3f} (best of each {min(mine) / min(theirs):.3f})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
