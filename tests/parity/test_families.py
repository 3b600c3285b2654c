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
import tiny_families
import tiny_models
import torch
import torch.nn.functional as F
import transformers
from on_device import DEVICE, reference
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import gpt_inspector as gi
from gpt_inspector.core import hf
from gpt_inspector.core.fidelity import REFUSED, STEPPED_DECODE, STEPPED_NOTE, check_supported
from gpt_inspector.core.models import from_model

PROMPT = "She eats an apple. He reads"
STEPS = 6

# checked on transformers tiny_families.NEWEST_CHECKED (README "Model families" lists them: scripts/family_table.py)
VERIFIED = """
afmoe apertus arcee aria_text axk1 axk2 bamba beam biogpt bitnet cohere cohere2 cohere2_moe ctrl cwm deepseek_v2 deepseek_v3
deepseek_v32 diffllama dots1 ernie4_5
ernie4_5_moe exaone4 exaone_moe falcon_h1 flex_olmo flint gemma gemma2 gemma3_text gemma3n_text gemma4_text gemma4_unified_text glm glm4 glm4_moe glm4_moe_lite glm_moe_dsa gpt-sw3
gpt2 gpt_bigcode gpt_neox gpt_oss granite granite_swa granitemoe granitemoe_swa
granitemoehybrid granitemoeshared
helium hunyuan_v1_dense hunyuan_v1_moe hy_v3 hy_v4 hyperclovax internlm3 iquestcoder jais2 jamba jetmoe kolibri1 laguna lfm2 lfm2_moe
longcat_flash llama llama4_text mellum mimo_v2_flash minicpm3 minimax_m2 ministral ministral3 mistral
mixtral modernbert-decoder moshi nanochat nemotron nemotron_h olmo olmo2 olmo3 olmo_hybrid olmoe opt persimmon phi phi3
phimoe qwen2 qwen2_moe qwen3 qwen3_5_moe_text qwen3_5_text qwen3_moe qwen3_next seed_oss smollm3 solar_open stablelm starcoder2 vaultgemma youtu zamba2
bloom codegen doge falcon gpt_neo gpt_neox_japanese gptj mpt xglm
apertus1p5_text cohere_compass_text dbrx dots3_note_text exaone lara_mini sarvam_mla sarvam_moe zaya
""".split()
# computed in the family's own attention code (or, doge, with a bias inside its mask): gpt-inspector's adapters
ADAPTED = "bloom codegen doge falcon gpt_neo gpt_neox_japanese gptj mpt xglm".split()
# other code paths of those families (tests/tiny_families.py VARIANTS): multi-head and new-architecture
# Falcon, MPT with clip_qkv, doge with tied key biases (HF's own A = 0); Gemma 4's two other layouts (fewer KV heads
# with keys as values in its full-attention layers; KV-shared last layers, which its forward runs on the kept rows
# only unless adapted); and llama4_text with chunks narrower than the sequence
VARIANTS = [
    "falcon_mha",
    "falcon_new_arch",
    "mpt_clip_qkv",
    "doge_tied",
    "doge_tied_no_window",
    "gemma4_k_eq_v",
    "gemma4_kv_shared",
    "gemma4_unified_kv_shared",
    "llama4_chunked",
]

# these report softmax weights before their sink (the sink scales the output afterwards); ours are
# the weights the values really get, so they equal HF's times each row's share left by the sink
SINK_AFTER_SOFTMAX = {"granite_swa", "granitemoe_swa"}
# HF's own generate for MoshiForCausalLM leaves its full forward after the first new token (our
# stepped logits equal that full forward at every step), so greedy is compared with the forward
GENERATE_UNRELIABLE = {"moshi"}
# HF's full-sequence forward of these is not what generate computes (core.fidelity.STEPPED_DECODE says why; on
# transformers 5.24 and the test sequence the logits of the two part by 11 for deepseek_v32, 1.75 for hy_v4, 0.22
# and 0.14 for nemotron_h's and zamba2's Mamba2 chunked scans; glm_moe_dsa's and axk2's agree here; doge's top-k
# over tied biases keeps other keys, probabilities up to 0.9 apart); the reference is the run generate makes, the
# prompt then one token at a time. Keyed by model_type, so a family's variants follow it
STEPPED_REFERENCE = set(STEPPED_DECODE)


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
            model = tiny_families.build_model(family, eos).to(DEVICE)
            ref = copy.deepcopy(model).eval()  # built with eager attention: the reference
            cache[family] = (from_model(model, tokenizer, family), reference(ref))
        return cache[family]

    return get


