"""Prompts from the tokenizer's chat template: the ids are apply_chat_template's, each token's role is
the turn it came from, and recipes and traces keep the turns."""

from __future__ import annotations

import json

import pytest
import tiny_chat

import gpt_inspector as gi
from gpt_inspector.core.errors import InspectorError


@pytest.fixture(scope="module")
def chat_lm(chat_dir):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = gi.load_model(chat_dir(family), device="cpu")
        return cache[family]

    return get


def _expected_roles(tok, messages, add_generation_prompt):
    """Each token's role, worked out independently: tokenize the rendering turn by turn and label
    what each turn's content added (the template's markup around it is 'template')."""
    roles, text = [], ""
    for m in messages:
        head = text + f"<|endoftext|>{m['role']}\n"
        body = head + m["content"]
        text = body + "\n"
        n_head = len(tok(head, add_special_tokens=False)["input_ids"])
        n_body = len(tok(body, add_special_tokens=False)["input_ids"])
        roles += ["template"] * (n_head - len(roles)) + [m["role"]] * (n_body - n_head)
    end = text + ("<|endoftext|>assistant\n" if add_generation_prompt else "")
    n = len(tok(end, add_special_tokens=False)["input_ids"])
    return roles + ["template"] * (n - len(roles))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("gen", [True, False])
def test_ids_and_roles(family, gen, chat_dir, chat_lm):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_dir(family))
    want = tok.apply_chat_template(tiny_chat.MESSAGES, tokenize=True, return_dict=False, add_generation_prompt=gen)
    text = tok.apply_chat_template(tiny_chat.MESSAGES, tokenize=False, add_generation_prompt=gen)
    s = gi.Session(chat_lm(family), messages=tiny_chat.MESSAGES, add_generation_prompt=gen)
    assert s.prompt_ids == list(want) and s.prompt == text and s.chat.text == text
    assert text.endswith("assistant\n") == gen
    assert list(s.chat.roles) == _expected_roles(tok, tiny_chat.MESSAGES, gen)
    assert {"system", "user", "assistant", "template"} == set(s.chat.roles)
    # the tokens of each turn's content decode to that content
    for role, content in [("system", "Be terse.")]:
        ids = [i for i, r in zip(s.prompt_ids, s.chat.roles) if r == role]
        assert tok.decode(ids) == content


def test_steps_continue_the_chat_prompt_as_generate_does(chat_lm, hf_eager, chat_dir):
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_dir("llama"))
    two = tiny_chat.MESSAGES[:2]  # the tiny models' context is 64 tokens
    ids = tok.apply_chat_template(two, tokenize=True, return_dict=False, add_generation_prompt=True)
    s = gi.Session(chat_lm("llama"), messages=two)
    s.run(4)
    assert s.prompt_ids == ids and s.finished is None
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = hf_eager("llama").generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=4)
    assert s.tokens == ref[0].tolist()


def test_recipe_and_trace_keep_the_turns(chat_lm, as_trace):
    lm = chat_lm("gpt2")
    s = gi.Session(lm, messages=tiny_chat.MESSAGES[:2], add_generation_prompt=True)
    s.run(2)
    rec = json.loads(json.dumps(s.recipe()))
    assert rec["chat"] == {"messages": tiny_chat.MESSAGES[:2], "add_generation_prompt": True}
    again = gi.Session.replay(lm, rec)
    assert again.chat == s.chat and again.tokens == s.tokens
    t = as_trace(s)
    assert t.chat.messages == s.chat.messages and t.chat.roles == s.chat.roles and t.prompt == s.prompt
    assert t.chat.ids == s.chat.ids and t.chat.add_generation_prompt
    plain = gi.Session(lm, "She eats")
    plain.step()
    assert as_trace(plain).chat is None


@pytest.mark.parametrize(
    ("messages", "msg"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([{"role": "user"}], "exactly"),
        ([{"role": "user", "content": 3}], "content must be text"),
        ([{"role": "", "content": "x"}], "role must be"),
        ([{"role": "user", "content": "x", "name": "y"}], "exactly"),
    ],
)
def test_bad_messages_refused_in_words(messages, msg, chat_lm):
    with pytest.raises(InspectorError, match=msg):
        gi.Session(chat_lm("gpt2"), messages=messages)


def test_no_template_and_both_prompts_refused(tiny_lm, chat_lm):
    with pytest.raises(InspectorError, match="no chat template"):
        gi.Session(tiny_lm("gpt2"), messages=tiny_chat.MESSAGES)
    with pytest.raises(InspectorError, match="not both"):
        gi.Session(chat_lm("gpt2"), "She eats", messages=tiny_chat.MESSAGES)


def test_recipe_with_bad_chat_refused(chat_lm):
    s = gi.Session(chat_lm("gpt2"), messages=tiny_chat.MESSAGES[:2])
    rec = s.recipe()
    rec["chat"] = {"messages": [{"role": 1}], "add_generation_prompt": True}
    with pytest.raises(InspectorError, match="message 1"):
        gi.Session.replay(chat_lm("gpt2"), rec)
    rec["chat"] = {"messages": tiny_chat.MESSAGES[:1], "add_generation_prompt": True}
    with pytest.raises(InspectorError, match="other tokens"):
        gi.Session.replay(chat_lm("gpt2"), rec)


@pytest.mark.parametrize(
    ("chat", "msg"),
    [
        ({"messages": [{"role": "user"}], "add_generation_prompt": True, "roles": None}, "malformed"),
        ({"messages": [{"role": "user", "content": 1}], "add_generation_prompt": True, "roles": "$N"}, "content"),
        (
            {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True, "roles": ["user"]},
            "malformed",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True, "roles": "$N9"}, "role"),
    ],
)
def test_trace_with_bad_chat_metadata_refused(chat, msg, chat_lm, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    s = gi.Session(chat_lm("gpt2"), messages=tiny_chat.MESSAGES[:2])
    s.step()
    path = s.save_trace(tmp_path / "t.safetensors")
    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata())
    n = len(s.prompt_ids)
    if isinstance(chat["roles"], str):  # as many roles as prompt tokens
        chat = dict(chat, roles={"$N": ["user"] * n, "$N9": ["x" * 99] * n}[chat["roles"]])
    meta["chat"] = json.dumps(chat)
    bad = tmp_path / "bad.safetensors"
    save_file(load_file(str(path)), str(bad), metadata=meta)
    with pytest.raises(InspectorError, match=msg):
        gi.load_trace(bad)
