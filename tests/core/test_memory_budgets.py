"""Beam searches are sized with their search state, and memory means the container's limit where it
is lower than the machine's (issue 33)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

import gpt_inspector as gi
from gpt_inspector.core import validate

GiB = 1 << 30
# GPT-2 small's shape: 50,257 tokens
GPT2 = SimpleNamespace(n_layers=12, head_dim=64, n_kv_heads=12, n_heads=12, vocab_size=50257, dtype=torch.float32)


def _physical() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def cgroup(tmp_path, monkeypatch):
    monkeypatch.setattr(validate, "CGROUP_ROOT", str(tmp_path))
    return tmp_path


def test_a_cgroup_v2_limit_below_physical_memory_is_the_budget(cgroup):
    (cgroup / "memory.max").write_text(f"{GiB}\n")
    assert validate.memory_bytes() == GiB
    (cgroup / "memory.max").write_text("max\n")  # no limit
    assert validate.memory_bytes() == _physical()


def test_a_cgroup_v1_limit_is_read_and_its_no_limit_value_ignored(cgroup):
    (cgroup / "memory").mkdir()
    f = cgroup / "memory" / "memory.limit_in_bytes"
    f.write_text(f"{2 * GiB}\n")
    assert validate.memory_bytes() == 2 * GiB
    f.write_text("9223372036854771712\n")  # what v1 writes for "no limit"
    assert validate.memory_bytes() == _physical()


def test_a_limit_above_physical_memory_changes_nothing(cgroup):
    (cgroup / "memory.max").write_text(f"{_physical() * 4}\n")
    assert validate.memory_bytes() == _physical()


def test_the_beam_estimate_counts_the_search_state(monkeypatch):
    n, total, prompt = 1024, 40, 8
    need, per_beam = validate.beam_bytes(GPT2, n, total, prompt)
    cache = total * 12 * 64 * (2 * 12 + 2 * 12) * 4  # K, V, q and head outputs per position, float32
    # per step: logits, generate's float32 copy, log-softmax, accumulated scores, topk's work; then
    # every step's logits kept
    search = 50257 * (4 + 4 * 4) + 50257 * 4 * (total - prompt)
    assert per_beam == cache + search and need == n * per_beam
    assert search > cache  # the part the old estimate left out is the larger one here
    monkeypatch.setattr(validate, "memory_bytes", lambda: 8 * GiB)
    # the cache and records alone (5.6 GiB) fit in 8 GiB; with the search state (12.7 GiB) they do not
    assert n * cache < 8 * GiB < need
    with pytest.raises(gi.InspectorError, match="search state") as e:
        validate.beams(GPT2, n, total, prompt)
    most = int(str(e.value).split("at most about ")[1].split()[0])
    assert most * per_beam <= 8 * GiB < (most + 1) * per_beam
    assert validate.beams(GPT2, most, total, prompt) == most


def test_a_container_limit_refuses_beams_the_machine_would_take(cgroup):
    (cgroup / "memory.max").write_text(f"{GiB}\n")
    need, _ = validate.beam_bytes(GPT2, 200, 40, 8)
    assert GiB < need < _physical()  # fits the machine, not the container
    with pytest.raises(gi.InspectorError, match="1.0 GiB"):
        validate.beams(GPT2, 200, 40, 8)