def _stepped_eager(ref, tokens: list[int], prompt_len: int) -> SimpleNamespace:
    """HF eager run as generate runs it: the prompt, then one token at a time against its own cache.

    Logits (1, T, V) and per layer the attention rows of every query, (1, H, T, T).
    """
    from transformers import DynamicCache

    ids = torch.tensor([tokens])  # (1, T)
    t = len(tokens)
    cache = DynamicCache(config=ref.config)
    logits, rows = [], []
    for a, b in [(0, prompt_len)] + [(p, p + 1) for p in range(prompt_len, t)]:
        pos = torch.arange(a, b)[None]  # (1, n): generate passes positions (bamba decodes wrongly without)
        o = ref(
            ids[:, a:b],
            **{hf.cache_kwarg(getattr(ref, "_model", ref)): cache},
            use_cache=True,
            output_attentions=True,
            position_ids=pos,
        )
        logits.append(o.logits[0])  # (n, V)
        # a sliding-window cache returns only the keys in reach: the last ones before b, placed at their positions
        rows.append([F.pad(x[0], (b - x.shape[-1], t - b)) for x in o.attentions])  # (H, n, T) per layer
    attentions = [torch.cat([r[layer] for r in rows], dim=1)[None] for layer in range(len(rows[0]))]  # (1, H, T, T)
    return SimpleNamespace(logits=torch.cat(logits)[None], attentions=attentions)


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
    stepped = lm.model.config.model_type in STEPPED_REFERENCE
    # the load says which of the model's computations the numbers are, where it has two
    assert (lm.note == STEPPED_NOTE and STEPPED_NOTE in lm.describe()) if stepped else lm.note is None
    with torch.no_grad():
        if stepped:
            out = _stepped_eager(ref, s.tokens[:t], len(s.prompt_ids))
        else:
            out = ref(torch.tensor([s.tokens[:t]]), output_attentions=True)
        gen = ref.generate(torch.tensor([s.prompt_ids]), do_sample=False, max_new_tokens=STEPS,
                           pad_token_id=lm.eos_token_ids[0])  # fmt: skip
    logits = out.logits[0]  # (T, V)
    for st in steps:
        np.testing.assert_allclose(st.logits.numpy(), logits[st.position].numpy(), atol=_tol(logits), rtol=0,
                                   err_msg=f"{family}: logits at step {st.index}")  # fmt: skip
    # HF returns one matrix per attention layer (hybrids: their state-space layers have none)
    assert out.attentions is not None and len(out.attentions) == len(s.attention_layers)
    for layer, att in zip(s.attention_layers, out.attentions):
        ours = s.attention_rows(layer, 0, t, "probs")  # (H, T, T)
        want = att[0].float()  # (H, T, T)
        if family in SINK_AFTER_SOFTMAX:
            assert s.sink(layer) is not None and (ours.sum(-1) <= 1 + 1e-6).all() and (ours.sum(-1) < 0.999).any()
            want = want * ours.sum(-1, keepdim=True)
        # 5e-5: peaked rows turn float32 rounding of q (stepped vs full forward) into ~2e-5 here
        np.testing.assert_allclose(ours.numpy(), want.numpy(), atol=5e-5, rtol=0,
                                   err_msg=f"{family}: probabilities of layer {layer}")  # fmt: skip
        # the overview's key-limited rows: the same probabilities, the keys past the rows left out
        p0, p1 = t // 3, t // 2
        short = s.attention_rows(layer, p0, p1, "probs", keys=p1)  # (H, n, p1)
        assert short.shape == (ours.shape[0], p1 - p0, p1) and not ours[:, p0:p1, p1:].any()
        np.testing.assert_allclose(short.numpy(), ours[:, p0:p1, :p1].numpy(), atol=1e-6, rtol=0,
                                   err_msg=f"{family}: key-limited rows of layer {layer}")  # fmt: skip
    if family in GENERATE_UNRELIABLE:
        assert s.tokens[len(s.prompt_ids) :] == logits[len(s.prompt_ids) - 1 :].argmax(-1).tolist()
    else:
        assert s.tokens == gen[0].tolist(), f"{family}: greedy differs from generate"


