"""The contract across families: every decoder-only family transformers ships is exact or refused.

Each family is built from its own config class with tiny sizes (tests/tiny_families.py), weights
scaled up (initializer_range 0.3) so attention is far from uniform and sliding windows narrower
than the sequence. For every verified family, per-step logits equal HF eager, the probabilities
equal ``output_attentions`` and greedy equals ``generate``; the families that compute attention
in their own code (``ADAPTED``, run through gpt-inspector's adapters) also run a beam search
that must equal ``generate(num_beams=...)``. ``VERIFIED`` is explicit on purpose: a transformers
release that breaks one of them fails here, by name.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import gpt_inspector as gi
import tiny_families
import tiny_models
from gpt_inspector.core.fidelity import REFUSED, check_supported
from gpt_inspector.core.models import from_model

PROMPT = "She eats an apple. He reads"
STEPS = 6

# checked on transformers 5.23.0 (README "Model families" lists them)
VERIFIED = """
afmoe apertus arcee aria_text beam biogpt bitnet cohere cohere2 cohere2_moe ctrl cwm diffllama dots1 ernie4_5
ernie4_5_moe exaone4 exaone_moe flex_olmo flint gemma gemma2 gemma3_text glm glm4 glm4_moe gpt-sw3
gpt2 gpt_bigcode gpt_neox gpt_oss granite granite_swa granitemoe granitemoe_swa granitemoeshared
helium hunyuan_v1_dense hunyuan_v1_moe hy_v3 hyperclovax internlm3 iquestcoder jais2 kolibri1 laguna
llama llama4_text mellum mimo_v2_flash minimax_m2 ministral ministral3 mistral
mixtral modernbert-decoder moshi nanochat nemotron olmo olmo2 olmo3 olmoe opt persimmon phi phi3
phimoe qwen2 qwen2_moe qwen3 qwen3_moe seed_oss smollm3 solar_open stablelm starcoder2 vaultgemma
bloom codegen doge falcon gpt_neo gpt_neox_japanese gptj mpt xglm
""".split()
# computed in the family's own attention code (or, doge, with a bias inside its mask): gpt-inspector's adapters
ADAPTED = "bloom codegen doge falcon gpt_neo gpt_neox_japanese gptj mpt xglm".split()
# other code paths of those families (tests/tiny_families.py VARIANTS): multi-head and new-architecture
# Falcon, MPT with clip_qkv
VARIANTS = ["falcon_mha", "falcon_new_arch", "mpt_clip_qkv"]

# these report softmax weights before their sink (the sink scales the output afterwards); ours are
# the weights the values really get, so they equal HF's times each row's share left by the sink
SINK_AFTER_SOFTMAX = {"granite_swa", "granitemoe_swa"}
# HF's own generate for MoshiForCausalLM leaves its full forward after the first new token (our
# stepped logits equal that full forward at every step), so greedy is compared with the forward
GENERATE_UNRELIABLE = {"moshi"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_models.build_tokenizer(tmp_path_factory.mktemp("families_tok"))


@pytest.fixture(scope="module")
def built(tokenizer):
    """family -> (LoadedModel through our attention, the same weights with eager attention)."""
    cache = {}
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")

    def get(family):
        if family not in cache:
            model = tiny_families.build_model(family, eos)
            ref = copy.deepcopy(model).eval()  # built with eager attention: the reference
            cache[family] = (from_model(model, tokenizer, family), ref)
        return cache[family]

    return get


def _tol(ref: torch.Tensor) -> float:
    # float32 rounding grows with the logits' magnitude; 2e-5 of it is far below any real difference
    return 2e-5 * max(1.0, float(ref.abs().max()))


@pytest.mark.parametrize("family", VERIFIED + VARIANTS)
def test_family_equals_hf_eager(family, built):
    lm, ref = built(family)
    assert lm.unverified is None
    s = gi.Session(lm, PROMPT)
    steps = list(s.steps(STEPS))
    t = s.cache_length
    with torch.no_grad():
        out = ref(torch.tensor([s.tokens[:t]]), output_attentions=True)
        gen = ref.generate(torch.tensor([s.prompt_ids]), do_sample=False, max_new_tokens=STEPS,
                           pad_token_id=lm.eos_token_ids[0])  # fmt: skip
    logits = out.logits[0]  # (T, V)
    for st in steps:
        np.testing.assert_allclose(st.logits.numpy(), logits[st.position].numpy(), atol=_tol(logits), rtol=0,
                                   err_msg=f"{family}: logits at step {st.index}")  # fmt: skip
    assert out.attentions is not None and len(out.attentions) == lm.n_layers
    for layer in range(lm.n_layers):
        ours = s.attention_rows(layer, 0, t, "probs")  # (H, T, T)
        want = out.attentions[layer][0].float()  # (H, T, T)
        if family in SINK_AFTER_SOFTMAX:
            assert s.sink(layer) is not None and (ours.sum(-1) <= 1 + 1e-6).all() and (ours.sum(-1) < 0.999).any()
            want = want * ours.sum(-1, keepdim=True)
        # 5e-5: peaked rows turn float32 rounding of q (stepped vs full forward) into ~2e-5 here
        np.testing.assert_allclose(ours.numpy(), want.numpy(), atol=5e-5, rtol=0,
                                   err_msg=f"{family}: probabilities of layer {layer}")  # fmt: skip
    if family in GENERATE_UNRELIABLE:
        assert s.tokens[len(s.prompt_ids):] == logits[len(s.prompt_ids) - 1 :].argmax(-1).tolist()
    else:
        assert s.tokens == gen[0].tolist(), f"{family}: greedy differs from generate"


def test_the_sliding_window_is_narrower_than_the_sequence(built):
    # the windowed families above only test windows if the window actually cuts the sequence
    lm, _ = built("mistral")
    s = gi.Session(lm, PROMPT)
    s.run(STEPS)
    allowed = s.allowed(0, 0)
    assert allowed.sum(-1).max() <= lm.model.config.sliding_window < s.cache_length


@pytest.mark.parametrize("family", ["jetmoe", "lfm2", "openai-gpt", "falcon_alibi"])
def test_refused_families_say_why_in_one_line(family, tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model = tiny_families.build_model(family, eos)
    with pytest.raises(gi.InspectorError) as e:
        from_model(model, tokenizer, family)
    assert "not supported" in str(e.value) and "\n" not in str(e.value)
    if family in REFUSED:
        assert REFUSED[family] in str(e.value)
    if family == "falcon_alibi":  # the adapter's own limit: transformers' eager and sdpa disagree
        assert "ALiBi" in str(e.value) and "twice" in str(e.value)


@pytest.mark.parametrize("family", ADAPTED + VARIANTS)
def test_adapted_family_beams_equal_generate(family, built):
    from gpt_inspector.core.beams import BeamSearch

    lm, ref = built(family)
    prompt = gi.Session(lm, PROMPT).prompt_ids
    kw = dict(num_beams=3, num_return_sequences=2, max_new_tokens=5)
    x = torch.tensor([prompt])
    with torch.no_grad():
        want = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False, output_scores=True,
                            return_dict_in_generate=True, pad_token_id=lm.eos_token_ids[0], **kw)  # fmt: skip
    ours = BeamSearch(lm, prompt_ids=prompt, **kw)
    ours.run()
    r = ours.result()
    assert r.sequences == want.sequences.tolist(), f"{family}: beams differ from generate"
    np.testing.assert_allclose(r.sequences_scores, want.sequences_scores.float().numpy(), atol=1e-4, rtol=0)
    # a finished beam's view shows that beam's own attention (its bias included)
    view = ours.result_view(0)
    ids = view.processed_tokens
    with torch.no_grad():
        att = ref(torch.tensor([ids]), output_attentions=True).attentions
    for layer in range(lm.n_layers):
        np.testing.assert_allclose(view.attention_rows(layer, 0, len(ids)).numpy(), att[layer][0].numpy(),
                                   atol=5e-5, rtol=0, err_msg=f"{family}: beam view, layer {layer}")  # fmt: skip


def test_every_refusal_names_a_reason():
    for mt, why in REFUSED.items():
        assert why and "\n" not in why
        with pytest.raises(gi.InspectorError, match="not supported"):
            check_supported(SimpleNamespace(model_type=mt), mt)
    assert not set(REFUSED) & set(VERIFIED)


def test_verified_families_are_still_shipped():
    missing = [f for f in VERIFIED if f not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    assert not missing, f"transformers {transformers.__version__} no longer maps {missing} to a causal LM"


def test_an_additive_bias_is_refused_when_no_adapter_explains_it(tokenizer, monkeypatch):
    # doge passes a learned real-valued bias as its mask; without its adapter (which hands the capture
    # that bias) the capture cannot tell bias from mask and refuses by itself
    from gpt_inspector.core import adapters

    monkeypatch.delitem(adapters.ADAPTERS, "doge")
    model = tiny_families.build_model("doge", tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    with pytest.raises(gi.InspectorError, match="real-valued bias"):
        from_model(model, tokenizer, "doge")
