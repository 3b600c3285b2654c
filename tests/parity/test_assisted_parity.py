"""The contract for assisted decoding: round by round on a session, the tokens (and the proposals) of
``generate(assistant_model=..., do_sample=False)`` and ``generate(prompt_lookup_num_tokens=N)``; the
target's steps and cache those of plain greedy stepping."""

from __future__ import annotations

import pytest
import tiny_models
import torch
from on_device import DEVICE, reference

import gpt_inspector as gi
from gpt_inspector.core.assisted import Assisted
from gpt_inspector.core.errors import InspectorError

PROMPT = "She eats an apple. He eats an apple and she eats an"  # repeated n-grams: prompt lookup finds matches
NEW = 14


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """A draft of its own weights (a GPT-2 with the tests' tokenizer, another seed: it disagrees often)."""
    root = tmp_path_factory.mktemp("drafts")
    return {"random": tiny_models.build(root / "random", "gpt2", seed=11)}


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return reference(AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval())


def _generate_recording(hf_target, ids, **kw):
    """generate's tokens, and each round's proposals as its own candidate generator made them."""
    from transformers.generation import candidate_generator as cg

    proposals: list[list[int]] = []
    originals = {c: c.get_candidates for c in (cg.AssistedCandidateGenerator, cg.PromptLookupCandidateGenerator)}

    def recording(orig):
        def get(self, input_ids, **k):
            out, logits = orig(self, input_ids, **k)
            proposals.append(out[0, input_ids.shape[1] :].tolist())
            return out, logits

        return get

    try:
        for c, orig in originals.items():
            c.get_candidates = recording(orig)
        out = hf_target.generate(torch.tensor([ids], device=DEVICE), do_sample=False, max_new_tokens=NEW, **kw)
    finally:
        for c, orig in originals.items():
            c.get_candidates = orig
    return out[0].tolist(), proposals


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("draft", ["random", "same", "llama-as-draft"])
@pytest.mark.parametrize("threshold", [None, 0.0], ids=["threshold-default", "threshold-0"])
def test_draft_model_equals_generate(family, draft, threshold, tiny_lm, tiny_dir, drafts):
    """The tiny drafts are unsure of every token: at generate's default confidence threshold (0.4) they
    propose one token a round; at 0 they propose up to num_assistant_tokens (20), and most are rejected."""
    folder = {"random": drafts["random"], "same": tiny_dir[family], "llama-as-draft": tiny_dir["llama"]}[draft]
    if draft == "llama-as-draft" and family == "llama":
        folder = tiny_dir["gpt2"]  # a draft of another family, same tokenizer
    target = tiny_lm(family)
    a = gi.assisted(target, PROMPT, gi.load_model(folder, device=DEVICE), max_new_tokens=NEW,
                    assistant_confidence_threshold=threshold)  # fmt: skip
    ids = a.session.prompt_ids
    hf_draft = _hf(folder)
    if threshold is not None:
        hf_draft.generation_config.assistant_confidence_threshold = threshold  # where generate reads it
    want, proposals = _generate_recording(_hf(tiny_dir[family]), ids, assistant_model=hf_draft)
    assert a.session.tokens == want
    assert [list(r.proposed) for r in a.rounds] == proposals
    for r in a.rounds:
        assert list(r.proposed[: r.accepted]) == list(r.tokens[: r.accepted])
        assert r.rejected == r.proposed[r.accepted :]
        assert r.target_cache_verified - r.target_cache == len(r.proposed) + 1 - len(r.tokens)
        assert r.target_cache == r.first_step + len(ids) + len(r.tokens) - 1  # every token fed but the last
    if draft == "same":
        assert a.acceptance_rate == 1.0
        if threshold == 0.0:  # every proposal of the whole run in one round, all kept
            assert len(a.rounds) == 1 and len(a.rounds[0].proposed) == NEW - 1
    if draft == "random":
        assert any(r.rejected for r in a.rounds) and a.acceptance_rate < 1.0
        if threshold == 0.0:
            assert any(len(r.rejected) > 1 for r in a.rounds)  # a crop of several positions


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "gemma2"])  # gemma2: sliding windows, soft-capping
@pytest.mark.parametrize("n", [2, 6])
def test_prompt_lookup_equals_generate(family, n, tiny_lm, tiny_dir):
    a = gi.assisted(tiny_lm(family), PROMPT, prompt_lookup_num_tokens=n, max_new_tokens=NEW)
    want, proposals = _generate_recording(_hf(tiny_dir[family]), a.session.prompt_ids, prompt_lookup_num_tokens=n)
    assert a.session.tokens == want
    assert [list(r.proposed) for r in a.rounds] == proposals
    assert any(r.proposed for r in a.rounds), "the prompt's repeats must give prompt lookup something to propose"
    assert all(r.draft_cache is None for r in a.rounds)