def test_the_sliding_window_is_narrower_than_the_sequence(built):
    # the windowed families above only test windows if the window actually cuts the sequence
    lm, _ = built("mistral")
    s = gi.Session(lm, PROMPT)
    s.run(STEPS)
    allowed = s.allowed(0, 0)
    assert allowed.sum(-1).max() <= lm.model.config.sliding_window < s.cache_length


# blenderbot-small: its causal-LM class sets is_encoder_decoder=False on its config; the refusal must still come
@pytest.mark.parametrize(
    "family", ["openai-gpt", "falcon_alibi", "minimax", "zamba", "bert", "blenderbot-small", "dory"]
)
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
        if lm.model.config.model_type in STEPPED_REFERENCE:  # the beam's own run: its prompt, then its tokens
            att = _stepped_eager(ref, ids, len(prompt)).attentions
        else:
            att = ref(torch.tensor([ids]), output_attentions=True).attentions
    for layer in range(lm.n_layers):
        np.testing.assert_allclose(view.attention_rows(layer, 0, len(ids)).numpy(), att[layer][0].numpy(),
                                   atol=5e-5, rtol=0, err_msg=f"{family}: beam view, layer {layer}")  # fmt: skip


@pytest.mark.parametrize("family", ["doge_tied", "doge_tied_no_window"])
def test_doge_shows_the_keys_its_top_k_keeps_as_generate_runs_it(family, built):
    # with tied key biases, torch.topk's pick among them depends on the row's length: the full-sequence forward
    # (rows of every key), generate's prefill and decode steps (rows of the keys its cache hands each forward:
    # a sliding layer only its window) keep different keys. The session shows generate's.
    lm, ref = built(family)
    s = gi.Session(lm, PROMPT)
    s.run(STEPS)
    t = s.cache_length
    keep, window = ref.config.keep_window_size, ref.config.sliding_window or t
    with torch.no_grad():
        full = ref(torch.tensor([s.tokens[:t]]), output_attentions=True).attentions
        stepped = _stepped_eager(ref, s.tokens[:t], len(s.prompt_ids)).attentions
    in_reach = torch.tensor([min(i + 1, window) for i in range(t)])  # (T,) keys each row's masks allow
    for layer in range(lm.n_layers):
        allowed = torch.from_numpy(np.stack([s.allowed(layer, h) for h in range(lm.n_heads)]))  # (H, T, T)
        # the cut is real: every row with more than `keep` keys in reach keeps exactly `keep` of them
        assert (in_reach > keep).sum() >= t // 2 and keep < window
        assert torch.equal(allowed.sum(-1), in_reach.clamp(max=keep).expand(lm.n_heads, -1))
        ours = s.attention_rows(layer, 0, t, "probs")  # (H, T, T)
        np.testing.assert_allclose(ours.numpy(), stepped[layer][0].numpy(), atol=5e-5, rtol=0)
        # and the full-sequence forward kept other keys: the two references really part here
        assert (ours - full[layer][0]).abs().max() > 0.3


def test_gemma4_layers_keep_their_own_head_size_and_kv_heads(built, tmp_path):
    # the full-attention layer: head size 32 where the sliding one has 16, and (k_eq_v) 1 KV head where it has 2;
    # every per-head read (one head's rows, the math check, a reopened trace) must take the layer's own
    from gpt_inspector.core import mathcheck

    lm, _ = built("gemma4_k_eq_v")
    s = gi.Session(lm, PROMPT)
    s.run(3)
    t = s.cache_length
    shapes = [(s.qkv(layer)[0].shape[2], s.qkv(layer)[1].shape[0]) for layer in range(lm.n_layers)]
    assert shapes == [(16, 2), (32, 1)]
    tr = gi.load_trace(s.save_trace(tmp_path / "g4.safetensors"))
    for layer in range(lm.n_layers):
        every = s.attention_rows(layer, 0, t)  # (H, T, T)
        assert torch.equal(tr.attention_rows(layer, 0, t), every)
        for head in range(lm.n_heads):
            assert torch.equal(s.attention_rows(layer, 0, t, heads=[head])[0], every[head])
            assert mathcheck.check(s, layer, head).kv_head == head // (lm.n_heads // shapes[layer][1])
        assert mathcheck.check_all(s, layers=[layer]).max_diff.max() < 1e-4
    # the KV cache lab sizes its policies by one shape for every layer: refused in one line, not silently wrong
    from gpt_inspector.core.kvlab import KVLab, make

    with pytest.raises(gi.InspectorError, match=r"layers differ \(2 KV heads of size 16, 1 KV heads of size 32\)"):
        KVLab(lm, PROMPT, make("h2o", 6))


