"""Ctrl+C in a command's first seconds (torch and transformers still importing) is one line and
exit 130, as later in the run (issue 33)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpt_inspector as gi

ROOT = Path(gi.__file__).resolve().parents[1]


def _start(tmp_path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    # a terminal's Ctrl+C reaches a process whose SIGINT is at its default, whatever ran this test
    return subprocess.Popen(
        [sys.executable, "-m", "gpt_inspector.cli", "trace", "--prompt", "She eats", "--steps", "3",
         "--out", str(tmp_path / "t.safetensors")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


def _wait_for_torch(proc: subprocess.Popen) -> None:
    """Until the command is importing torch: past Python's own start (a SIGINT during its site
    import is Python's to report), inside the seconds of heavy imports."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text():
                return
        except OSError:
            return
        time.sleep(0.01)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc to know when torch loads")
@pytest.mark.parametrize("delay", [0.0, 0.5, 1.5])
def test_ctrl_c_while_importing_is_one_line_and_130(tmp_path, delay):
    proc = _start(tmp_path)
    _wait_for_torch(proc)
    time.sleep(delay)
    assert proc.poll() is None, "the command ended before the interrupt"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines() == ["gpt-inspector: interrupted"]
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "t.safetensors").exists()
