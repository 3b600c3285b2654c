"""The public run-source protocol: ``records`` (what a run recorded) and ``live`` (what can run on it).

Every kind of source (a live session, an inspected beam, an opened trace, the KV lab's policy run)
answers the probe and the math check with a result or one line saying why not.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpt_inspector as gi
from gpt_inspector.core.beams import BeamSearch
from gpt_inspector.core.errors import InspectorError
from gpt_inspector.core.kvlab import KVLab, make
from gpt_inspector.core.live import CAPABILITIES, Live
from gpt_inspector.core.mathcheck import check, check_all
from gpt_inspector.core.probe import probe_session
from gpt_inspector.core.source import RunRecords, RunSource

PROMPT = "The cat sat on the mat. One two three"


@pytest.fixture(scope="module")
def kinds(tiny_lm, tmp_path_factory):
    """One source of every kind, on the same tiny llama (GQA, RoPE)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model; threads only add OpenMP spinning on a busy machine
    lm = tiny_lm("llama")
    session = gi.Session(lm, PROMPT)
    session.run(3)
    bs = BeamSearch(lm, PROMPT, num_beams=2, num_return_sequences=2, max_new_tokens=3)
    bs.run()
    path = tmp_path_factory.mktemp("trace") / "t.safetensors"
    session.save_trace(path)
    lab = KVLab(lm, PROMPT, make("streaming", 6))
    lab.run_steps(4)
    yield {"session": session, "beam": bs.result_view(1), "trace": gi.load_trace(path), "policy run": lab.run}
    torch.set_num_threads(n)


def test_every_source_offers_its_records_through_the_protocol(kinds):
    for name, src in kinds.items():
        assert isinstance(src, RunSource) and isinstance(src.records, RunRecords), name
        assert isinstance(src.live, Live), name
        t = src.cache_length
        for layer in range(src.n_layers):
            assert src.records.queries(layer).shape[:2] == (src.n_heads, t), name
            assert src.records.keys(layer).shape[:2] == (src.n_kv_heads, t), name
            assert src.records.head_outputs(layer).shape[1] == t - src.head_output_start, name


# what each kind of source can run; the rest is refused in one line
CAN = {
    "session": set(CAPABILITIES),
    "beam": {"probe", "compare"},
    "trace": set(),
    "policy run": {"step", "kvlab", "compare"},
}


@pytest.mark.parametrize("name", list(CAN))
def test_live_says_what_runs_and_why_the_rest_does_not_in_one_line(kinds, name):
    live = kinds[name].live
    assert {c for c in CAPABILITIES if live.can(c)} == CAN[name]
    for c in CAPABILITIES:
        why = live.why_not(c)
        assert (why is None) == (c in CAN[name])
        if why is not None:
            assert why and "\n" not in why
            with pytest.raises(InspectorError) as e:
                live.require(c)
            assert str(e.value) == why
    if name == "trace":
        assert all("a trace file has no model" in live.why_not(c) for c in CAPABILITIES)
    with pytest.raises(ValueError, match="unknown capability"):
        live.can("teleport")


def test_probe_recovers_the_prompt_where_live_allows_it(kinds):
    for name in ("session", "beam"):
        src = kinds[name]
        got = probe_session(src, layers=[0, 1])
        # the true tokens are the source's own; every cached position reads back as its token
        assert got.true_tokens == src.processed_tokens, name
        assert [p.token_id for p in got.layers[0].positions] == src.processed_tokens, name
        assert got.all_recovered, name


@pytest.mark.parametrize("name,says", [("trace", "a trace file has no model"), ("policy run", "KV cache lab's Probe")])
def test_probe_refuses_in_one_line_where_live_does_not_allow_it(kinds, name, says):
    with pytest.raises(InspectorError, match=says) as e:
        probe_session(kinds[name])
    assert "\n" not in str(e.value) and str(e.value) == kinds[name].live.why_not("probe")


def _by_hand(src, layer: int, head: int, pos: int) -> np.ndarray:
    """The head's output at ``pos`` written out here in float64: softmax(q K^T s + mask) V (no sinks,
    no soft-cap, no bias on this llama), with the keys a policy evicted or the mask hides left out."""
    q, k, v = (x.astype(np.float64) for x in src.qkv(layer))
    kvh = src.kv_head_of(head, layer)
    allowed = src.allowed(layer, head)[pos]  # (T,)
    scores = q[head, pos] @ k[kvh].T * src.scaling(layer)  # (T,)
    scores[~allowed] = -np.inf
    w = np.exp(scores - scores.max())
    return (w / w.sum()) @ v[kvh]  # (d,)


