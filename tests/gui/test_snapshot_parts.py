"""The Snapshot in one small part per view; every part's field also reads by its own name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import gpt_inspector as gi
from gpt_inspector.gui.snapshot import PARTS, Snapshot
from gpt_inspector.gui.viewdata import Selection, ViewModel


@pytest.fixture(scope="module")
def session(tiny_lm):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    s = gi.Session(tiny_lm("llama"), "The cat sat on the mat")
    s.run(2)
    yield s
    torch.set_num_threads(n)


def test_each_view_reads_its_own_part_and_the_numbers_are_the_sources(session):
    snap = ViewModel(session).build(Selection(layer=1, head=2, kind="probs"))
    t = session.cache_length
    names = [f.name for part in PARTS.values() for f in dataclasses.fields(part)]
    assert len(names) == len(set(names))  # one name, one part
    assert not {f.name for f in dataclasses.fields(Snapshot)} & set(names)
    for name, part in PARTS.items():
        got = getattr(snap, name)
        assert isinstance(got, part)
        for f in dataclasses.fields(part):
            assert getattr(snap, f.name) is getattr(got, f.name)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.scores.matrix = None
    probs = session.attention(1, 2, "probs")  # (T, T), 0 where masked; the view shows NaN there
    np.testing.assert_array_equal(np.nan_to_num(snap.scores.matrix, nan=0.0), probs)
    np.testing.assert_array_equal(snap.scores.allowed, session.allowed(1, 2))
    q, k, v = session.qkv(1)
    kvh = session.kv_head_of(2, 1)
    np.testing.assert_array_equal(snap.qkv.q, q[2, t - 1])
    np.testing.assert_array_equal(snap.qkv.k, k[kvh])
    assert snap.qkv.kv_head == kvh and snap.qkv.scaling == session.scaling(1)
    np.testing.assert_array_equal(snap.query_row.head_rows, session.attention_rows(1, t - 1, t)[:, 0].numpy())
    assert snap.tokens.token_ids == tuple(session.tokens) and snap.tokens.n_steps == 2
    assert snap.kv.kv_bytes == tuple(session.kv_cache_bytes(i) for i in range(session.n_layers))
    assert snap.live.can("step") and snap.live == session.live