def test_the_sparse_indexer_selection_is_the_mask(built):
    # deepseek_v32: each query attends only to the index_topk keys its indexer picked, shown as its mask
    lm, _ = built("deepseek_v32")
    s = gi.Session(lm, PROMPT)
    s.run(STEPS)
    k = lm.model.config.index_topk
    for layer in range(lm.n_layers):
        allowed = s.allowed(layer, 0)
        assert allowed.sum(-1).max() == k < s.cache_length
        probs = s.attention(layer, 0)
        assert (probs[~allowed] == 0).all() and np.allclose(probs.sum(-1), 1, atol=1e-5)
    # the indexer picks differently per layer: the selections are recorded per layer, not shared
    assert not np.array_equal(s.allowed(0, 0), s.allowed(1, 0))


def test_every_refusal_names_a_reason():
    for mt, why in REFUSED.items():
        assert why and "\n" not in why
        with pytest.raises(gi.InspectorError, match="not supported"):
            check_supported(SimpleNamespace(model_type=mt), mt)
    assert not set(REFUSED) & set(VERIFIED)


def test_every_causal_lm_type_is_verified_or_refused():
    """A model type a new transformers release adds fails here, by name, until it is verified or refused."""
    unknown = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(VERIFIED) - set(REFUSED))
    assert not unknown, (
        f"transformers {transformers.__version__} maps these to a causal LM; verify or refuse them: {unknown}"
    )


def test_every_refused_type_is_refused_by_its_config_alone():
    # the reason comes before anything is built or run, and before the generic checks (an encoder-decoder config)
    from transformers import AutoConfig

    for mt in sorted(set(REFUSED) & set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)):
        try:
            config = AutoConfig.for_model(mt)
        except Exception:  # a default config transformers itself rejects (gemma4_assistant): the type alone
            config = SimpleNamespace(model_type=mt)
        with pytest.raises(gi.InspectorError) as e:
            from_model(SimpleNamespace(config=config), None, mt)
        assert str(e.value) == f"{mt} ({mt}) is not supported: {REFUSED[mt]}"


def test_verified_families_are_still_shipped():
    if tiny_families.older_than_checked():
        pytest.skip(
            f"transformers {transformers.__version__} predates families verified on {tiny_families.NEWEST_CHECKED}"
        )
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


# one family per way the cache can differ from the K/V attention receives (core.kv_layout)
KV_KINDS = {
    "llama": "per-head",  # the control: the cache is what attention reads
    "deepseek_v3": "latent",  # MLA: a compressed latent and a shared rotary key
    "minicpm3": "latent",
    "deepseek_v32": "latent",  # and a sparse indexer picks each query's keys
    "jetmoe": "tiled",  # the cache's 2 KV heads, tiled to 4 after the cache update
    "gemma3n_text": "shared",  # the last two layers read earlier layers' caches
    "gemma4_text": "per-head",  # its full-attention layer has a head size of its own (per_layer_config)
    "gemma4_kv_shared": "shared",
}


def _received_kv(ref, ids):
    """K and V exactly as HF's own eager attention function receives them, per layer: (H, T, d)."""
    import importlib

    mod = importlib.import_module(type(getattr(ref, "_model", ref)).__module__)  # through on_device's proxy
    seen, orig = {}, mod.eager_attention_forward

    def spy(module, query, key, value, *a, **kw):
        seen[module.layer_idx] = (key[0].to("cpu", copy=True), value[0].to("cpu", copy=True))
        return orig(module, query, key, value, *a, **kw)

    mod.eager_attention_forward = spy
    try:
        with torch.no_grad():
            ref(torch.tensor([ids]))
    finally:
        mod.eager_attention_forward = orig
    return seen


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


