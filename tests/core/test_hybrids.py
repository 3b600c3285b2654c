"""Hybrid models (state-space or convolution layers beside attention): stepping back, faults, edits.

A state-space layer's running state is overwritten at every step, so it cannot be cropped like
K/V; the session's cache keeps it per step (core.state_cache) and puts it back bit for bit.
"""

from __future__ import annotations

import pytest
import tiny_families
import tiny_models
import torch

import gpt_inspector as gi
from gpt_inspector.core import capture
from gpt_inspector.core.models import from_model

PROMPT = "She eats an apple. He reads"


@pytest.fixture(scope="module")
def lm_of(tmp_path_factory):
    tok = tiny_models.build_tokenizer(tmp_path_factory.mktemp("tok"))
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = from_model(tiny_families.build_model(family, eos), tok, family)
        return cache[family]

    return get


# jamba: a Mamba layer (recurrent + convolution state) then attention; lfm2: a short convolution;
# falcon_h1: Mamba2 beside attention in every layer; nemotron_h: Mamba2, MoE-only, attention, MLP-only
# layers; qwen3_next: gated DeltaNet; zaya: convolution and recurrent states inside every attention layer
@pytest.mark.parametrize("family", ["jamba", "lfm2", "falcon_h1", "nemotron_h", "qwen3_next", "zaya"])
def test_step_back_then_forward_again_is_bit_identical(family, lm_of):
    lm = lm_of(family)
    assert lm.kv_layout.state_layers
    s = gi.Session(lm, PROMPT)
    first = [st.logits.clone() for st in s.steps(5)]
    for _ in range(3):
        s.step_back()
    assert s.cache_length == len(s.prompt_ids) + 1
    again = [st.logits.clone() for st in s.steps(3)]
    for a, b in zip(first[2:], again):
        assert torch.equal(a, b)  # the state layers went back exactly, not approximately
    s.restart()
    assert [st.logits for st in s.steps(5)][-1].equal(first[-1])


def test_a_fault_mid_step_rewinds_the_state_layers(lm_of, monkeypatch):
    lm = lm_of("jamba")  # layer 0 (Mamba) runs before the fault in layer 1's attention
    clean = gi.Session(lm, PROMPT)
    want = [st.logits for st in clean.steps(3)]
    s = gi.Session(lm, PROMPT)
    s.run(2)
    real = capture.Recorder._record
    calls = []

    def boom(self, layer, *a, **k):
        calls.append(layer)
        raise RuntimeError("injected fault")

    monkeypatch.setattr(capture.Recorder, "_record", boom)
    with pytest.raises(gi.StepFailed, match="injected fault"):
        s.step()
    assert calls == [1]
    monkeypatch.setattr(capture.Recorder, "_record", real)
    assert torch.equal(s.step().logits, want[2])


def test_non_attention_layers_are_named_and_refused_in_one_line(lm_of):
    lm = lm_of("jamba")
    s = gi.Session(lm, PROMPT)
    s.run(1)
    assert s.attention_layers == (1,) and lm.kv_layout.layers[0] is None
    assert "layers 0: no attention (state-space)" in lm.describe()
    for call in (lambda: s.attention(0, 0), lambda: s.qkv(0), lambda: s.attention_rows(0, 0, 1), lambda: s.scaling(0)):
        with pytest.raises(gi.InspectorError, match=r"layer 0 has no attention \(state-space\)") as e:
            call()
        assert "\n" not in str(e.value)
    assert s.attention(1, 0).shape == (s.cache_length, s.cache_length)
    assert s.kv_cache_bytes(0) == 0 and s.kv_cache_bytes() == s.kv_cache_bytes(1) > 0


def test_mask_edits_are_refused_in_one_line_and_change_nothing(lm_of):
    s = gi.Session(lm_of("lfm2"), PROMPT)
    before = [st.logits.clone() for st in s.steps(2)]
    with pytest.raises(gi.InspectorError, match="not available for hybrid models") as e:
        s.add_mask_edit(gi.MaskEdit(query=s.cache_length - 1, key=0, layer=1))
    assert "\n" not in str(e.value) and s.mask_edits == []
    assert all(torch.equal(a, b.logits) for a, b in zip(before, s.steps_done))
    assert torch.equal(s.step().logits, gi.Session(s.lm, PROMPT).run(3)[-1].logits)


def test_traces_of_hybrids_are_refused_in_one_line(lm_of, tmp_path):
    s = gi.Session(lm_of("jamba"), PROMPT)
    s.run(1)
    with pytest.raises(gi.InspectorError, match="hybrid models"):
        s.save_trace(tmp_path / "t.safetensors")
    assert not (tmp_path / "t.safetensors").exists()


def test_math_check_covers_the_attention_layers_only(lm_of):
    from gpt_inspector.core.mathcheck import check_all

    s = gi.Session(lm_of("jamba"), PROMPT)
    s.run(2)
    report = check_all(s)
    assert list(report.layers) == [1] and report.ok


def test_describe_names_state_space_and_feed_forward_only_layers(lm_of):
    lm = lm_of("nemotron_h")  # Mamba2, MoE, attention, MLP
    assert lm.kv_layout.attention_layers == (2,) and lm.kv_layout.state_layers == (0,)
    text = lm.describe()
    assert "layers 0: no attention (state-space)" in text and "layers 1, 3: no attention (feed-forward only)" in text


def test_a_layer_that_skips_the_attention_function_is_still_refused(lm_of, monkeypatch):
    # only a cache's state-space or feed-forward-only slots may go without attention
    from gpt_inspector.core import kv_layout

    lm = lm_of("jamba")  # loaded (and accepted) before the layout is broken, whichever test ran first
    monkeypatch.setattr(kv_layout, "silent_layers", lambda cache: set())
    with pytest.raises(gi.InspectorError, match=r"layers \[0\] did not call"):
        from_model(lm.model, lm.tokenizer, "jamba")


def test_the_cache_probe_refuses_a_hybrid_in_one_line(lm_of):
    from gpt_inspector.core.probe import probe_session

    s = gi.Session(lm_of("jamba"), PROMPT)
    s.run(1)
    with pytest.raises(gi.InspectorError, match="state-space layers keep a running state") as e:
        probe_session(s)
    assert "\n" not in str(e.value)
