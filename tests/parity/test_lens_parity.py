"""The logit lens and head attribution against HF: output_hidden_states through the final norm and
head, and the residual stream decomposed by hooks written here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from on_device import DEVICE, reference

import gpt_inspector as gi
from gpt_inspector.core.lens import lens

PROMPT = "She eats an apple. He reads"


@pytest.fixture(scope="module")
def shaped(tiny_dir):
    """family -> (LoadedModel, HF eager) with a final norm whose weights are far from identity,
    so a lens that skipped or doubled the norm would fail."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(family):
        if family not in cache:
            lm = gi.load_model(tiny_dir[family], device=DEVICE)
            hf = reference(AutoModelForCausalLM.from_pretrained(tiny_dir[family], attn_implementation="eager").eval())
            g = torch.Generator().manual_seed(1)
            for m in (lm.model, hf):
                base = m.base_model
                norm = getattr(base, "ln_f", None) or getattr(base, "norm", None) or base.final_layer_norm
                with torch.no_grad():
                    norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=g))
                    g.manual_seed(1)
                    if getattr(norm, "bias", None) is not None:
                        norm.bias.copy_(0.3 * torch.randn(norm.bias.shape, generator=torch.Generator().manual_seed(2)))
            cache[family] = (lm, hf)
        return cache[family]

    return get


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
def test_lens_equals_hidden_states_through_norm_and_head(family, shaped):
    lm, hf = shaped(family)
    s = gi.Session(lm, PROMPT, temperature=0.8, seed=2)
    s.run(3)
    r = lens(s)  # first call: hooks go in, the position is recomputed
    s.run(2)
    r = lens(s)  # recorded during the step itself
    ids = torch.tensor([s.tokens[: s.cache_length]])
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    base = hf.base_model
    norm = getattr(base, "ln_f", None) or getattr(base, "norm", None)
    head = hf.get_output_embeddings()
    cap = getattr(hf.config, "final_logit_softcapping", None)
    tok = s.current.token_id
    for i, row in enumerate(r.layers[:-1]):
        with torch.no_grad():
            ref = head(norm(out.hidden_states[i + 1][0, -1].to(DEVICE))).cpu()  # (V,) layer i's output, the lens way
            if cap:
                ref = torch.tanh(ref / cap) * cap
        assert row.logit == pytest.approx(float(ref[tok]), abs=1e-5 * max(1.0, float(ref.abs().max())))
        assert row.top[0].token_id == int(ref.argmax())
    # the last layer's lens is the model's own logits for this step, exactly
    last = r.layers[-1]
    assert last.logit == float(s.current.logits[tok])
    assert [e.token_id for e in last.top] == [int(i) for i in torch.topk(s.current.logits, len(last.top)).indices]


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
def test_lens_probabilities_are_each_layers_softmax(family, shaped):
    """Every layer's p(chosen) and its top tokens' probabilities, against a float64 softmax of HF's
    hidden state through the final norm and head (the last layer: of the model's own logits)."""
    lm, hf = shaped(family)
    s = gi.Session(lm, PROMPT, seed=3)
    s.run(2)
    lens(s)
    s.step()
    r = lens(s)
    ids = torch.tensor([s.tokens[: s.cache_length]])
    with torch.no_grad():
        hidden = hf(ids, output_hidden_states=True).hidden_states
        base = hf.base_model
        norm = getattr(base, "ln_f", None) or base.norm
        cap = getattr(hf.config, "final_logit_softcapping", None)
        refs = []
        for i in range(lm.n_layers - 1):
            ref = hf.get_output_embeddings()(norm(hidden[i + 1][0, -1].to(DEVICE))).cpu().double()  # (V,)
            refs.append(torch.tanh(ref / cap) * cap if cap else ref)
    refs.append(s.current.logits.double())
    tok = s.current.token_id
    for row, ref in zip(r.layers, refs):
        p = torch.softmax(ref, -1)  # (V,) float64
        assert row.prob == pytest.approx(float(p[tok]), abs=1e-6)
        assert [e.prob for e in row.top] == pytest.approx([float(p[e.token_id]) for e in row.top], abs=1e-6)
        assert [e.prob for e in row.top] == sorted((e.prob for e in row.top), reverse=True)
        assert row.top[0].prob == pytest.approx(float(p.max()), abs=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_head_attributions_and_the_other_terms_sum_to_the_logit(family, shaped):
    """Embeddings, every attention block's bias, every MLP, recorded by hooks written here, plus the
    heads' attributions, through the frozen final norm, give the chosen token's logit."""
    lm, _ = shaped(family)
    model = lm.model
    base = model.base_model
    layers = next(c for c in base.children() if isinstance(c, torch.nn.ModuleList))
    parts: dict[str, torch.Tensor] = {}
    hooks = []

    def keep(name):
        def hook(_m, _i, out):
            parts[name] = (out[0] if isinstance(out, tuple) else out)[0, -1].detach().float().cpu()

        return hook

    emb = [m for m in base.children() if isinstance(m, torch.nn.Embedding)]
    for j, m in enumerate(emb):
        hooks.append(m.register_forward_hook(keep(f"emb{j}")))
    for i, layer in enumerate(layers):
        attn = layer.attn if family == "gpt2" else layer.self_attn
        proj = attn.c_proj if family == "gpt2" else attn.o_proj
        hooks.append(proj.register_forward_hook(keep(f"attn{i}")))
        hooks.append(layer.mlp.register_forward_hook(keep(f"mlp{i}")))
    try:
        s = gi.Session(lm, PROMPT)
        s.run(2)
        lens(s)  # hooks in
        s.step()
        r = lens(s)
    finally:
        for h in hooks:
            h.remove()
    resid = sum(parts.values())  # (D,) the final residual, pre-norm, rebuilt from its parts
    norm = getattr(base, "ln_f", None) or base.norm
    head = model.get_output_embeddings()
    with torch.no_grad():
        assert float(head(norm(resid.to(DEVICE))).cpu()[s.current.token_id]) == pytest.approx(r.logit, abs=1e-4)
    # each head's share, summed per layer, plus the block's bias share, is the block's own share
    from gpt_inspector.core.lens import _norm_affine

    gain, offset, centers = _norm_affine(norm, resid)
    u = head.weight.detach().float()[s.current.token_id].cpu()

    def share(v):
        return float(((v - v.mean()) if centers else v) @ (gain * u))

    pos = s.cache_length - 1
    for i, layer in enumerate(layers):
        proj = layer.attn.c_proj if family == "gpt2" else layer.self_attn.o_proj
        bias = torch.zeros_like(resid) if proj.bias is None else proj.bias.detach().float().cpu()
        assert r.attribution[i].sum() + share(bias) == pytest.approx(share(parts[f"attn{i}"]), abs=1e-4)
        assert s.head_outputs(i).shape[1] == pos + 1
    others = sum(share(v) for k, v in parts.items() if not k.startswith("attn"))
    biases = sum(share(layer.attn.c_proj.bias.detach().float().cpu() if family == "gpt2" else torch.zeros_like(resid))
                 for layer in layers)  # fmt: skip
    total = r.attribution.sum() + others + biases + float(offset @ u)
    assert total == pytest.approx(r.logit, abs=1e-4)
    assert r.remainder == pytest.approx(r.logit - r.attribution.sum(), abs=1e-9)


def test_gemma2_heads_through_both_frozen_norms_sum_to_each_blocks_share(shaped):
    """Gemma 2 normalises the attention block's output before the residual (sandwich norms). With that
    norm's scale frozen too, each layer's heads sum to the block's own share of the chosen logit, and
    the blocks, the MLPs and the scaled embeddings, recorded by hooks written here, give the logit."""
    lm, _ = shaped("gemma2")
    model = lm.model
    base = model.base_model
    layers = base.layers
    parts: dict[str, torch.Tensor] = {}
    hooks = []

    def keep(name):
        def hook(_m, _i, out):
            out = out[0] if isinstance(out, tuple) else out
            if out.dim() == 3:  # the model's forward, not the lens checking its linearised norm on one vector
                parts[name] = out[0, -1].detach().float().cpu()

        return hook

    def first_input(_m, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        parts["emb"] = h[0, -1].detach().float().cpu()  # the embeddings as the model scales them

    hooks.append(layers[0].register_forward_pre_hook(first_input, with_kwargs=True))
    for i, layer in enumerate(layers):
        hooks.append(layer.post_attention_layernorm.register_forward_hook(keep(f"attn{i}")))
        hooks.append(layer.post_feedforward_layernorm.register_forward_hook(keep(f"mlp{i}")))
    try:
        s = gi.Session(lm, PROMPT)
        s.run(2)
        lens(s)
        s.step()
        r = lens(s)
    finally:
        for h in hooks:
            h.remove()
    assert r.attribution is not None and "attention-output-norm" in r.note
    resid = sum(parts.values())  # (D,)
    head = model.get_output_embeddings()
    with torch.no_grad():
        assert float(head(base.norm(resid.to(DEVICE))).cpu()[s.current.token_id]) == pytest.approx(r.logit, abs=1e-4)
    from gpt_inspector.core.lens import _norm_affine

    gain, offset, _ = _norm_affine(base.norm, resid)
    u = head.weight.detach().float()[s.current.token_id].cpu()

    def share(v):
        return float(v @ (gain * u))

    scale = max(1.0, abs(r.logit))
    for i in range(lm.n_layers):  # no bias in Gemma 2's output projection, no offset in its RMS norms
        assert r.attribution[i].sum() == pytest.approx(share(parts[f"attn{i}"]), abs=1e-4 * scale)
    others = sum(share(v) for k, v in parts.items() if not k.startswith("attn"))
    assert r.attribution.sum() + others == pytest.approx(r.logit, abs=1e-4 * scale)
    # a wrong frozen scale (the attention-output norm skipped) is far off: the test can fail
    assert abs(r.attribution.sum() - sum(share(parts[f"attn{i}"]) for i in range(lm.n_layers))) < 1e-4 * scale


def test_lens_needs_a_step(shaped):
    lm, _ = shaped("gpt2")
    with pytest.raises(gi.InspectorError, match="run a step"):
        lens(gi.Session(lm, PROMPT))


def test_lens_after_step_back_recomputes_the_current_position(shaped):
    lm, _ = shaped("llama")
    s = gi.Session(lm, PROMPT)
    s.run(4)
    lens(s)
    s.step()
    s.step_back()
    r = lens(s)  # the recorded residual is the stepped-back-from position's: recomputed
    assert r.position == s.current.position
    np.testing.assert_allclose(r.layers[-1].logit, float(s.current.logits[s.current.token_id]), atol=1e-4)