@pytest.mark.parametrize("family", KV_KINDS)
def test_qkv_is_what_attention_received_and_kv_bytes_are_the_real_cache(family, built):
    lm, ref = built(family)
    assert lm.kv_layout.kind == KV_KINDS[family]
    s = gi.Session(lm, PROMPT)
    s.run(3)
    t = s.cache_length
    seen = _received_kv(ref, s.tokens[:t])
    assert sorted(seen) == list(range(lm.n_layers))
    per_head = 0
    for layer in range(lm.n_layers):
        q, k, v = s.qkv(layer)
        hk, hv = seen[layer]  # (H_k, T, d_k), (H_v, T, d_v)
        assert k.shape == tuple(hk.shape) and v.shape == tuple(hv.shape), f"{family}: layer {layer} K/V shapes"
        assert q.shape[0] == lm.n_heads and q.shape[2] == k.shape[2]
        for ours, want in ((k, hk), (v, hv)):
            np.testing.assert_allclose(ours, want.numpy(), atol=_tol(want), rtol=0, err_msg=f"{family}: layer {layer}")
        per_head += _nbytes(hk, hv)
        # the layer's own cache slot, as the session keeps it, every position (a KV-sharing layer keeps none);
        # the model's own cache, which holds only a sliding window's, is checked against generate's below
        own = s.cache.layers[layer] if layer < len(s.cache.layers) and s.cache_layer_of(layer) == layer else None
        real = 0 if own is None else _nbytes(own.keys, own.values)
        if KV_KINDS[family] in ("latent", "tiled"):  # a mirrored layer owns its slot but reads our copy
            assert s.cache_layer_of(layer) is None
            real = _nbytes(s.cache.layers[layer].keys, s.cache.layers[layer].values)
        assert s.kv_kept_bytes(layer) == real, f"{family}: layer {layer} kept bytes"
    assert s.kv_kept_bytes() == sum(_nbytes(cl.keys, cl.values) for cl in s.cache.layers)
    # per-head K and V over the positions the model's cache holds (gemma3n's layer 0: its window)
    assert s.kv_per_head_bytes() == per_head - sum(_nbytes(*seen[i]) // t * (t - s.kv_cache_positions(i)) for i in seen)
    if KV_KINDS[family] == "latent":
        assert s.kv_cache_bytes() < s.kv_per_head_bytes()
        assert "latent" in lm.describe()
    elif KV_KINDS[family] == "per-head":
        assert s.kv_cache_bytes() == s.kv_per_head_bytes() and not lm.mirror_kv
    if KV_KINDS[family] == "shared":
        assert [s.kv_cache_positions(i) for i in range(4)] == [3, t, 3, t]  # layers 0 and 2: a 4-key window
        assert not lm.mirror_kv and [s.cache_layer_of(i) for i in range(4)] == [0, 1, 0, 1]
        assert "layer 3 reads layer 1's cache" in lm.describe()
    if KV_KINDS[family] != "per-head":  # the probe replays per-head K/V it can only find in a plain cache
        from gpt_inspector.core.probe import probe_session

        with pytest.raises(
            gi.InspectorError, match=f"the cache probe replays per-head K/V of every layer; in {family} "
        ):
            probe_session(s, layers=[0])


def test_a_config_with_per_layer_sizes_loads_from_a_folder(tokenizer, tmp_path):
    # dots3_note_text's sliding layers have sizes of their own: its config raises on a global head_dim, which the
    # load-time shape checks read (a traceback at load until they tolerated it)
    folder = tmp_path / "dots3_note_text"
    tiny_families.build_model("dots3_note_text", tokenizer.convert_tokens_to_ids("<|endoftext|>")).save_pretrained(
        folder
    )
    tokenizer.save_pretrained(folder)
    lm = gi.load_model(folder, device=DEVICE)
    s = gi.Session(lm, PROMPT)
    s.run(2)
    assert lm.unverified is None and s.qkv(0)[1].shape[-1] == 24 and s.qkv(1)[1].shape[-1] == 20


def _own_cache_bytes(cache, n_layers: int) -> list[int]:
    """Bytes of the keys and values the model's own cache holds per layer (0 where it holds none: a state, a
    KV-sharing layer's placeholder)."""
    out = [0] * n_layers
    for i, cl in enumerate(getattr(cache, "layers", [])[:n_layers]):
        kv = [getattr(cl, n, None) for n in ("keys", "values")]
        out[i] = sum(_nbytes(x) for x in kv if isinstance(x, torch.Tensor) and x.dim() == 4)
    return out


def _generate_cache(ref, gen):
    """The cache ``generate`` returned: ``.cache`` from transformers 5.24, ``.past_key_values`` before."""
    names = (hf.cache_kwarg(getattr(ref, "_model", ref)), "cache", "past_key_values")
    return next(getattr(gen, n) for n in names if getattr(gen, n, None) is not None)


# the families whose own cache holds less than the session keeps at T = 19: sliding-window or chunked
# layers (4-key windows, chunks of 4: they keep 3 positions). Explicit, so a family whose window stops
# cutting the sequence (or starts to) fails here by name
WINDOWED = set(
    """
afmoe beam cohere2 cohere2_moe cwm doge exaone4 exaone_moe gemma2 gemma3_text gemma3n_text gpt_oss granite_swa
granitemoe_swa kolibri1 llama4_chunked mimo_v2_flash ministral ministral3 mistral mixtral modernbert-decoder moshi
olmo3 phi3 phimoe qwen3_moe starcoder2 vaultgemma
gemma4_text gemma4_unified_text cohere_compass_text dots3_note_text lara_mini zaya doge_tied gemma4_k_eq_v
gemma4_kv_shared gemma4_unified_kv_shared
""".split()
)


@pytest.mark.parametrize("family", VERIFIED + VARIANTS)
def test_kv_cache_bytes_are_what_generates_own_cache_holds(family, built):
    """Per layer, kv_cache_bytes is what the cache HF's generate builds holds at the end (sliding windows,
    chunks, latents, shared layers, hybrids' attention layers); kv_kept_bytes is the session's own cache."""
    lm, ref = built(family)
    s = gi.Session(lm, PROMPT)
    s.run(STEPS)
    x = torch.tensor([s.prompt_ids])
    with torch.no_grad():
        gen = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=STEPS,
                           return_dict_in_generate=True, pad_token_id=lm.eos_token_ids[0])  # fmt: skip
    t = s.cache_length
    assert gen.sequences.shape[1] - 1 == t  # generate never feeds its last token (hyperclovax ends at EOS early)
    want = _own_cache_bytes(_generate_cache(ref, gen), lm.n_layers)
    got = [s.kv_cache_bytes(i) for i in range(lm.n_layers)]
    assert got == want, f"{family}: the model's cache per layer"
    assert s.kv_cache_bytes() == sum(want) > 0
    # what the session keeps: its own cache's tensors, every position (a mirrored latent: its latent rows)
    slots = _own_cache_bytes(s.cache, lm.n_layers)
    kept = [0 if s.cache_layer_of(i) not in (i, None) else b for i, b in enumerate(slots)]
    assert [s.kv_kept_bytes(i) for i in range(lm.n_layers)] == kept and s.kv_kept_bytes() == sum(kept)
    assert (sum(kept) > sum(want)) == (family in WINDOWED), f"{family}: windows cut T = {t}?"
    assert all(k >= w for k, w in zip(kept, want))


