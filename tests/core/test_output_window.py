"""Head outputs are kept for a fixed window of the newest positions; older rows come back on demand.

The session keeps OUTPUT_WINDOW to 2 x OUTPUT_WINDOW rows (a fixed buffer, whatever the run's
length); these tests shrink the window to 2 and check, against a session that keeps every row,
that nothing a user reads changes: head outputs (recomputed rows within float32 rounding of the
stepped ones, kept rows exact), the logit lens and head attribution, the math check, step back
past the window and on, a mask edit and its rollback, and a saved trace.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpt_inspector as gi
from gpt_inspector.core import MaskEdit, lens, mathcheck, recompute, session
from gpt_inspector.core.errors import Cancelled

PROMPT = "She eats an apple. He reads"


@pytest.fixture
def pair(tiny_lm, monkeypatch):
    """(windowed, reference): the same greedy run, the reference with a window too wide to trim."""

    def make(family):
        lm = tiny_lm(family)
        monkeypatch.setattr(session, "OUTPUT_WINDOW", 1 << 30)
        ref = gi.Session(lm, PROMPT)
        ref.run(9)
        monkeypatch.setattr(session, "OUTPUT_WINDOW", 2)
        s = gi.Session(lm, PROMPT)
        s.run(9)
        return s, ref

    return make


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    # recomputed rows come from one forward over the tokens, the reference's from stepping: float32
    # rounding apart, scaled to the values' size
    tol = 1e-5 * max(1.0, float(b.abs().max()))
    torch.testing.assert_close(a, b, atol=tol, rtol=0)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_window_bounds_the_records_and_changes_no_output(pair, family):
    s, ref = pair(family)
    rec = s.recorder
    assert rec.length - rec.out_from <= 4 and rec.out_from > rec.out_floor  # trimmed to the window
    assert s.record_bytes() < ref.record_bytes()
    for layer in s.attention_layers:
        kept = rec.length - rec.out_from
        a, b = s.head_outputs(layer), ref.head_outputs(layer)  # (H, T, d)
        assert torch.equal(a[:, -kept:], b[:, -kept:])  # the kept rows are the stepped ones, bit for bit
        _close(a, b)
        assert torch.equal(s.head_output_row(layer, s.cache_length - 1), b[:, -1])
    np.testing.assert_array_equal(lens.lens(s).attribution, lens.lens(ref).attribution)


def test_math_check_reads_rows_that_left_the_window(pair):
    s, _ = pair("gpt2")
    early = s.recorder.out_from - 1  # a generated position whose row is no longer kept
    assert early >= len(s.prompt_ids)
    assert mathcheck.check(s, 1, 0, early).ok


def test_step_back_past_the_window_then_on(pair):
    s, ref = pair("gpt2")
    for _ in range(6):
        s.step_back()
        ref.step_back()
    assert s.recorder.out_from == s.cache_length  # nothing kept: the next step writes the first row
    for layer in s.attention_layers:
        _close(s.head_output_row(layer, s.cache_length - 1), ref.head_output_row(layer, ref.cache_length - 1))
    s.run(3)
    ref.run(3)
    assert s.tokens == ref.tokens
    for layer in s.attention_layers:
        assert torch.equal(
            s.head_output_row(layer, s.cache_length - 1), ref.head_output_row(layer, ref.cache_length - 1)
        )
        _close(s.head_outputs(layer), ref.head_outputs(layer))
    while s.steps_done:
        s.step_back()
    assert s.recorder.out_from == s.recorder.out_floor == len(s.prompt_ids) - 1


def test_a_mask_edit_and_its_rollback_keep_the_window_exact(pair, monkeypatch):
    s, ref = pair("gpt2")
    monkeypatch.setattr(recompute, "RECOMPUTE_CHUNK", 3)
    before = [s.head_outputs(layer).clone() for layer in s.attention_layers]
    out_from = s.recorder.out_from
    chunks = []  # cancel the edit after its first chunk: the rollback must be exact
    with pytest.raises(Cancelled):
        s.set_mask_edits([MaskEdit(3, 1)], progress=lambda d, t: chunks.append(d), cancelled=lambda: len(chunks) >= 1)
    assert chunks
    assert s.recorder.out_from == out_from
    for layer, b in zip(s.attention_layers, before):
        assert torch.equal(s.head_outputs(layer), b)
    s.set_mask_edits([MaskEdit(3, 1)])
    ref.set_mask_edits([MaskEdit(3, 1)])
    assert s.recorder.length - s.recorder.out_from <= 4  # the recompute wrote every row; the window is back
    for layer in s.attention_layers:
        _close(s.head_outputs(layer), ref.head_outputs(layer))


def test_a_saved_trace_has_every_generated_row(pair, as_trace):
    s, ref = pair("llama")
    t = as_trace(s)
    assert t.head_output_start == ref.head_output_start
    for layer in s.attention_layers:
        _close(t.head_outputs(layer)[:, t.head_output_start :], ref.head_outputs(layer)[:, ref.head_output_start :])
