"""transformers' tensor-parallel plan (``tp_plan="auto"``) under torchrun, two CPU processes over gloo.

Each rank holds half the heads of the tiny Llama (4 query heads over 2 KV heads: 2 over 1 per rank)
and steps an inspector Session on them; rank 0 gathers every rank's captured q, K, V and softmax
rows per head (tests/parity/tp_rank.py). They must equal a session in this process on the same
checkpoint, as must the step tokens and logits. Not bit for bit: the sharded matmuls and the
all-reduce of o_proj / down_proj add the partial sums in another order, so the bound is float32
rounding relative to the largest value (1e-5), far below what a head taken from the wrong rank or
in the wrong order would give (differences of order 1).

Loopback only (127.0.0.1, gloo on ``lo``); skipped where torch has no gloo; bounded by a timeout
that kills the whole process group.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TIMEOUT_S = 240  # three processes import torch: 40-60 s on a 2-core machine at a load average of 14

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="torch has no gloo backend"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gloo on the loopback interface 'lo' (Linux)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PROMPT, STEPS = "She eats an apple. He reads a book.", 4


@pytest.fixture(scope="module")
def tp_run(tiny_dir, tiny_lm, tmp_path_factory):
    """(what rank 0 wrote, one process's session on the same checkpoint)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    import gpt_inspector as gi

    tmp = tmp_path_factory.mktemp("tp")
    out = tmp / "out.safetensors"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(HERE / "tp_rank.py"), str(tiny_dir["llama"]), str(out), PROMPT,
           str(STEPS)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp,
                            start_new_session=True)  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within {TIMEOUT_S} s:\n{log[-3000:]}")
    assert proc.returncode == 0, log[-3000:]
    with safe_open(str(out), "pt") as f:
        shapes = json.loads(f.metadata()["shapes"])
    ref = gi.Session(tiny_lm("llama"), PROMPT)
    ref.step()
    ref.run(STEPS)
    return shapes, load_file(str(out)), ref


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    want = want.detach().float().cpu()
    assert got.shape == want.shape, f"{what}: gathered {tuple(got.shape)}, one process {tuple(want.shape)}"
    scale = float(want.abs().max())
    assert scale > 0.5, what  # a real signal to compare, not zeros
    err = float((got - want).abs().max())
    assert err <= 1e-5 * scale, f"{what}: largest difference {err:.3g} against values up to {scale:.3g}"


def test_each_rank_holds_its_share_of_the_heads(tp_run):
    shapes, _, ref = tp_run
    assert shapes == {"world": 2, "rank_heads": ref.n_heads // 2, "rank_kv_heads": ref.n_kv_heads // 2}
    assert (ref.n_heads, ref.n_kv_heads) == (4, 2)


def test_tokens_and_logits_equal_one_process(tp_run):
    _, got, ref = tp_run
    assert got["tokens"].tolist() == ref.tokens
    _close(got["logits"], torch.stack([st.logits for st in ref.steps_done]), "step logits")


def test_captured_numbers_gathered_per_head_equal_one_process(tp_run):
    _, got, ref = tp_run
    t = ref.cache_length
    for layer in range(ref.n_layers):
        q, k, v = (torch.as_tensor(x) for x in ref.qkv(layer))  # (H, T, d), (Hkv, T, d), (Hkv, T, d)
        for name, want in (("q", q), ("k", k), ("v", v), ("probs", ref.attention_rows(layer, 0, t))):
            _close(got[f"{layer}.{name}"], want, f"layer {layer} {name}")
