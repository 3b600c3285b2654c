"""The contract for the sampler: stepping with any of generate's processors, alone or combined, greedy
or sampled with a seed, gives exactly generate's tokens and generate's processed scores."""

from __future__ import annotations

import pytest
import torch

import gpt_inspector as gi
from gpt_inspector.core.decoding import MODEL_DEFAULT, Decoding

FAMILIES = ["gpt2", "llama", "qwen2"]  # learned positions; GQA with RoPE; GQA with biases
PROMPT = "She eats an apple. He eats an apple and she eats an"  # repeated n-grams: penalties bite
STEPS = 8
SEED = 7

# (id, settings); "$G" entries are filled with the first tokens greedy decoding picks, so they bite
CASES = [
    ("greedy", dict()),
    ("repetition_penalty", dict(repetition_penalty=1.6)),
    ("repetition_reward", dict(repetition_penalty=0.6)),
    ("no_repeat_ngram", dict(no_repeat_ngram_size=2)),
    ("suppress_tokens", dict(suppress_tokens="$G")),
    ("bad_words", dict(bad_words_ids="$G")),
    ("min_new_tokens", dict(min_new_tokens=5)),
    ("forced_eos", dict(forced_eos_token_id="$EOS", max_new_tokens=5)),
    ("temperature", dict(temperature=1.7)),
    ("top_k", dict(temperature=1.5, top_k=4)),
    ("top_p", dict(temperature=1.5, top_p=0.6)),
    ("min_p", dict(temperature=1.5, min_p=0.08)),
    ("typical_p", dict(temperature=1.5, typical_p=0.5)),
    ("epsilon", dict(temperature=1.5, epsilon_cutoff=0.01)),
    ("eta", dict(temperature=1.5, eta_cutoff=0.01)),
    ("sampled_penalties", dict(temperature=1.3, repetition_penalty=1.4, no_repeat_ngram_size=3, suppress_tokens="$G")),
    (
        "combined",
        dict(
            temperature=1.2,
            top_k=30,
            top_p=0.9,
            min_p=0.02,
            typical_p=0.95,
            repetition_penalty=1.3,
            no_repeat_ngram_size=2,
            bad_words_ids="$G",
            min_new_tokens=2,
        ),
    ),  # fmt: skip
    ("greedy_combined", dict(repetition_penalty=1.3, no_repeat_ngram_size=2, suppress_tokens="$G", min_new_tokens=3)),
]


def _fill(settings: dict, greedy_new: list[int], eos: int) -> dict:
    out = {}
    for k, v in settings.items():
        if v == "$G":
            v = [greedy_new[0], greedy_new[1]] if k == "suppress_tokens" else [[greedy_new[0]], greedy_new[1:3]]
        elif v == "$EOS":
            v = eos
        out[k] = v
    return out


def _generate(hf, ids: list[int], dec: Decoding, eos: int):
    x = torch.tensor([ids])
    torch.manual_seed(SEED)  # generate samples from the global generator; the session from its own, same seed
    with torch.no_grad():
        return hf.generate(x, attention_mask=torch.ones_like(x), pad_token_id=eos, output_scores=True, return_dict_in_generate=True,
                           **{"max_new_tokens": STEPS, **dec.generate_kwargs()})  # fmt: skip


