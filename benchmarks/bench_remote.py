"""Bytes and time per step, a local Session vs the same session through `gpt-inspector serve` on loopback.

A step here is what the window pays for one: the step itself, then the newest attention row of
every head of every layer (what a step repaints). Both sides run on one thread, on a random
GPT-2-shaped model saved to disk first. ``python benchmarks/bench_remote.py [T ...]`` (default 1024 8192).

The last column is computed, not measured: the loopback time plus, for a link with a 50 ms round
trip and 10 MB/s, one round trip per request and the bytes at that rate.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
STEPS = 8
RTT_S, RATE = 0.050, 10e6


def build(folder: Path, positions: int) -> None:
    import tiny_models
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = tiny_models.build_tokenizer(folder)
    torch.manual_seed(0)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = GPT2Config(n_layer=4, n_head=8, n_embd=256, n_positions=positions, vocab_size=len(tok), bos_token_id=eos,
                     eos_token_id=eos)  # fmt: skip
    GPT2LMHeadModel(cfg).save_pretrained(folder, safe_serialization=True)


def prompt_of(lm, t: int) -> str:
    import tiny_models

    text = " ".join(tiny_models.CORPUS)
    while len(lm.tokenizer.encode(text)) < t:
        text += " " + text
    return lm.tokenizer.decode(lm.tokenizer.encode(text)[:t])


def one_step(s) -> None:
    s.step()
    t = s.cache_length
    if hasattr(s, "layers_attention_rows"):  # remote: every layer's newest rows in one request
        s.layers_attention_rows(range(s.n_layers), t - 1, t)  # (L, H, 1, T)
        return
    for layer in range(s.n_layers):
        s.attention_rows(layer, t - 1, t)  # (H, 1, T): the newest row of every head


def timed(s, n: int, counter=None) -> tuple[float, float]:
    """(median seconds per step, bytes per step)"""
    one_step(s)  # warm up: the first step after the prefill
    times, nbytes = [], []
    for _ in range(n):
        b0 = counter() if counter else 0
        t0 = time.perf_counter()
        one_step(s)
        times.append(time.perf_counter() - t0)
        nbytes.append((counter() if counter else 0) - b0)
    return statistics.median(times), statistics.median(nbytes)


def main(lengths: list[int]) -> None:
    import gpt_inspector as gi

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        build(folder, max(lengths) + 2 * STEPS + 8)
        lm = gi.load_model(folder, device="cpu")
        proc = subprocess.Popen([sys.executable, "-m", "gpt_inspector", "serve", "--model", str(folder), "--device",
                                 "cpu", "--recipe-out", str(Path(tmp) / "recipe.json")],
                                stdout=subprocess.PIPE, text=True, cwd=tmp)  # fmt: skip
        try:
            url = proc.stdout.readline().strip()
            print(f"machine load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; one thread each side; "
                  f"model: 4 layers x 8 heads, d=32; a step = step + newest attention row of all 32 heads")  # fmt: skip
            print(f"{'T':>6} {'local ms':>9} {'remote ms':>10} {'ratio':>6} {'bytes/step':>11} {'requests':>9} "
                  f"{'50ms+10MB/s ms':>15}")  # fmt: skip
            for t in lengths:
                prompt = prompt_of(lm, t)
                s = gi.Session(lm, prompt)
                s.step()  # the prefill, not timed
                local, _ = timed(s, STEPS)
                r = gi.connect(url, prompt=prompt)
                r.step()
                remote, nbytes = timed(r, STEPS, lambda: r.bytes_sent + r.bytes_received)
                assert r.tokens == s.tokens  # the same run on both sides
                requests = 2  # the step, then every layer's newest rows
                link = remote + requests * RTT_S + nbytes / RATE
                print(f"{s.cache_length:>6} {local * 1e3:>9.1f} {remote * 1e3:>10.1f} {remote / local:>6.2f} "
                      f"{nbytes:>11.0f} {requests:>9} {link * 1e3:>15.0f}")  # fmt: skip
                r.close()
                del s
        finally:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1024, 8192])
