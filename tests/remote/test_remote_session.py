"""gi.connect against a real ``gpt-inspector serve`` process: the numbers are the local session's, bit for bit."""

from __future__ import annotations

import pytest
import torch

import gpt_inspector as gi
from gpt_inspector.core.edits import HeadEdit
from gpt_inspector.core.step import top_entries

PROMPT = "She eats an apple. He reads"


def _same_state(r, s):
    assert r.tokens == s.tokens
    assert r.token_labels() == s.token_labels()
    assert r.cache_length == s.cache_length and r.n_steps == s.n_steps and r.finished == s.finished
    assert r.decoding == s.decoding and r.mask_edits == s.mask_edits and r.head_edits == s.head_edits
    for a, b in zip(r.steps_done, s.steps_done):
        assert (a.index, a.position, a.token_id, a.label, a.forced) == (
            b.index,
            b.position,
            b.token_id,
            b.label,
            b.forced,
        )
        assert a.entropy == b.entropy and a.prob == b.prob and a.top == b.top


def _same_numbers(r, s):
    t = s.cache_length
    for layer in range(s.n_layers):
        assert torch.equal(r.queries(layer), s.queries(layer))
        assert torch.equal(r.keys(layer), s.keys(layer))
        assert torch.equal(r.values(layer), s.values(layer))
        for kind in ("raw", "scores", "masked_scores", "probs"):
            assert torch.equal(r.attention_rows(layer, 0, t, kind), s.attention_rows(layer, 0, t, kind))
    logits, probs = r.distribution()
    assert torch.equal(logits, s.current.logits) and torch.equal(probs, s.current.probs)
    assert r.top(n=20) == top_entries(s.current.probs, s.current.logits, s.label, 20)


def test_every_number_read_remotely_is_the_local_sessions(server, local_lm):
    s = gi.Session(local_lm, PROMPT, temperature=0.8, top_k=50, seed=3)
    with gi.connect(server.url, prompt=PROMPT, temperature=0.8, top_k=50, seed=3) as r:
        assert (r.model_name, r.n_heads, r.n_kv_heads, r.n_layers) == (
            s.model_name,
            s.n_heads,
            s.n_kv_heads,
            s.n_layers,
        )
        r.step(), s.step()
        r.run(5), s.run(5)
        _same_state(r, s)
        _same_numbers(r, s)
        # a row range, a head subset, fewer keys: what a view asks for, the same cells
        t = s.cache_length
        assert torch.equal(r.attention_rows(1, t - 3, t, "scores", heads=[3, 0], keys=t),
                           s.attention_rows(1, t - 3, t, "scores", heads=[3, 0], keys=t))  # fmt: skip
        stacked = torch.stack([s.attention_rows(i, t - 1, t, heads=[2]) for i in (1, 0)])  # (2, 1, 1, T)
        assert torch.equal(r.layers_attention_rows([1, 0], t - 1, t, heads=[2]), stacked)
        assert torch.equal(r.queries(0, 2, 5, heads=[1, 3]), s.queries(0)[[1, 3]][:, 2:5])
        assert torch.equal(r.keys(1, 0, 4, heads=[1]), s.keys(1)[[1]][:, 0:4])
        assert (r.attention(0, 2, "probs") == s.attention(0, 2, "probs")).all()
        for a, b in zip(r.qkv(1), s.qkv(1)):
            assert (a == b).all()

        # live decoding, a redecided token, a forced one, a step back: the state and the numbers follow
        r.set_decoding(temperature=1.5, top_p=0.9, redecide=True)
        s.set_decoding(temperature=1.5, top_p=0.9, redecide=True)
        r.force_token(7), s.force_token(7)
        r.step(), s.step()
        r.step_back(), s.step_back()
        _same_state(r, s)
        _same_numbers(r, s)

        # a mask edit and a knock-out recompute the run on the server; the reports agree
        edit = gi.MaskEdit(query=t - 1, key=2, layer=0, head=1)
        ra, sa = r.set_mask_edits([edit]), s.set_mask_edits([edit])
        assert ra.earliest_position == sa.earliest_position and ra.recomputed == sa.recomputed
        assert torch.equal(ra.before, sa.before) and torch.equal(ra.after, sa.after) and ra.total_variation > 0
        rb, sb = r.set_head_edits([HeadEdit(1, 2)]), s.set_head_edits([HeadEdit(1, 2)])
        assert torch.equal(rb.after, sb.after)
        r.step(), s.step()
        _same_state(r, s)
        _same_numbers(r, s)
        assert r.recipe() == s.recipe()

        r.restart(), s.restart()
        assert r.n_steps == 0 and r.tokens == s.tokens == s.prompt_ids


def test_only_the_rows_asked_for_cross_the_wire(server):
    with gi.connect(server.url, prompt=PROMPT * 2) as r:
        r.step()
        t, h = r.cache_length, r.n_heads
        before = r.bytes_received
        row = r.attention_rows(0, t - 1, t)  # the newest row of every head: what a step repaints
        got = r.bytes_received - before
        assert row.shape == (h, 1, t)
        assert h * t * 4 <= got < h * t * 4 + 1024  # the floats asked for and a short header, no more
        before = r.bytes_received
        r.attention(0, 0)  # one whole head, asked for: T x T crosses
        assert r.bytes_received - before >= t * t * 4
        before = r.bytes_received
        r.step()  # a step brings its token, label and top-k: a few hundred bytes, whatever T and V
        assert r.bytes_received - before < 4096


def test_bad_reads_and_commands_are_refused_in_one_line_and_the_session_goes_on(server):
    with gi.connect(server.url, prompt=PROMPT) as r:
        r.step()
        tokens = list(r.tokens)
        for bad in (lambda: r.queries(9), lambda: r.attention_rows(0, 3, 99), lambda: r.queries(0, heads=[4]),
                    lambda: r.keys(0, heads=[2]), lambda: r.attention(0, 0, "nope"), lambda: r.force_token(10**6),
                    lambda: r.set_decoding(temperature=-1.0), lambda: r.top(index=5), lambda: r.run(-1)):  # fmt: skip
            with pytest.raises(gi.InspectorError) as e:
                bad()
            assert "\n" not in str(e.value) and str(e.value)
        assert r.tokens == tokens
        r.step()
        assert r.n_steps == 2


def test_a_script_can_open_and_later_attach_to_the_servers_session(server):
    with gi.connect(server.url, prompt="One two three") as r:
        r.run(3)
        tokens = list(r.tokens)
    with gi.connect(server.url) as again:  # no prompt: the session the server holds, as it was left
        assert again.tokens == tokens and again.n_steps == 3 and again.prompt == "One two three"
