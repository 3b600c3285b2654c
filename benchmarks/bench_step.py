"""Per-token cost of a captured Session.step() against HF generate (sdpa, KV cache), side by side.

Two models, random weights, saved to disk first:
- ``gpt2``: GPT2Config() defaults (124M parameters), prompts of 32 and 512 tokens;
- ``llama-gqa``: the Llama-style model of issue 15, 8 layers x 8 heads, 2 KV heads, head size 64,
  float32, contexts of 1,024 / 4,096 / 8,192 tokens (``--t``).
Both sides decode greedily and take turns token by token: a logits processor inside generate notes
the clock as each of its tokens arrives and runs one Session.step() before handing back, so
generate's per-token time is the time between processor calls less the Session step inside, and
noise on a shared machine hits both sides alike. Prefills are not counted on either side.

    python benchmarks/bench_step.py [--family gpt2|llama-gqa] [--t 1024 4096 8192] [--reps 3] [--new 48] [--threads N] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# this checkout's package and test helpers, not whichever gpt_inspector the environment installed
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]


def build(folder: Path) -> Path:
    import tiny_models
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = tiny_models.build_tokenizer(folder)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50257, bos_token_id=len(tok) - 1, eos_token_id=len(tok) - 1)
    GPT2LMHeadModel(cfg).save_pretrained(folder, safe_serialization=True)
    return folder


def build_llama_gqa(folder: Path, context: int = 8192 + 128) -> Path:
    """Issue 15's model: 8 layers x 8 heads, 2 KV heads, head size 64, float32, random weights."""
    import tiny_models
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_models.build_tokenizer(folder)
    eos = len(tok) - 1
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=context,
                      bos_token_id=eos, eos_token_id=eos, tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    return folder


def take_turns(session):
    """A logits processor that times generate's tokens and runs one ``session`` step between them
    (it changes no score): both sides measured in one run, token by token. Shared with bench_sampler."""
    from transformers import LogitsProcessor

    class _TakeTurns(LogitsProcessor):
        def __init__(self, session):
            self.session, self.hf, self.steps = session, [], []
            self.resumed: float | None = None  # when generate got control back

        def __call__(self, input_ids, scores):
            now = time.perf_counter()
            if self.resumed is not None:
                self.hf.append(now - self.resumed)
                t0 = time.perf_counter()
                self.session.step()
                self.steps.append(time.perf_counter() - t0)
            self.resumed = time.perf_counter()
            return scores

    return _TakeTurns(session)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=("gpt2", "llama-gqa"), default="gpt2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: both sides run there")
    ap.add_argument(
        "--t", type=int, nargs="+", help="prompt lengths (default: 32 512 for gpt2, 1024 4096 8192 for llama-gqa)"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, LogitsProcessorList

    import gpt_inspector as gi

    tmp = Path(tempfile.mkdtemp())
    if args.family == "gpt2":
        folder, lengths, target = build(tmp / "gpt2-small-random"), args.t or [32, 512], 1.10
    else:
        lengths = args.t or [1024, 4096, 8192]
        folder, target = build_llama_gqa(tmp / "llama-gqa-random", max(lengths) + args.new + 64), 1.10
    lm = gi.load_model(folder, device=args.device)
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval().to(args.device)
    print(f"model: {lm.describe()}; torch threads {torch.get_num_threads()}")
    g = torch.Generator().manual_seed(0)
    for plen in lengths:
        # random ids that avoid EOS, so both sides run the full length
        ids = torch.randint(0, min(lm.vocab_size - 1, 50000), (plen,), generator=g).tolist()
        ids = [i for i in ids if i not in lm.eos_token_ids]
        sess_tok, hf_tok = [], []
        mem = None
        for _ in range(args.reps):
            s = gi.Session(lm, prompt_ids=ids)
            s.step()  # prefill, not counted
            turns = take_turns(s)
            kw = {
                "do_sample": False,
                "pad_token_id": 0,
                "eos_token_id": None,
                "logits_processor": LogitsProcessorList([turns]),
            }
            with torch.inference_mode():
                hf.generate(
                    torch.tensor([ids], device=args.device), max_new_tokens=args.new, min_new_tokens=args.new, **kw
                )
            assert len(turns.hf) == len(turns.steps) == args.new - 1
            sess_tok.append(statistics.mean(turns.steps))
            hf_tok.append(statistics.mean(turns.hf))
            r = s.recorder  # the head-output window apart: a buffer of at most 2 x OUTPUT_WINDOW rows, whatever T
            window = sum(b.nbytes(r.length - r.out_from) for b in r.out)
            # against the cache the session keeps (every position, sliding-window layers too)
            mem = (s.record_bytes() - window, s.kv_kept_bytes(), window)
            del s, turns
        s_ms = statistics.median(sess_tok) * 1e3
        best = min(sess_tok) / min(hf_tok)
        h_ms = statistics.median(hf_tok) * 1e3
        rec, kv, window = mem
        print(
            f"prompt {len(ids):5d} + {args.new} new: Session.step {s_ms:7.2f} ms/token, HF generate {h_ms:7.2f} ms/token, "
            f"ratio {s_ms / h_ms:.3f} (best of each {best:.3f}; target <= {target}); records {rec / 2**20:.1f} MiB vs KV cache "
            f"{kv / 2**20:.1f} MiB = {rec / kv:.2f}x, plus the head-output window {window / 2**20:.2f} MiB (fixed)",
            flush=True,
        )


if __name__ == "__main__":
    main()