@pytest.mark.parametrize("case", [c[0] for c in CASES])
@pytest.mark.parametrize("family", FAMILIES)
def test_steps_equal_generate(family, case, tiny_lm, hf_eager):
    lm, hf = tiny_lm(family), hf_eager(family)
    eos = lm.eos_token_ids[0]
    plain = gi.Session(lm, PROMPT)
    plain.run(3)
    greedy_new = plain.tokens[len(plain.prompt_ids) :]
    dec = Decoding(**_fill(dict(CASES)[case], greedy_new, eos))
    s = gi.Session(lm, PROMPT, seed=SEED, decoding=dec)
    n = STEPS if dec.max_new_tokens is None else dec.max_new_tokens
    steps = list(s.steps(n))
    ref = _generate(hf, s.prompt_ids, dec, eos)
    assert s.tokens == ref.sequences[0].tolist(), (case, s.tokens, ref.sequences[0].tolist())
    assert len(steps) == len(ref.scores)
    bit = False  # the case's own settings changed some step's scores: a case that cannot bite proves nothing
    for st, want in zip(steps, ref.scores):
        final = st.stages[-1]
        got = s.sampler().scores(st.logits, s.tokens[: len(s.prompt_ids) + st.index])  # (V,)
        assert torch.equal(torch.isinf(got), torch.isinf(want[0])), case
        fin = torch.isfinite(got)
        torch.testing.assert_close(got[fin], want[0][fin], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(st.probs, torch.softmax(want[0], -1), atol=2e-6, rtol=0)
        assert final.kept == int(fin.sum())
        assert st.stages[0].key == "" and [x.key for x in st.stages[1:]] == [
            k for k in _order(s) if k in s.sampler().settings
        ]
        bit |= any(_changed(a, b) for a, b in zip(st.stages, st.stages[1:]))
    assert bit or case == "greedy", f"{case} never changed a distribution on {family}"


def _changed(before, after) -> bool:
    """A stage removed, reordered or reweighted tokens (temperature only reweights)."""
    return bool(after.n_removed or after.moved) or [e.prob for e in before.top] != [e.prob for e in after.top]


def _order(s) -> list[str]:
    from gpt_inspector.core.decoding import SETTING_OF

    return [SETTING_OF[type(p).__name__] for p in s.sampler().processors]


def test_forced_eos_and_min_new_tokens_do_what_generate_says(tiny_lm):
    lm = tiny_lm("gpt2")
    eos = lm.eos_token_ids[0]
    s = gi.Session(lm, PROMPT, forced_eos_token_id=eos, max_new_tokens=4, min_new_tokens=2)
    steps = list(s.steps(4))
    assert steps[-1].token_id == eos and steps[-1].finish_reason == "eos"
    # min new tokens: EOS removed at steps 0 and 1 (probability exactly 0), allowed after
    for st in steps[:2]:
        assert st.probs[eos] == 0
        stage = next(x for x in st.stages if x.key == "min_new_tokens")
        assert stage.n_removed == 1 and stage.removed[0].token_id == eos
    forced = next(x for x in steps[-1].stages if x.key == "forced_eos_token_id")
    assert forced.kept == 1 and forced.top[0].token_id == eos and forced.top[0].prob == 1.0


def test_model_defaults_apply_and_are_marked(tiny_dir, hf_eager):
    """A checkpoint shipping repetition_penalty: the session applies it as generate does with no arguments."""
    lm = gi.load_model(tiny_dir["llama"])
    hf = hf_eager("llama")
    old = hf.generation_config.repetition_penalty
    lm.model.generation_config.repetition_penalty = hf.generation_config.repetition_penalty = 4.0
    try:
        s = gi.Session(lm, PROMPT)
        s.run(STEPS)
        x = torch.tensor([s.prompt_ids])
        with torch.no_grad():
            ref = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=STEPS,
                              pad_token_id=lm.eos_token_ids[0])  # fmt: skip
        assert s.tokens == ref[0].tolist()
        penalised = s.current.probs.clone()
        stage = s.current.stages[1]
        assert stage.key == "repetition_penalty" and stage.origin == MODEL_DEFAULT and "4" in stage.label
        # the user's setting wins over the model's, and is marked as the user's
        s.set_decoding(repetition_penalty=1.0)
        assert [x.key for x in s.current.stages] == [""]
        plain = gi.Session(lm, PROMPT, repetition_penalty=1.0)
        plain.run(STEPS)
        with torch.no_grad():
            off = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=STEPS,
                              repetition_penalty=1.0, pad_token_id=lm.eos_token_ids[0])  # fmt: skip
        assert plain.tokens == off[0].tolist()
        assert not torch.allclose(plain.steps_done[-1].probs, penalised, atol=1e-3) or plain.tokens != s.tokens
    finally:
        hf.generation_config.repetition_penalty = old
