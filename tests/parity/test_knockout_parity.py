"""Knock-out and patching against HF: a copy of the model with the head's output-projection inputs
zeroed, and a forward pre-hook that writes the other run's head output."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import gpt_inspector as gi
from gpt_inspector.core.capture import HeadEdit

PROMPT = "She eats an apple. He reads"
OTHER = "The cat sat on the mat and the dog ran"


def _proj(model, family, layer):
    base = model.base_model
    layers = base.h if family == "gpt2" else base.layers
    return layers[layer].attn.c_proj if family == "gpt2" else layers[layer].self_attn.o_proj


def _knocked(hf, family, layer, heads, d):
    m = copy.deepcopy(hf)
    proj = _proj(m, family, layer)
    with torch.no_grad():
        for h in heads:
            if family == "gpt2":
                proj.weight[h * d : (h + 1) * d, :] = 0  # Conv1D: x @ W, rows are inputs
            else:
                proj.weight[:, h * d : (h + 1) * d] = 0  # Linear: columns are inputs
    return m


def _check_every_step(s, ref_model, atol=1e-5):
    ids = torch.tensor([s.tokens[:-1]])
    with torch.no_grad():
        ref = ref_model(ids).logits[0]  # (T, V)
    for st in s.steps_done:
        np.testing.assert_allclose(
            st.logits.numpy(), ref[st.position].numpy(), atol=atol * max(1.0, float(ref.abs().max()))
        )


@pytest.mark.parametrize("family, layer, head", [("gpt2", 1, 2), ("llama", 0, 3)])
def test_knock_out_equals_zeroed_output_projection(family, layer, head, tiny_lm, hf_eager):
    lm = tiny_lm(family)
    s = gi.Session(lm, PROMPT)
    s.run(3)
    before = s.current.probs.clone()
    report = s.set_head_edits([HeadEdit(layer, head)])
    assert report.earliest_position == 0 and report.total_variation > 0
    assert torch.equal(report.before, before)
    s.run(3)  # later steps keep the knock-out
    _check_every_step(s, _knocked(hf_eager(family), family, layer, [head], lm.head_dim))
    assert s.recipe()["head_edits"] == [{"layer": layer, "head": head, "patch_from": None}]
    again = gi.Session.replay(lm, s.recipe())
    assert again.tokens == s.tokens
    assert all(torch.equal(a.logits, b.logits) for a, b in zip(again.steps_done, s.steps_done))


def test_knocking_out_a_whole_layer(tiny_lm, hf_eager):
    lm = tiny_lm("gpt2")
    s = gi.Session(lm, PROMPT)
    s.run(2)
    s.set_head_edits([HeadEdit(0)])
    s.run(2)
    _check_every_step(s, _knocked(hf_eager("gpt2"), "gpt2", 0, range(lm.n_heads), lm.head_dim))
    np.testing.assert_array_equal(s.attention_output(0), 0)  # what the projection saw
    s.set_head_edits([])  # undone: the clean numbers again
    _check_every_step(s, hf_eager("gpt2"))


@pytest.mark.parametrize("family, layer, head", [("gpt2", 0, 1), ("llama", 1, 2)])
def test_patching_equals_a_forward_hook_writing_the_other_runs_head(family, layer, head, tiny_lm, hf_eager):
    lm = tiny_lm(family)
    src = gi.Session(lm, OTHER)
    src.run(6)
    s = gi.Session(lm, PROMPT)
    s.run(3)
    s.set_head_edits([s.patch_edit(layer, head, src)])
    hf = hf_eager(family)
    d = lm.head_dim
    proj = _proj(hf, family, layer)
    seen = {}
    grab = proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].detach().clone()))
    with torch.no_grad():
        hf(torch.tensor([src.processed_tokens]))
    grab.remove()
    other = seen["x"][0, :, head * d : (head + 1) * d]  # (T_src, d) the source's head output, from HF

    def write(m, args):
        x = args[0].clone()
        t = x.shape[1]
        x[0, :, head * d : (head + 1) * d] = other[:t]
        return (x,)

    hook = proj.register_forward_pre_hook(write)
    try:
        _check_every_step(s, hf)
    finally:
        hook.remove()


def test_bad_head_edits_leave_the_session_untouched(tiny_lm, tiny_dir):
    lm = tiny_lm("gpt2")
    s = gi.Session(lm, PROMPT)
    s.run(3)
    logits = [st.logits.clone() for st in s.steps_done]
    short = gi.Session(lm, "She")
    short.run(1)
    other_model = gi.Session(tiny_lm("llama"), PROMPT)
    other_model.run(4)
    for bad, word in [
        (lambda: s.set_head_edits([HeadEdit(0, lm.n_heads)]), "head"),
        (lambda: s.set_head_edits([HeadEdit(lm.n_layers, 0)]), "layer"),
        (lambda: s.patch_edit(0, 0, short), "positions"),
        (lambda: s.patch_edit(0, 0, other_model), "same model"),
        (lambda: s.set_head_edits([HeadEdit(0, None, (1, 2, 3, 4, 5, 6, 7, 8, 9, 10))]), "one head"),
        (lambda: s.set_head_edits(["not an edit"]), "HeadEdit"),
    ]:
        with pytest.raises(gi.InspectorError, match=word):
            bad()
    assert s.head_edits == [] and all(torch.equal(a, b.logits) for a, b in zip(logits, s.steps_done))


def test_head_edits_live_in_the_trace(tiny_lm, tmp_path):
    lm = tiny_lm("gpt2")
    s = gi.Session(lm, PROMPT)
    s.run(3)
    s.set_head_edits([HeadEdit(1, 0), HeadEdit(0)])
    tr = gi.load_trace(s.save_trace(tmp_path / "k.safetensors"))
    assert tr.head_edits == s.head_edits
    np.testing.assert_array_equal(tr.attention_output(0)[:, tr.head_output_start :], 0)


def test_lens_after_step_back_keeps_the_knock_out(tiny_lm):
    """The lens recomputes the current position with the head edits in force, not the clean model."""
    from gpt_inspector.core.lens import lens

    s = gi.Session(tiny_lm("gpt2"), PROMPT)
    s.run(3)
    lens(s)  # the lens is in use: from here on each forward records the residual
    s.set_head_edits([HeadEdit(0)])  # layer 0: its lens row is not the model's logits, so it shows
    recorded = lens(s)  # the residual the recompute recorded at this position
    s.step()
    s.step_back()  # the recorded residual is now another position's: recomputed from scratch
    r = lens(s)
    for a, b in zip(r.layers, recorded.layers):
        assert a.logit == pytest.approx(b.logit, abs=1e-4)
    assert not r.attribution[0].any()  # the knocked-out layer pushes nothing