def test_num_assistant_tokens_is_generates(tiny_lm, tiny_dir, drafts):
    hf_draft = _hf(drafts["random"])
    hf_draft.generation_config.num_assistant_tokens = 3  # where generate reads it
    hf_draft.generation_config.assistant_confidence_threshold = 0.0
    a = gi.assisted(tiny_lm("gpt2"), PROMPT, gi.load_model(drafts["random"], device=DEVICE), num_assistant_tokens=3,
                    assistant_confidence_threshold=0.0, max_new_tokens=NEW)  # fmt: skip
    want, proposals = _generate_recording(_hf(tiny_dir["gpt2"]), a.session.prompt_ids, assistant_model=hf_draft)
    assert a.session.tokens == want
    assert [list(r.proposed) for r in a.rounds] == proposals
    assert max(len(r.proposed) for r in a.rounds) == 3


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
def test_steps_and_cache_are_plain_greedy_stepping(family, tiny_lm, drafts):
    """Each step's logits are those of greedy stepping one token at a time, and the cache after rounds with
    rejections holds exactly what stepping without the rejected tokens builds."""
    lm = tiny_lm(family)
    a = gi.assisted(lm, PROMPT, gi.load_model(drafts["random"], device=DEVICE), max_new_tokens=NEW,
                    assistant_confidence_threshold=0.0)  # fmt: skip
    assert any(len(r.rejected) > 1 for r in a.rounds)
    plain = gi.Session(lm, PROMPT)
    plain.run(len(a.session.steps_done))
    assert plain.tokens == a.session.tokens
    for got, want in zip(a.session.steps_done, plain.steps_done):
        torch.testing.assert_close(got.logits, want.logits, atol=2e-5, rtol=1e-4)
    s = a.session
    assert s.cache_length == plain.cache_length == len(s.tokens) - 1
    for layer in range(lm.n_layers):
        for mine, theirs in zip(s.qkv(layer), plain.qkv(layer)):
            torch.testing.assert_close(mine, theirs, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(s.attention(layer, 1, kind="probs"), plain.attention(layer, 1, kind="probs"),
                                   atol=2e-5, rtol=1e-4)  # fmt: skip


def test_draft_cache_is_cropped_and_back_undoes_a_round(tiny_lm, drafts):
    s = gi.Session(tiny_lm("gpt2"), PROMPT)
    a = Assisted(s, gi.load_model(drafts["random"], device=DEVICE), num_assistant_tokens=4,
                 assistant_confidence_threshold=0.0)  # fmt: skip
    rounds = a.run(4)
    for r in rounds:
        assert r.draft_cache_proposed is not None and r.draft_cache is not None
        assert r.draft_cache <= len(s.prompt_ids) + r.first_step + len(r.tokens) - 2  # generate's crop: length - 2
        assert r.draft_cache_bytes is not None and r.draft_cache_bytes > 0
    tokens, last = list(s.tokens), rounds[-1]
    undone = a.back()
    assert undone == last and s.tokens == tokens[: len(tokens) - len(last.tokens)]
    assert s.cache_length == len(s.tokens) - 1
    again = a.round()
    assert (again.proposed, again.tokens) == (last.proposed, last.tokens) and s.tokens == tokens


def test_refusals(tiny_lm, tmp_path):
    lm = tiny_lm("gpt2")
    with pytest.raises(InspectorError, match="one of them"):
        Assisted(gi.Session(lm, PROMPT))
    with pytest.raises(InspectorError, match="greedy"):
        Assisted(gi.Session(lm, PROMPT, temperature=0.8), prompt_lookup_num_tokens=3)
    with pytest.raises(InspectorError, match="whole number"):
        Assisted(gi.Session(lm, PROMPT), prompt_lookup_num_tokens=0)
    other = tmp_path / "other"
    other.mkdir()
    tok = tiny_models.build_tokenizer(other, vocab_size=300)
    from transformers import AutoModelForCausalLM

    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    AutoModelForCausalLM.from_config(tiny_models.config_for("gpt2", len(tok), eos)).save_pretrained(other)
    with pytest.raises(InspectorError, match="vocabulary has .* tokens, the target's"):
        Assisted(gi.Session(lm, PROMPT), gi.load_model(other))
