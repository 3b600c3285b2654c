"""transformers' QuantizedCache with quanto, every configuration it takes: groups larger than a head (quanto
groups the flattened cache), keys or values on axis -1, and the groups quanto refuses refused alike.

quanto's arithmetic is written out here, number by number, and checked against the lab's
``quanto_affine``, against optimum-quanto's own functions, and the lab's runs against
``generate(cache_implementation="quantized")``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from gpt_inspector.core import InspectorError
from gpt_inspector.core.kvlab import KVLab, make
from gpt_inspector.core.kvlab.quant import quanto_affine


def quanto_written_out(x: torch.Tensor, bits: int, group: int, axis: int) -> torch.Tensor:
    """quanto's group + MaxOptimizer + quantize_affine + dequantize, one group at a time (float32)."""
    flat = x.reshape(-1).tolist()
    d = x.shape[-1]
    n = len(flat)
    if axis == 0:
        groups = [list(range(i, i + group)) for i in range(0, n, group)]  # consecutive numbers
    else:
        rows = n // d  # the (rows, channels) view: ``group`` consecutive rows at one channel
        groups = [[(r0 + j) * d + c for j in range(group)] for r0 in range(0, rows, group) for c in range(d)]
    out = [0.0] * n
    f32 = np.float32
    if axis == 0 and len(groups) == 1:
        return x.clone()  # quanto's optimizer sees one group as axis None: a scale per number, exact
    for idx in groups:
        vals = [f32(flat[i]) for i in idx]
        lo, hi = min(vals), max(vals)
        scale = f32(f32(hi - lo) / f32(2**bits - 1))
        for i, v in zip(idx, vals):
            if scale == 0:
                out[i] = float(lo)  # a flat group: every number is its minimum
                continue
            q = min(max(np.round(f32(f32(v - lo) / scale)), 0), 2**bits - 1)
            out[i] = float(f32(f32(scale * f32(q)) + lo))
    return torch.tensor(out, dtype=torch.float32).reshape(x.shape)


CASES = [((1, 2, 12, 8), 64, 0), ((1, 2, 12, 8), 16, 0), ((1, 1, 8, 8), 64, 0), ((1, 2, 12, 8), 4, -1),
         ((1, 2, 12, 8), 8, -1), ((1, 3, 4, 8), 96, 0)]  # fmt: skip


@pytest.mark.parametrize("shape,group,axis", CASES)
@pytest.mark.parametrize("bits", [2, 4])
def test_quanto_affine_is_quantos_arithmetic(shape, group, axis, bits):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 0, :2, :] = 0.5  # 16 equal numbers: a flat group (scale 0) on axis 0 with groups of 16
    mine = quanto_affine(x, bits, group, axis)
    want = quanto_written_out(x, bits, group, axis)
    torch.testing.assert_close(mine, want, rtol=0, atol=0)
    if x.numel() > group or axis != 0:
        assert float((mine - x).abs().max()) > 1e-3  # it quantized
    pytest.importorskip("optimum.quanto")
    from optimum.quanto import MaxOptimizer, qint2, qint4, quantize_weight

    qtype = qint4 if bits == 4 else qint2
    scale, shift = MaxOptimizer()(x, qtype, axis, group)
    theirs = quantize_weight(x, qtype, axis, scale, shift, group).dequantize()
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_a_group_quanto_refuses_is_refused_in_one_line():
    x = torch.randn(1, 2, 5, 8)  # 80 numbers per batch row
    with pytest.raises(InspectorError, match="quanto refuses group 64"):
        quanto_affine(x, 4, 64, 0)
    pytest.importorskip("optimum.quanto")
    from optimum.quanto import MaxOptimizer, qint4

    with pytest.raises(ValueError, match="divisor"):
        MaxOptimizer()(x, qint4, 0, 64)


# groups larger than the 8-number heads of the tiny models; the prompt is cut to 16 tokens and the residual
# is 4, so every flush quantizes a multiple of 4 positions, which these groups divide as quanto requires
@pytest.mark.parametrize(
    "family,bits,group,axis_key,axis_value",
    [("llama", 4, 64, 0, 0), ("qwen2", 2, 32, 0, 0), ("llama", 2, 4, -1, 0), ("qwen2", 4, 4, 0, -1)],
)
def test_every_configuration_transformers_takes_equals_its_quantized_cache(family, bits, group, axis_key,
                                                                           axis_value, tiny_lm, tiny_dir):  # fmt: skip
    pytest.importorskip("optimum.quanto")
    lm = tiny_lm(family)
    prompt = lm.tokenizer("She eats an apple. He reads a book. They walk to the park.").input_ids[:16]
    assert len(prompt) == 16
    policy = make(f"int{bits}", group=group, residual=4, scheme="transformers", axis_key=axis_key,
                  axis_value=axis_value)  # fmt: skip
    lab = KVLab(lm, prompt_ids=prompt, policy=policy, free_running=True)
    lab.run_steps(10)
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir[family], attn_implementation="eager").eval()
    with torch.no_grad():
        g = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, output_logits=True,
                        return_dict_in_generate=True, cache_implementation="quantized",
                        pad_token_id=lm.eos_token_ids[0],
                        cache_config={"backend": "quanto", "nbits": bits, "q_group_size": group, "residual_length": 4,
                                      "axis_key": axis_key, "axis_value": axis_value})  # fmt: skip
    assert lab.run.tokens == g.sequences[0].tolist()[: len(lab.run.tokens)]
    for st, logits in zip(lab.run.steps_done, g.logits):
        np.testing.assert_allclose(st.logits.numpy(), logits[0].numpy(), atol=2e-5, rtol=0)
    worst = max(float((a.logits - b.logits).abs().max()) for a, b in zip(lab.run.steps_done, lab.reference.steps_done))
    assert worst > 1e-4  # the quantization matters at this setting


def test_a_configuration_quanto_refuses_fails_in_words_as_transformers_fails(tiny_lm, tiny_dir):
    """Group 64 on a 15-token prompt of Llama (2 KV heads of 8): 240 numbers, not a multiple of 64."""
    pytest.importorskip("optimum.quanto")
    lm = tiny_lm("llama")
    prompt = lm.tokenizer("She eats an apple. He reads a book. They walk to the park.").input_ids[:15]
    lab = KVLab(lm, prompt_ids=prompt, policy=make("int4", group=64, residual=4, scheme="transformers"))
    with pytest.raises(InspectorError, match="quanto refuses group 64"):
        lab.step()
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir["llama"], attn_implementation="eager").eval()
    with pytest.raises(ValueError, match="divisor"), torch.no_grad():
        hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=2, cache_implementation="quantized",
                    pad_token_id=lm.eos_token_ids[0],
                    cache_config={"backend": "quanto", "nbits": 4, "q_group_size": 64, "residual_length": 4})  # fmt: skip
    with pytest.raises(InspectorError, match="axis_key .* 0 or -1"):
        make("int4", scheme="transformers", axis_key=1)
