"""What the logit lens costs on GPT-2-small shapes, measured side by side in one run.

- recording: Session.step() with the lens's residual hooks installed vs a session on a model
  without them (alternating, same prompt), per decode token;
- computing: lens() for the current step (every layer's residual through the final norm and the
  unembedding, plus the head attribution) against one step.

    python benchmarks/bench_lens.py [--prompt 32] [--steps 24] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    import gpt_inspector as gi
    from bench_step import build
    from gpt_inspector.core import lens as lens_mod

    folder = build(Path(tempfile.mkdtemp()) / "gpt2-small-random")
    plain = gi.load_model(folder, device="cpu")
    hooked = gi.load_model(folder, device="cpu")
    lens_mod.enable(hooked)
    ids = torch.randint(0, plain.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    print(f"model: {plain.describe()}; torch threads {torch.get_num_threads()}")

    def per_step(lm) -> float:
        s = gi.Session(lm, prompt_ids=ids)
        s.step()
        t0 = time.perf_counter()
        s.run(args.steps)
        return (time.perf_counter() - t0) / args.steps

    a, b, lens_t = [], [], []
    for _ in range(args.reps):
        a.append(per_step(plain))
        b.append(per_step(hooked))
        s = gi.Session(hooked, prompt_ids=ids)
        s.run(4)
        t0 = time.perf_counter()
        for _ in range(5):
            lens_mod.lens(s)
        lens_t.append((time.perf_counter() - t0) / 5)
    step, step_h, lt = statistics.median(a), statistics.median(b), statistics.median(lens_t)
    print(f"recording the residual: {step_h * 1e3:.1f} vs {step * 1e3:.1f} ms/token, ratio {step_h / step:.3f} (target <= 1.10)")
    print(f"lens + attribution for one step: {lt * 1e3:.1f} ms = {lt / step:.2f} x a step "
          f"({plain.n_layers} unembeddings of {plain.vocab_size} tokens)")


if __name__ == "__main__":
    main()