@pytest.mark.parametrize("family", ["gemma2", "llama4_chunked", "gemma3n_text", "deepseek_v3", "qwen3_next", "llama"])
def test_kv_cache_bytes_at_every_length_equal_a_stepped_default_cache(family, built):
    """Step the model's default cache (``DynamicCache(config=...)``) through the prompt, then one token at a
    time: after every forward, kv_cache_bytes(layer, length) is what it holds, below the window and past it."""
    from transformers import DynamicCache

    lm, ref = built(family)
    s = gi.Session(lm, PROMPT)
    s.run(STEPS)
    ids, p = torch.tensor([s.tokens]), len(s.prompt_ids)
    model = getattr(ref, "_model", ref)
    cache = DynamicCache(config=model.config)
    seen = set()
    with torch.no_grad():
        # one position first (below any window), the rest of the prompt, then one token at a time
        for a, b in [(0, 1), (1, p)] + [(n, n + 1) for n in range(p, s.cache_length)]:
            model(ids[:, a:b], **{hf.cache_kwarg(model): cache}, use_cache=True, position_ids=torch.arange(a, b)[None])
            want = _own_cache_bytes(cache, lm.n_layers)
            assert [s.kv_cache_bytes(i, length=b) for i in range(lm.n_layers)] == want, f"{family}: after {b} positions"
            seen.add(tuple(want))
    assert len(seen) > 1  # the bytes grew (and on windowed layers stopped growing)
    with pytest.raises(gi.InspectorError, match="length must be"):
        s.kv_cache_bytes(length=s.cache_length + 1)


