"""Chat prompts and assisted decoding on a real ``gpt-inspector serve`` process: the engine applies its
tokenizer's chat template and runs the rounds (a draft loaded from its own disk, or prompt lookup); what
comes back equals ``apply_chat_template`` and ``generate`` here, and a local session's own numbers."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from tiny_chat import MESSAGES

import gpt_inspector as gi
from gpt_inspector.cli import main
from gpt_inspector.core.errors import InspectorError

PROMPT = "one two three four one two three"


@pytest.fixture(scope="module")
def draft(tiny_llama, tmp_path_factory):
    """A draft on the engine's disk: another tiny Llama (other weights) with the target's tokenizer."""
    import tiny_models

    return tiny_models.build(tmp_path_factory.mktemp("draft") / "draft", "llama", seed=7)


def _hf_ids(lm, messages, gen=True) -> list[int]:
    return lm.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=gen)


def test_a_chat_prompt_is_rendered_by_the_engine_as_a_local_chat_session(server, local_lm):
    for gen in (True, False):
        with gi.connect(server.url, messages=MESSAGES, add_generation_prompt=gen) as r:
            s = gi.Session(local_lm, messages=MESSAGES, add_generation_prompt=gen)
            assert r.prompt_ids == _hf_ids(local_lm, MESSAGES, gen) == list(s.prompt_ids)
            assert r.chat == replace(s.chat, ids=tuple(r.prompt_ids)) and r.prompt == s.prompt == s.chat.text
            assert {"system", "user", "assistant", "template"} == set(r.chat.roles)
            r.run(3), s.run(3)
            assert r.tokens == s.tokens
            assert torch.equal(r.attention_rows(1, 0, len(r.tokens) - 1), s.attention_rows(1, 0, len(s.tokens) - 1))
            assert r.recipe()["chat"] == s.recipe()["chat"] == {"messages": MESSAGES, "add_generation_prompt": gen}
            # the turns editor's preview: the engine's template, no session opened
            preview = r.build_chat(MESSAGES[:2], gen)
            assert list(preview.ids) == _hf_ids(local_lm, MESSAGES[:2], gen) and r.tokens == s.tokens
    with gi.connect(server.url) as r:
        with pytest.raises(InspectorError, match="message 1"):  # checked here, before anything is sent
            r.open(messages=[{"role": "user"}])
        with pytest.raises(InspectorError, match="not both"):
            r.open("text", messages=MESSAGES)


def _generate(lm, ids, **kw) -> list[int]:
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=10, **kw)
    return out[0].tolist()


def test_prompt_lookup_rounds_run_on_the_engine_and_equal_generate(server, local_lm):
    with gi.connect(server.url, prompt=PROMPT) as r:
        r.run(2)  # Start takes the session back to its prompt
        a = gi.Assisted(r, prompt_lookup_num_tokens=3, max_new_tokens=10)
        assert r.n_steps == 0 and a.mode == "prompt lookup"
        first = a.round()
        rest = a.run()
        assert a.ended and a.rounds == [first, *rest]
        assert r.tokens == _generate(local_lm, r.prompt_ids, prompt_lookup_num_tokens=3)
        here = gi.Assisted(gi.Session(local_lm, PROMPT), prompt_lookup_num_tokens=3, max_new_tokens=10)
        here.run()
        # the same proposals, acceptances and caches, round by round (the seconds are each side's own)
        assert [replace(x, seconds=0) for x in a.rounds] == [replace(x, seconds=0) for x in here.rounds]
        assert a.summary() == here.summary() and a.acceptance_rate == here.acceptance_rate
        assert [st.top for st in a.steps_of(a.rounds[-1])] == [st.top for st in here.steps_of(here.rounds[-1])]
        undone, gone = a.back(), here.back()
        assert replace(undone, seconds=0) == replace(gone, seconds=0) and undone.index == len(a.rounds)
        assert r.tokens == here.session.tokens and len(a.rounds) == len(here.rounds)
        r.set_temperature(0.7)
        with pytest.raises(InspectorError, match="greedy"):  # refused on the engine, in one line
            gi.Assisted(r, prompt_lookup_num_tokens=3)


def test_a_draft_model_is_loaded_on_the_engine_from_its_disk(server, local_lm, draft):
    with gi.connect(server.url, prompt=PROMPT) as r:
        a = gi.Assisted(r, str(draft), num_assistant_tokens=4, max_new_tokens=10)
        assert a.mode == "draft model"
        a.run()
        here = gi.load_model(draft, device=local_lm.device)
        assert r.tokens == _generate(local_lm, r.prompt_ids, assistant_model=here.model, num_assistant_tokens=4)
        assert any(x.rejected for x in a.rounds) and all(x.draft_cache is not None for x in a.rounds)
        with pytest.raises(InspectorError, match="no folder .* on the engine's machine"):
            gi.Assisted(r, str(draft / "missing"), num_assistant_tokens=4)
        with pytest.raises(InspectorError, match="named, not sent"):
            gi.Assisted(r, here, num_assistant_tokens=4)
        assert r.tokens == _generate(local_lm, r.prompt_ids, assistant_model=here.model, num_assistant_tokens=4)


def test_the_cli_sends_chat_turns_and_assisted_decoding_over_connect(server, local_lm, tmp_path, capsys):
    out = tmp_path / "chat.safetensors"
    args = ["trace", "--connect", server.url, "--system", "Be terse.", "--user", "She eats", "--steps", "3"]
    assert main([*args, "--out", str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    s = gi.Session(local_lm, messages=MESSAGES[:2])
    s.run(3)
    assert got["tokens"] == s.tokens and got["prompt_length"] == len(_hf_ids(local_lm, MESSAGES[:2]))
    assert gi.load_trace(out).chat.roles == s.chat.roles
    out = tmp_path / "assisted.safetensors"
    args = ["trace", "--connect", server.url, "--prompt", PROMPT, "--steps", "10", "--prompt-lookup-num-tokens", "3"]
    assert main([*args, "--out", str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    prompt_ids = list(gi.Session(local_lm, PROMPT).prompt_ids)
    assert got["tokens"] == _generate(local_lm, prompt_ids, prompt_lookup_num_tokens=3)
    assert got["assisted"]["rounds"] and got["assisted"]["mode"] == "prompt lookup"
    # a bad draft folder: one line, exit 2, no traceback
    args = ["trace", "--connect", server.url, "--prompt", PROMPT, "--steps", "3", "--assistant-model", "/nowhere"]
    assert main([*args, "--out", str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "no folder '/nowhere' on the engine's machine" in err and "Traceback" not in err


def test_the_window_starts_a_chat_on_the_engine_from_the_command_line(server, local_lm, tmp_path, monkeypatch):
    pytest.importorskip("pytestqt")
    monkeypatch.setenv("QT_QPA_PLATFORM", "offscreen")
    monkeypatch.setenv("GPT_INSPECTOR_SETTINGS", str(tmp_path / "settings.ini"))
    png = tmp_path / "chat.png"
    args = ["--connect", server.url, "--system", "Be terse.", "--user", "She eats", "--steps", "1"]
    assert main([*args, "--screenshot", str(png)]) == 0 and png.stat().st_size > 0
    with gi.connect(server.url) as r:  # the session the window drove: the engine's chat, one step on
        s = gi.Session(local_lm, messages=MESSAGES[:2])
        s.step()
        assert r.prompt_ids == _hf_ids(local_lm, MESSAGES[:2]) and r.tokens == s.tokens
        assert r.chat.roles == s.chat.roles


def test_rounds_and_chats_from_the_engine_are_checked_before_use():
    from gpt_inspector.remote import wire
    from gpt_inspector.remote.assisted import chat_of, round_of

    good = {"index": 0, "first_step": 0, "proposed": [5, 6, 7], "accepted": 1, "rejected": [6, 7], "tokens": [5, 9],
            "target_cache_verified": 12, "target_cache": 10, "target_cache_bytes": 640, "draft_cache_proposed": None,
            "draft_cache": None, "draft_cache_bytes": None, "seconds": 0.01}  # fmt: skip
    assert round_of(good).tokens == (5, 9)
    for bad in ({"accepted": 4}, {"rejected": [7]}, {"tokens": []}, {"proposed": [5, "6", 7]}, {"index": -1},
                {"seconds": "0"}, {"extra": 1}):  # fmt: skip
        with pytest.raises(wire.WireError):
            round_of({**good, **bad})
    chat = {"messages": MESSAGES[:1], "add_generation_prompt": True, "text": "x", "roles": ["template", "system"]}
    assert chat_of(chat, [1, 2]).roles == ("template", "system")
    with pytest.raises(wire.WireError, match="2 token roles for a prompt of 3"):
        chat_of(chat, [1, 2, 3])
    with pytest.raises(InspectorError, match="message 1"):
        chat_of({**chat, "messages": [{"role": "user", "content": 3}]}, [1, 2])
    # and a request's turns against the schema, before the engine sees them
    ok = json.dumps({"op": "open", "id": 1, "args": {"prompt": "", "chat": {"messages": MESSAGES}}})
    assert wire.check_request(ok)[2]["chat"]["messages"] == MESSAGES
    for chat_arg in ({"messages": []}, {"messages": [{"role": "user"}]}, {"messages": MESSAGES, "tools": []},
                     {"messages": [{"role": "user", "content": "x" * (wire.MAX_TEXT + 1)}]}):  # fmt: skip
        with pytest.raises(wire.WireError):
            wire.check_request(json.dumps({"op": "open", "id": 1, "args": {"prompt": "", "chat": chat_arg}}))
