"""Attention sinks (gpt_oss): the sink logit joins each softmax row and is dropped, exactly as HF eager."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpt_inspector as gi
from gpt_inspector.core.models import from_model

PROMPT = "She eats an apple. He reads"


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    import tiny_models
    from transformers import AutoModelForCausalLM, GptOssConfig

    tok = tiny_models.build_tokenizer(tmp_path_factory.mktemp("oss"))
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = GptOssConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64, initializer_range=0.3,
                       bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # large sinks, so a dropped sink would move every number
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ref.load_state_dict(model.state_dict())
    return from_model(model, tok, "tiny-gpt-oss"), ref


def test_logits_equal_hf_eager_every_step(oss):
    lm, ref = oss
    s = gi.Session(lm, PROMPT, temperature=0.8, seed=3)
    steps = list(s.steps(8))
    with torch.no_grad():
        want = ref(torch.tensor([s.tokens[:-1]])).logits[0]  # (T, V)
    for st in steps:
        np.testing.assert_allclose(st.logits.numpy(), want[st.position].numpy(), atol=1e-5, rtol=0)


def test_probs_equal_output_attentions_and_rows_sum_to_one_minus_sink(oss):
    lm, ref = oss
    s = gi.Session(lm, PROMPT)
    s.run(6)
    t = s.cache_length
    with torch.no_grad():
        out = ref(torch.tensor([s.tokens[:t]]), output_attentions=True)
    for layer in range(lm.n_layers):
        sink = s.sink(layer)
        assert sink.shape == (lm.n_heads,)
        torch.testing.assert_close(sink, ref.model.layers[layer].self_attn.sinks.detach())
        probs = s.attention_rows(layer, 0, t, "probs")  # (H, T, T)
        np.testing.assert_allclose(probs.numpy(), out.attentions[layer][0].numpy(), atol=1e-5, rtol=0)
        mass = 1 - probs.sum(-1)  # (H, T): the sink's share of each row
        assert float(mass.amax()) > 0.1 and (mass > -1e-6).all() and (mass < 1).all()
        # the sink's share is what softmax gives the sink logit next to the row's allowed scores
        ms = s.attention_rows(layer, 0, t, "masked_scores")  # (H, T, T)
        expect = torch.softmax(torch.cat([ms, sink[:, None, None].expand(-1, t, 1)], -1), -1)[..., -1]
        torch.testing.assert_close(mass, expect, atol=1e-5, rtol=0)
        np.testing.assert_allclose(s.attention(layer, 1, "probs"), probs[1].numpy(), atol=1e-6)


def test_greedy_equals_generate(oss):
    lm, ref = oss
    s = gi.Session(lm, PROMPT)
    list(s.steps(10))
    with torch.no_grad():
        want = ref.generate(torch.tensor([s.prompt_ids]), do_sample=False, max_new_tokens=10,
                            pad_token_id=lm.eos_token_ids[0])  # fmt: skip
    assert s.tokens == want[0].tolist()


def test_sinks_survive_a_trace(oss, tmp_path):
    lm, _ = oss
    s = gi.Session(lm, PROMPT)
    s.run(3)
    t = gi.load_trace(s.save_trace(tmp_path / "oss.safetensors"))
    for layer in range(lm.n_layers):
        torch.testing.assert_close(t.sink(layer), s.sink(layer))
        np.testing.assert_allclose(t.attention(layer, 2, "probs"), s.attention(layer, 2, "probs"), atol=1e-6)


def test_math_check_counts_the_sink(oss):
    from gpt_inspector.core import mathcheck

    lm, _ = oss
    s = gi.Session(lm, PROMPT)
    s.run(4)
    report = mathcheck.check_all(s)
    assert (report.max_diff <= report.tolerance).all()
    one = mathcheck.check(s, 1, 2)
    assert one.ok and one.weights.sum() < 1
