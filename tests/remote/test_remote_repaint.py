"""A step and the window's repaint through a real ``gpt-inspector serve``: one round trip, the local numbers.

The window's worker builds what it paints with ``gui.viewdata.ViewModel``; a remote step carries the
reads the last build made, moved on by one position (``remote.source``). Past ``EXACT_LIMIT`` the
score matrix is pooled and a step recomputes its last row block, whose start moves by a block, not
by a row: these tests shrink the window's limits so that a tiny model's short run takes that path.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpt_inspector as gi
from gpt_inspector.core.pooling import pow2_block
from gpt_inspector.gui import viewdata
from gpt_inspector.gui.snapshot import Selection
from gpt_inspector.remote.client import RemoteSession

PROMPT = "She eats an apple. He reads"
DISPLAY = 4  # pooled blocks per side: blocks of 4 positions from T = 9, of 8 from T = 17


@pytest.fixture
def pooled(monkeypatch):
    """The window's limits shrunk: pooled past 4 positions, exact tiles up to 8 positions a side."""
    monkeypatch.setattr(viewdata, "EXACT_LIMIT", 4)
    monkeypatch.setattr(viewdata, "DISPLAY_CELLS", DISPLAY)
    monkeypatch.setattr(viewdata, "TILE_CELLS", 8)


def _same(a, b) -> None:
    assert a.T == b.T and a.tokens.token_ids == b.tokens.token_ids and a.scores.matrix_block == b.scores.matrix_block
    for x, y in [(a.scores.matrix, b.scores.matrix), (a.query_row.head_rows, b.query_row.head_rows),
                 (a.query_row.query_allowed, b.query_row.query_allowed), (a.qkv.q, b.qkv.q), (a.qkv.k, b.qkv.k),
                 (a.overview.thumbs, b.overview.thumbs)]:  # fmt: skip
        assert np.array_equal(x, y, equal_nan=True)
    if b.scores.tile is None:
        assert a.scores.tile is None
    else:
        assert a.scores.tile_origin == b.scores.tile_origin
        assert np.array_equal(a.scores.tile, b.scores.tile, equal_nan=True)


@pytest.mark.parametrize(
    "sel",
    [Selection(layer=1, head=2), Selection(kind="scores"), Selection(head=3, view=(0, 1000, 0, 1000))],
    ids=["probs", "raw-stage", "exact-tile"],
)
def test_a_step_and_its_pooled_repaint_are_one_round_trip_with_the_local_numbers(server, local_lm, pooled, sel):
    s = gi.Session(local_lm, PROMPT)
    with RemoteSession(server.url, timeout=20) as r:
        r.open(PROMPT)
        vms = []
        for x in (s, r):
            x.step()
            vm = viewdata.ViewModel(x)
            vm.build(sel)
            vms.append(vm)
        local, remote = vms
        assert s.cache_length > viewdata.EXACT_LIMIT  # the pooled path, or the test proves nothing
        sent: list[str] = []
        call = r._call_t

        def logged(op, **args):
            sent.append(op)
            return call(op, **args)

        r._call_t = logged
        trips = []
        for _ in range(10):
            s.step()
            sent.clear()
            r.step()
            snap = remote.build()
            _same(snap, local.build())
            grew = pow2_block(snap.T, DISPLAY) != pow2_block(snap.T - 1, DISPLAY)
            trips.append((snap.T, list(sent), grew))
        # the first step after the first build, and a step whose block size doubles, read more
        for t, ops, grew in trips[1:]:
            assert ops == ["step"] or grew, (t, ops)
        assert any(t % snap.scores.matrix_block == 1 for t, _, _ in trips[1:])  # a step began a new row block
