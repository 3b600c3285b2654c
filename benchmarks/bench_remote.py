"""Step → repainted, in-process vs through `gpt-inspector serve` on loopback vs a shaped link, side by side.

What a step repaints is what the window's worker builds after it: ``gui.viewdata.ViewModel.build``,
the very code that turns a run source into the snapshot every panel paints (the overview's binned
rows, the selected head's score matrix, exact up to 1,024 positions and pooled beyond, its newest
row and mask, one row of every head of the layer, q, K and V, the KV cache, the next-token panel).
Painting that snapshot is the same work whichever side computed it, so it is left out. Timed per
step: to the step's reply (the token and its top-k: ``top``) and to the snapshot (``ready``). Four
paths, on the same prompt and the same greedy tokens, each with a view model of its own:

- local: an in-process ``Session``;
- loopback: ``gi.connect`` to a ``serve`` process on 127.0.0.1;
- relay: the same through ``tests/link_shaper.py`` unshaped (no delay, no limit): what the relay
  itself costs;
- shaped: the same relay adding a 50 ms round trip and pacing each direction at 10 MB/s.

The relay runs in a process of its own, as a real link is outside both ends. A remote step asks, in
its own request, for the reads the last repaint made moved on by one position (``remote.source``), so
a step and its repaint are one round trip when that guess holds; ``trips`` is the requests a step
and its repaint made (median/most).

Bytes per step are counted at a relay (websocket frames, pings included: what crosses the wire),
both ways. Each shaped row is checked against issue 27's bound

    step → repainted ≤ local + 2 round trips + bytes / rate

and printed PASS or FAIL with its numbers; the last snapshot of each remote path is checked equal,
array for array, to the local one. The model is built here (a random Llama-style model: 4 layers,
8 query heads over 2 KV heads, head size 32, hidden 256; saved as safetensors first); both sides run
one torch thread.

``python benchmarks/bench_remote.py [--quick] [--steps N] [T ...]`` (default 1024 8192, 12 steps;
``--quick``: 1024 only, 3 steps).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
RTT_S, RATE = 0.050, 10e6
REQUESTS = 2  # the bound allows two round trips a step (issue 27)
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 4, 8, 2, 32


def build(folder: Path, positions: int) -> None:
    import tiny_models
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_models.build_tokenizer(folder)
    torch.manual_seed(0)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = LlamaConfig(hidden_size=HEADS * HEAD_DIM, intermediate_size=688, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=positions,
                      vocab_size=len(tok), bos_token_id=eos, eos_token_id=eos, tie_word_embeddings=False,
                      initializer_range=0.1)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)


def prompt_of(lm, t: int) -> str:
    import tiny_models

    text = " ".join(tiny_models.CORPUS)
    while len(lm.tokenizer.encode(text)) < t:
        text += " " + text
    return lm.tokenizer.decode(lm.tokenizer.encode(text)[:t])


def one_step(s, vm) -> tuple[float, float]:
    """A step and the snapshot it repaints: (seconds to the step's reply, seconds to the snapshot)."""
    t0 = time.perf_counter()
    assert s.step().top  # the next-token panel: the step's own reply carries it
    t_top = time.perf_counter() - t0
    snap = vm.build()
    assert snap.T == s.cache_length
    return t_top, time.perf_counter() - t0


def settle(s, vm) -> None:
    """Build until the overview is complete (a first build at long T streams it), then step twice: the
    first repaint after a first build reads its views anew (a pooled matrix built whole, then its last
    row block), so only from the second on does a remote session know what a repaint reads."""
    vm.build()
    while not vm.overview_complete:
        vm.refine()
        vm.build()
    for _ in range(2):
        one_step(s, vm)


def interleaved(paths: list[tuple[object, object, object]], n: int) -> list[dict]:
    """Medians over ``n`` steps for each (session, view model, byte counter or None), stepped in turn:
    step k of every path before step k + 1 of any, the order rotating, so that the machine's load
    weighs on every path alike. Per path: ms to the reply, ms to the snapshot, bytes and requests
    per step; and the most requests any step made (``max_trips``)."""
    got: list[dict[str, list[float]]] = [{"top": [], "ready": [], "bytes": [], "trips": []} for _ in paths]
    for k in range(n):
        for i in [(k + j) % len(paths) for j in range(len(paths))]:
            s, vm, counter = paths[i]
            b0, r0 = (counter() if counter else 0), getattr(s, "requests", 0)
            t_top, t_ready = one_step(s, vm)
            got[i]["top"].append(t_top * 1e3)
            got[i]["ready"].append(t_ready * 1e3)
            got[i]["bytes"].append((counter() if counter else 0) - b0)
            got[i]["trips"].append(getattr(s, "requests", 0) - r0)
    return [{key: statistics.median(v) for key, v in g.items()} | {"max_trips": max(g["trips"])} for g in got]


def same_snapshot(a, b) -> None:
    """What the window would show, array for array (NaN where masked in both)."""
    assert a.T == b.T and a.tokens.token_ids == b.tokens.token_ids
    pairs = [(a.scores.matrix, b.scores.matrix), (a.query_row.head_rows, b.query_row.head_rows),
             (a.query_row.query_allowed, b.query_row.query_allowed), (a.qkv.q, b.qkv.q), (a.qkv.k, b.qkv.k),
             (a.qkv.v, b.qkv.v), (a.overview.thumbs, b.overview.thumbs)]  # fmt: skip
    for x, y in pairs:
        assert np.array_equal(x, y, equal_nan=True), "a remote snapshot differs from the local one"


def serve(folder: Path, tmp: Path, name: str) -> tuple[subprocess.Popen, str, int]:
    proc = subprocess.Popen([sys.executable, "-m", "gpt_inspector", "serve", "--model", str(folder), "--device", "cpu",
                             "--recipe-out", str(tmp / f"recipe-{name}.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp)  # fmt: skip
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    return proc, url, int(url.split(":")[2].split("/")[0])


def main(lengths: list[int], steps: int) -> None:
    from link_shaper import spawn

    import gpt_inspector as gi
    from gpt_inspector.gui.viewdata import ViewModel

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        folder = tmp / "model"
        build(folder, max(lengths) + 2 * steps + 32)
        lm = gi.load_model(folder, device="cpu")
        # a server per remote path (one client each), so the four paths can step in turn
        servers = [serve(folder, tmp, name) for name in ("loopback", "relay", "shaped")]
        (_, url_loop, _), (_, url_relay, port_relay), (_, url_shaped, port_shaped) = servers
        load = [os.getloadavg()[0]]
        try:
            # the relay unshaped (no delay, no limit): what the relay itself costs, and the bytes
            with spawn(port_relay, rtt_s=0.0, rate=1e12, lifetime_s=7200) as relay, \
                    spawn(port_shaped, rtt_s=RTT_S, rate=RATE, lifetime_s=7200) as shaper:  # fmt: skip
                for t in lengths:
                    prompt = prompt_of(lm, t)
                    s = gi.Session(lm, prompt)
                    remotes = [gi.connect(u, prompt=prompt) for u in (url_loop, relay.url(url_relay),
                                                                       shaper.url(url_shaped))]  # fmt: skip
                    try:
                        sessions = [s, *remotes]
                        for x in sessions:
                            x.step()  # the prefill, not timed
                        vms = [ViewModel(x) for x in sessions]
                        for x, vm in zip(sessions, vms):
                            settle(x, vm)
                        counters = (None, None, lambda: relay.total_bytes, lambda: shaper.total_bytes)
                        measured = interleaved(list(zip(sessions, vms, counters)), steps)
                        assert all(r.tokens == s.tokens for r in remotes)  # the same run on every path
                        local = vms[0].build()
                        for vm in vms[1:]:
                            same_snapshot(vm.build(), local)
                    finally:
                        for r in remotes:
                            r.close()
                    del s, vms
                    rows.append((t, *measured))
                    load.append(os.getloadavg()[0])
        finally:
            for proc, _, _ in servers:
                proc.terminate()
            for proc, _, _ in servers:
                proc.wait(timeout=60)
    report(rows, steps, load)


def report(rows, steps: int, load: list[float]) -> None:
    print(f"machine: {os.cpu_count()} cores, load average {min(load):.1f}-{max(load):.1f} during the run; one "
          f"torch thread each side; medians of {steps} steps, the four paths stepping in turn")  # fmt: skip
    print(f"model: random Llama-style, {LAYERS} layers x {HEADS} heads over {KV_HEADS} KV heads, head size "
          f"{HEAD_DIM}; step -> the window's snapshot (gui.viewdata.ViewModel.build); shaped: "
          f"{RTT_S * 1e3:.0f} ms round trip, {RATE / 1e6:.0f} MB/s each way; relay: the same relay unshaped")  # fmt: skip
    print(f"{'T':>6} {'path':>9} {'reply ms':>9} {'ready ms':>9} {'x local':>8} {'trips':>6} {'bytes/step':>11} "
          f"{'bound ms':>9}  check")  # fmt: skip
    for t, local, loop, relayed, shaped in rows:
        paths = (("local", local), ("loopback", loop), ("relay", relayed), ("shaped", shaped))
        for name, m in paths:
            line = f"{t:>6} {name:>9} {m['top']:>9.1f} {m['ready']:>9.1f} {m['ready'] / local['ready']:>8.2f} "
            line += f"{m['trips']:>4.0f}/{m['max_trips']:<1} " if name != "local" else f"{'-':>6} "
            line += f"{m['bytes']:>11.0f}" if name in ("relay", "shaped") else f"{'-':>11}"
            if name == "shaped":
                transfer = m["bytes"] / RATE * 1e3
                link = REQUESTS * RTT_S * 1e3 + transfer
                bound = local["ready"] + link
                verdict = "PASS" if m["ready"] <= bound else "FAIL"
                line += (f" {bound:>9.1f}  {verdict}: {m['ready']:.1f} vs {local['ready']:.1f} local + "
                         f"{REQUESTS} x {RTT_S * 1e3:.0f} ms + {transfer:.1f} ms transfer; the link added "
                         f"{m['ready'] - relayed['ready']:.1f} ms to the relay's {relayed['ready']:.1f} "
                         f"({m['trips']:.0f} round trip(s) + transfer: "
                         f"{m['trips'] * RTT_S * 1e3 + transfer:.1f})")  # fmt: skip
            print(line)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lengths", nargs="*", type=int, help="prompt lengths (default 1024 8192)")
    ap.add_argument("--quick", action="store_true", help="T = 1024 only, 3 steps")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per path (default 12)")
    a = ap.parse_args()
    lengths = a.lengths or ([1024] if a.quick else [1024, 8192])
    main(lengths, a.steps or (3 if a.quick else 12))
