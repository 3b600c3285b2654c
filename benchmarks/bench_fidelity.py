"""Cost of the load-time fidelity self-test on GPT-2-small shapes (random weights saved to disk first)."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> None:
    import tiny_models
    from transformers import GPT2Config, GPT2LMHeadModel

    import gpt_inspector as gi
    from gpt_inspector.core import fidelity

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tok = tiny_models.build_tokenizer(folder)
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config()).save_pretrained(folder, safe_serialization=True)
        del tok
        loads, gaps, plain = [], [], []
        for _ in range(5):
            t0 = time.perf_counter()
            lm = gi.load_model(folder, device="cpu")
            loads.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            gap, pos, tol = fidelity.fidelity_gap(lm)
            gaps.append(time.perf_counter() - t0)
            ids = torch.arange(1, fidelity.PROBE_LENGTH + 1)[None]  # (1, P)
            with torch.inference_mode():
                t0 = time.perf_counter()
                lm.model(ids)
                plain.append(time.perf_counter() - t0)
        load, check = min(loads), min(gaps)
        print(f"load_model (self-test included): {load * 1000:.0f} ms best of 5")
        print(f"machine load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        print(
            f"fidelity self-test alone: {check * 1000:.0f} ms ({check / load:.0%} of the load); "
            f"max |diff| {gap:.2g} at position {pos}, tolerance {tol:.2g}"
        )
        print(f"one plain {fidelity.PROBE_LENGTH}-token forward: {min(plain) * 1000:.0f} ms "
              f"(the self-test costs {check / min(plain):.1f} of them)")  # fmt: skip


if __name__ == "__main__":
    main()