@pytest.mark.parametrize("name", ["session", "beam", "trace", "policy run"])
def test_math_check_runs_on_every_kind_of_source(kinds, name):
    src = kinds[name]
    t = src.cache_length
    for layer, head in ((0, 0), (1, 3)):
        c = check(src, layer, head)
        assert c.position == t - 1 and c.ok, (name, c.summary())
        np.testing.assert_allclose(c.recomputed, _by_hand(src, layer, head, t - 1), rtol=1e-9, atol=1e-12)
        np.testing.assert_array_equal(c.model, src.attention_output(layer)[head, t - 1])
    report = check_all(src)
    assert report.ok, (name, report.summary())
    assert report.first_position == src.head_outputs_from


def test_a_policy_run_keeps_every_row_and_refuses_a_recompute_without_its_evictions(kinds):
    # the lab's recorder keeps every head output the policy run computed (a scratch forward would
    # not replay the policy's evictions or quantization), so there is nothing to recompute
    run = kinds["policy run"]
    assert run.head_output_start == 0 and run.head_outputs_from == 0
    assert not run.live.can("recompute") and "evictions" in run.live.why_not("recompute")
    assert np.isfinite(run.attention_output(0)).all()
    c = check(run, 0, 0, 0)
    assert c.ok and c.position == 0
    # a live session keeps them from the prompt's last position on and recomputes the rows before it
    s = kinds["session"]
    assert s.head_output_start == s.prompt_length - 1 and s.live.can("recompute") and s.head_outputs_from == 0
    c = check(s, 0, 0, 0)
    np.testing.assert_allclose(c.recomputed, _by_hand(s, 0, 0, 0), rtol=1e-9, atol=1e-12)
    assert c.ok and np.isfinite(c.model).all()


def test_a_trace_says_in_one_line_that_rows_it_did_not_keep_cannot_be_checked(kinds):
    tr = kinds["trace"]
    start = tr.head_output_start
    assert start == tr.prompt_length - 1 and tr.head_outputs_from == start
    assert np.isnan(tr.attention_output(0)[:, :start]).all()  # never a made-up number
    with pytest.raises(InspectorError, match="is not kept") as e:
        check(tr, 0, 0, start - 1)
    assert "\n" not in str(e.value)


def test_a_source_written_only_against_the_public_protocol_reads_like_the_session(kinds):
    """A user's own source: shapes, tokens and a RunRecords, nothing private; the shared reader
    derives the same matrices and the math check passes on it."""
    s = kinds["session"]

    class Copied(RunRecords):
        head_output_start = 0
        edits = None

        def __init__(self):
            L = range(s.n_layers)
            self.q = [s.queries(i).clone() for i in L]
            self.k = [s.keys(i).clone() for i in L]
            self.v = [s.values(i).clone() for i in L]
            self.out = [s.head_outputs(i).clone() for i in L]  # every row: the session recomputes the early ones
            self.rows = [dict(s.mask_rows(i)) for i in L]
            self.sc = [s.scaling(i) for i in L]

        def queries(self, layer):
            return self.q[layer]

        def keys(self, layer):
            return self.k[layer]

        def values(self, layer):
            return self.v[layer]

        def head_outputs(self, layer):
            return self.out[layer]

        def mask_rows(self, layer):
            return self.rows[layer]

        def scaling(self, layer):
            return self.sc[layer]

        def softcap(self, layer):
            return None

    class Mine(RunSource):
        n_layers, n_heads, n_kv_heads, head_dim = s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim
        cache_length, kv_itemsize, cache_dtype = s.cache_length, 4, "float32"
        records = Copied()

    mine = Mine()
    assert not any(mine.live.can(c) for c in CAPABILITIES)
    for layer in range(s.n_layers):
        for kind in ("raw", "scores", "probs"):
            np.testing.assert_array_equal(mine.attention_rows(layer, 0, s.cache_length, kind),
                                          s.attention_rows(layer, 0, s.cache_length, kind))  # fmt: skip
    assert check_all(mine).ok and check_all(mine).first_position == 0
