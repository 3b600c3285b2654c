"""The shipped demo model must have learned something: the app starts on it offline."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from gpt_inspector.core.head_scores import (
    best_head,
    induction_score,
    previous_token_score,
    repeated_random_tokens,
    stack_attentions,
)

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "resources" / "demo-gpt2"
PROMPT = "She eats apple"


def _load_training_script():
    # The grammar lives in the training script; its held-out seeds and word list are what
    # "in the corpus style" means, so the test reads them from there instead of copying them.
    spec = importlib.util.spec_from_file_location("train_demo_model", REPO / "scripts" / "train_demo_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus():
    return _load_training_script()


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(MODEL_DIR, attn_implementation="eager")
    m.eval()
    return m


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


def _attentions(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return stack_attentions(model(ids, output_attentions=True).attentions)


# ---------------------------------------------------------------- the scoring functions


def test_previous_token_score_on_ideal_pattern():
    t = 6
    attn = torch.zeros(2, 3, t, t)
    attn[:, :, 0, 0] = 1.0
    attn[0, 1, torch.arange(1, t), torch.arange(0, t - 1)] = 1.0  # layer 0 head 1: perfect
    rest = torch.tril(torch.ones(t, t)) / torch.arange(1, t + 1)[:, None]  # uniform causal
    attn[1, 2] = rest
    scores = previous_token_score(attn)
    assert scores.shape == (2, 3)
    assert scores[0, 1] == pytest.approx(1.0)
    assert scores[1, 2] == pytest.approx(np.mean(1 / np.arange(2, t + 1)))
    assert best_head(scores)[:2] == (0, 1)


def test_induction_score_on_ideal_pattern():
    half = 4
    t = 1 + 2 * half  # one BOS-like prefix token
    attn = torch.zeros(1, 2, t, t)
    for j in range(half):
        attn[0, 0, 1 + half + j, 1 + j + 1] = 1.0
    scores = induction_score(attn, half, offset=1)
    assert scores[0, 0] == pytest.approx(1.0)
    assert scores[0, 1] == 0.0
    with pytest.raises(ValueError):
        induction_score(attn, half + 1, offset=1)


def test_repeated_random_tokens_shape_and_repeat():
    rows = repeated_random_tokens(100, 20, n=3, seed=1, exclude=[0])
    assert rows.shape == (3, 40)
    assert torch.equal(rows[:, :20], rows[:, 20:])
    assert (rows != 0).all()
    assert all(len(set(r[:20].tolist())) == 20 for r in rows)


# ---------------------------------------------------------------- the shipped files


def test_folder_is_small_and_pickle_free():
    files = [f for f in MODEL_DIR.rglob("*") if f.is_file()]
    names = {f.name for f in files}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= names
    assert sum(f.stat().st_size for f in files) <= 10 * 1024 * 1024
    for f in files:
        assert f.suffix not in {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"}, f
        if f.suffix == ".safetensors":
            with safe_open(f, framework="pt") as st:
                assert len(list(st.keys())) > 0
        else:
            # whatever the name: pickle opens with PROTO (0x80), torch.save with a zip header
            head = f.read_bytes()[:2]
            assert not head.startswith(b"\x80") and head != b"PK", f


def test_tokenizer_round_trips_and_uses_gpt2_conventions(tokenizer):
    text = "She eats apple pie with her friend.  Then  they walk home, one two three!"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_ids_to_tokens(tokenizer(" friend")["input_ids"]) == ["Ġfriend"]
    assert tokenizer.bos_token == tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.eos_token_id is not None
    assert 1000 <= len(tokenizer) <= 4096
    # every token readable as ASCII once the byte-level alphabet is undone
    assert all(tokenizer.decode([i]).isascii() or len(tok) == 1 for tok, i in tokenizer.get_vocab().items())


def test_model_is_a_gpt2(model, tokenizer):
    assert model.config.model_type == "gpt2"
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert 500_000 <= model.num_parameters() <= 2_500_000


# ---------------------------------------------------------------- it learned something


def test_has_previous_token_head(model, tokenizer, corpus):
    ids = tokenizer(corpus.heldout_text(), return_tensors="pt")["input_ids"]
    assert 100 <= ids.shape[1] <= model.config.n_positions
    layer, head, score = best_head(previous_token_score(_attentions(model, ids)))
    assert score >= 0.6, f"best previous-token head {layer}.{head} only {score:.3f}"


def test_has_previous_token_head_on_sentences_written_here(model, tokenizer):
    # not from the grammar's generator: guards against a score that only holds for its own output
    text = (
        "My sister reads a long novel on the sofa. The boys played football after school. "
        "Grandpa bakes bread for his family every Sunday. We count: one, two, three, four."
    )
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert best_head(previous_token_score(_attentions(model, ids)))[2] >= 0.6


def test_has_induction_head(model, tokenizer, corpus):
    half = corpus.INDUCTION_HALF_LEN
    rows = repeated_random_tokens(
        len(tokenizer),
        half,
        n=corpus.INDUCTION_ROWS,
        seed=corpus.INDUCTION_SEED,
        exclude=[tokenizer.eos_token_id],
    )
    layer, head, score = best_head(induction_score(_attentions(model, rows), half))
    assert score >= 0.4, f"best induction head {layer}.{head} only {score:.3f}"


@pytest.mark.parametrize("half,seed", [(20, 7), (40, 8)])
def test_induction_head_holds_for_other_lengths(model, tokenizer, half, seed):
    rows = repeated_random_tokens(len(tokenizer), half, n=4, seed=seed, exclude=[tokenizer.eos_token_id])
    assert best_head(induction_score(_attentions(model, rows), half))[2] >= 0.4


def _words(text: str) -> list[str]:
    return [w.lower() for w in re.findall(r"[A-Za-z]+", text)]


def test_greedy_continuation_is_fluent(model, tokenizer, corpus):
    enc = tokenizer(PROMPT, return_tensors="pt")
    n = enc["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=12, pad_token_id=tokenizer.eos_token_id)
    continuation = tokenizer.decode(out[0, n:], skip_special_tokens=True)
    assert len(out[0]) > n + 3
    assert continuation.startswith(" pie"), continuation
    words = _words(continuation)
    assert len(words) >= 4
    unknown = set(words) - corpus.grammar_vocabulary()
    assert not unknown, f"{continuation!r} has words outside the grammar: {unknown}"
    # a whole first sentence, and only clean prose: words, single spaces, punctuation
    assert "." in continuation
    assert re.fullmatch(r"( [A-Za-z]+|[.,:!?])+", continuation), continuation


def test_two_beams_differ(model, tokenizer, corpus):
    enc = tokenizer(PROMPT, return_tensors="pt")
    n = enc["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(
            **enc,
            do_sample=False,
            num_beams=2,
            num_return_sequences=2,
            max_new_tokens=8,
            pad_token_id=tokenizer.eos_token_id,
        )
    assert out.shape[0] == 2
    first, second = (tokenizer.decode(row[n:], skip_special_tokens=True) for row in out)
    assert first != second
    for text in (first, second):
        assert set(_words(text)) <= corpus.grammar_vocabulary(), text