@pytest.mark.parametrize("family", ["gemma2", "gemma3n_text"])
def test_a_beam_search_counts_the_cache_generate_builds_for_its_beams(family, built):
    from gpt_inspector.core.beams import BeamSearch

    lm, ref = built(family)
    bs = BeamSearch(lm, PROMPT, num_beams=3, num_return_sequences=2, max_new_tokens=4)
    bs.run()
    x = torch.tensor([bs.prompt_ids])
    with torch.no_grad():
        gen = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False, num_beams=3, num_return_sequences=2,
                           max_new_tokens=4, return_dict_in_generate=True,
                           pad_token_id=lm.eos_token_ids[0])  # fmt: skip
    want = _own_cache_bytes(_generate_cache(ref, gen), lm.n_layers)
    assert [bs.kv_cache_bytes(i) for i in range(lm.n_layers)] == want and bs.kv_cache_bytes() == sum(want)
    assert bs.kv_kept_bytes() == sum(_own_cache_bytes(bs.cache, lm.n_layers)) > sum(want)
    # one beam as a run source: a third of the search's cache (3 beams)
    view = bs.result_view(0)
    assert [view.kv_cache_bytes(i) * 3 for i in range(lm.n_layers)] == want
    assert view.kv_kept_bytes() * 3 == bs.kv_kept_bytes()


HYBRIDS = [
    "bamba",
    "falcon_h1",
    "granitemoehybrid",
    "jamba",
    "lara_mini",
    "lfm2",
    "lfm2_moe",
    "nemotron_h",
    "olmo_hybrid",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_next",
    "zaya",
    "zamba2",
]


def _beams_equal_generate(family, built):
    """Our beam search and HF generate(num_beams=3) on the same prompt: ids and scores equal."""
    from gpt_inspector.core.beams import BeamSearch

    lm, ref = built(family)
    bs = BeamSearch(lm, PROMPT, num_beams=3, num_return_sequences=2, max_new_tokens=4)
    bs.run()
    r = bs.result()
    x = torch.tensor([bs.prompt_ids])
    with torch.no_grad():
        gen = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False, num_beams=3, num_return_sequences=2,
                           max_new_tokens=4, output_scores=True, return_dict_in_generate=True,
                           pad_token_id=lm.eos_token_ids[0])  # fmt: skip
    assert r.sequences == gen.sequences.tolist(), f"{family}: beams differ from generate"
    np.testing.assert_allclose(r.sequences_scores, gen.sequences_scores.float().numpy(), atol=1e-4, rtol=0)
    return lm, bs


@pytest.mark.parametrize("family", [f for f in KV_KINDS if f != "llama"] + HYBRIDS)
def test_beams_equal_generate(family, built):
    lm, bs = _beams_equal_generate(family, built)
    # a beam's records read K/V the same way the session does (mirrored or from its shared cache layer)
    view = bs.result_view(0)
    last = lm.kv_layout.attention_layers[-1]
    assert view.qkv(last)[1].shape[0] == lm.kv_layout.layers[last].keys[0]
    assert view.record_bytes() > 0  # a hybrid's state-space layers hold no records


_BEAMS_ELSEWHERE = set(ADAPTED + VARIANTS) | set(KV_KINDS) | set(HYBRIDS)
# moshi's own generate departs from its full forward after the first new token (see the greedy test):
# there is no one reference for its beams
_BEAMS_ELSEWHERE.add("moshi")


@pytest.mark.parametrize("family", [f for f in VERIFIED if f not in _BEAMS_ELSEWHERE])
def test_every_verified_family_beams_equal_generate(family, built):
    """Beam search (the port of HF's) equals generate(num_beams) on every verified family: ids and scores."""
    _beams_equal_generate(family, built)
