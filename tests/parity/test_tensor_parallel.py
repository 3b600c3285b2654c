"""transformers' tensor-parallel plan (``tp_plan="auto"``) under torchrun, two CPU processes over gloo.

Each rank holds half the heads of the tiny Llama (4 query heads over 2 KV heads: 2 over 1 per rank)
and steps an inspector Session on them; rank 0 gathers every rank's captured q, K, V and softmax
rows per head (tests/parity/tp_rank.py). They must equal one process's session on the same
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
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TIMEOUT_S = 240  # three torch imports on a loaded 2-core machine; about 10 s on an idle one

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="torch has no gloo backend"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gloo on the loopback interface 'lo' (Linux)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    import tiny_models

    tmp = tmp_path_factory.mktemp("tp")
    folder = tiny_models.build(tmp / "llama", "llama")
    out = tmp / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(HERE / "tp_rank.py"), str(folder), str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp,
                            start_new_session=True)  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within {TIMEOUT_S} s:\n{log[-3000:]}")
    assert proc.returncode == 0, log[-3000:]
    return json.loads(out.read_text())


def test_each_rank_holds_its_share_of_the_heads(tp_run):
    assert tp_run["world"] == 2
    assert (tp_run["rank_heads"], tp_run["rank_kv_heads"]) == (2, 1)
    assert tp_run["ref_heads"] == 4


def test_tokens_and_logits_equal_one_process(tp_run):
    assert tp_run["tokens"] == tp_run["ref_tokens"]
    assert tp_run["logits_max_abs"] <= 1e-5 * tp_run["logits_scale"], tp_run


def test_captured_numbers_gathered_per_head_equal_one_process(tp_run):
    captured = tp_run["captured"]
    assert set(captured) == {f"{layer}.{name}" for layer in (0, 1) for name in ("q", "k", "v", "probs")}
    for key, (max_abs, scale, shape) in captured.items():
        assert max_abs is not None, f"{key}: gathered shape {shape} differs from one process's"
        assert scale > 0.5, key  # a real signal to compare, not zeros
        assert max_abs <= 1e-5 * scale, (key, max_abs, scale)
