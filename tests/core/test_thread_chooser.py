"""The streamed overview's thread count is chosen by timing: all threads where they are faster, one where not."""

from __future__ import annotations

import pytest

from gpt_inspector.core import pooling


def _run(chooser, seconds_per_number: dict[int, float], chunks: int) -> list[int]:
    picked = []
    for _ in range(chunks):
        k = chooser.pick()
        picked.append(k)
        chooser.record(k, seconds_per_number[k] * 1000, 1000)
    return picked


@pytest.fixture
def chooser(monkeypatch):
    import torch

    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    return pooling.ThreadChooser()


def test_a_quiet_machine_gets_every_thread_and_the_other_count_is_probed(chooser):
    picked = _run(chooser, {1: 2e-9, 4: 1e-9}, 40)
    assert sorted(picked[:4]) == [1, 1, 4, 4]  # each count timed first
    later = picked[4:]
    assert later.count(4) > later.count(1) >= 2  # mostly all threads; one thread still tried now and then
    # each probe that confirms the choice doubles the wait before the next: 8, 16, 32, 64, 64 chunks
    probes = [i for i, k in enumerate(_run(chooser, {1: 2e-9, 4: 1e-9}, 400), start=len(picked) + 1) if k == 1]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[-3:] == [64, 64, 64] and gaps == sorted(gaps)


def test_a_busy_machine_stays_on_one_thread(chooser):
    picked = _run(chooser, {1: 1e-9, 4: 10e-9}, 40)
    assert picked[4:].count(1) > picked[4:].count(4)


def test_the_choice_follows_the_machine(chooser):
    _run(chooser, {1: 1e-9, 4: 10e-9}, 16)  # busy
    picked = _run(chooser, {1: 1e-9, 4: 0.1e-9}, 40)  # then quiet: the probes notice
    assert picked[-8:].count(4) >= 7


def test_one_thread_given_is_one_thread_used(monkeypatch):
    import torch

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert set(_run(pooling.ThreadChooser(), {1: 1e-9}, 10)) == {1}
