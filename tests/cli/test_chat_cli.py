"""Chat prompts on the command line: --messages FILE.json and --system/--user/--assistant turns give
trace, compare and lens the ids of apply_chat_template; compare --samples/--temperatures; bad input is
one line, exit 2."""

from __future__ import annotations

import json

import pytest
import tiny_chat
import torch

from gpt_inspector.cli import main
from gpt_inspector.core.decoding import Decoding

TWO = tiny_chat.MESSAGES[:2]  # system + user: short enough to leave the tiny models room to generate


def _run(capsys, *argv):
    rc = main([*map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def _ids(folder, messages, gen=True):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return tok.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=gen)


def test_trace_messages_file_and_turn_flags_agree(chat_dir, tmp_path, capsys):
    from gpt_inspector import load_trace

    folder = chat_dir("gpt2")
    f = tmp_path / "chat.json"
    f.write_text(json.dumps(TWO))
    base = ["trace", "--model", folder, "--device", "cpu", "--steps", 2, "--json"]
    rc, out, err = _run(capsys, *base, "--messages", f, "--out", tmp_path / "a.safetensors")
    assert rc == 0, err
    a = json.loads(out)
    want = _ids(folder, TWO)
    assert a["tokens"][: a["prompt_length"]] == want and a["prompt_length"] == len(want)
    rc, out, err = _run(capsys, *base, "--system", TWO[0]["content"], "--user", TWO[1]["content"],
                        "--out", tmp_path / "b.safetensors")  # fmt: skip
    assert rc == 0, err
    assert json.loads(out)["tokens"] == a["tokens"]
    t = load_trace(tmp_path / "b.safetensors")
    assert [{"role": r, "content": c} for r, c in t.chat.messages] == TWO and "user" in t.chat.roles
    # the file's turns, then the flags', in command-line order; without the generation prompt
    rc, out, err = _run(capsys, *base, "--messages", f, "--assistant", "Ok.", "--no-generation-prompt",
                        "--out", tmp_path / "c.safetensors")  # fmt: skip
    assert rc == 0, err
    c = json.loads(out)
    assert c["tokens"][: c["prompt_length"]] == _ids(folder, [*TWO, {"role": "assistant", "content": "Ok."}], False)


def test_compare_and_lens_take_the_same_turns(chat_dir, capsys):
    folder = chat_dir("llama")
    rc, out, err = _run(capsys, "compare", "--model", folder, "--device", "cpu", "--system", TWO[0]["content"],
                        "--user", TWO[1]["content"], "--max-new-tokens", 2, "--json")  # fmt: skip
    assert rc == 0, err
    d = json.loads(out)
    assert d["prompt_ids"] == _ids(folder, TWO) and d["chat"]["messages"] == TWO
    rc, out, err = _run(capsys, "lens", "--model", folder, "--device", "cpu", "--user", "She eats", "--steps", 1,
                        "--json")  # fmt: skip
    assert rc == 0, err and json.loads(out)["layers"]


def test_compare_samples_at_temperatures(tiny_dir, tiny_lm, capsys):
    folder = tiny_dir["gpt2"]
    rc, out, err = _run(capsys, "compare", "--model", folder, "--device", "cpu", "--prompt", "She eats an apple",
                        "--max-new-tokens", 4, "--samples", 2, "--temperatures", "0.8,1.5", "--seed", 5, "--json")  # fmt: skip
    assert rc == 0, err
    d = json.loads(out)
    assert [(s["seed"], s["temperature"]) for s in d["samples"]] == [(5, 0.8), (6, 0.8), (5, 1.5), (6, 1.5)]
    assert [r["kind"] for r in d["rows"]] == ["greedy", "beam", *["sample"] * 4]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    x = torch.tensor([d["prompt_ids"]])
    for s in d["samples"]:
        torch.manual_seed(s["seed"])
        with torch.no_grad():
            # top_k off spelled out (generate_kwargs): generate's global fallback top-k 50 would apply otherwise
            ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4,
                              pad_token_id=tiny_lm("gpt2").eos_token_ids[0],
                              **Decoding(temperature=s["temperature"]).generate_kwargs())  # fmt: skip
        assert s["token_ids"] == ref[0].tolist()
    rc, out, err = _run(capsys, "compare", "--model", folder, "--device", "cpu", "--prompt", "She eats an apple",
                        "--max-new-tokens", 3, "--samples", 2, "--temperatures", "0.8,1.5")  # fmt: skip
    assert rc == 0, err
    assert "sample 2 · T 1.5" in out and "seed 1, T 1.5" in out


@pytest.mark.parametrize(
    ("argv", "msg"),
    [
        (["--messages", "{bad}"], "not JSON"),
        (["--messages", "[]"], "non-empty list"),
        (["--messages", '[{"role": "user"}]'], "exactly"),
        (["--messages", "MISSING"], "cannot read"),
        (["--user", "hi", "--prompt", "x"], "not both"),
        (["--prompt", "x", "--no-generation-prompt"], "needs chat turns"),
        ([], "give --prompt"),
    ],
)
def test_bad_chat_input_exit_2_one_line(argv, msg, chat_dir, tmp_path, capsys):
    argv = list(argv)
    if "--messages" in argv:
        i = argv.index("--messages") + 1
        if argv[i] != "MISSING":
            (tmp_path / "m.json").write_text(argv[i])
        argv[i] = tmp_path / "m.json"
    for cmd in (["trace", "--steps", 1, "--out", tmp_path / "x.safetensors"], ["compare", "--max-new-tokens", 1]):
        rc, out, err = _run(capsys, *cmd, "--model", chat_dir("gpt2"), "--device", "cpu", *argv)
        assert rc == 2 and err.count("\n") == 1 and msg in err and "Traceback" not in err, err


def test_no_chat_template_is_one_line(tiny_dir, tmp_path, capsys):
    rc, out, err = _run(capsys, "trace", "--model", tiny_dir["gpt2"], "--device", "cpu", "--user", "hi", "--steps", 1,
                        "--out", tmp_path / "x.safetensors")  # fmt: skip
    assert rc == 2 and err.count("\n") == 1 and "no chat template" in err


@pytest.mark.parametrize(("argv", "msg"), [(["--samples", 0], "--samples"), (["--temperatures", "1"], "with --samples"),
                                          (["--samples", 2, "--temperatures", "1,x"], "numbers"),
                                          (["--samples", 2, "--temperatures", "0.5,-1"], "> 0")])  # fmt: skip
def test_bad_sample_flags_exit_2(argv, msg, tiny_dir, capsys):
    rc, out, err = _run(capsys, "compare", "--model", tiny_dir["gpt2"], "--device", "cpu", "--prompt", "One two",
                        "--max-new-tokens", 2, *argv)  # fmt: skip
    assert rc == 2 and err.count("\n") == 1 and msg in err, err


def test_window_refuses_bad_messages_before_opening(tmp_path, capsys):
    (tmp_path / "m.json").write_text("[1]")
    rc, out, err = _run(capsys, "--messages", tmp_path / "m.json", "--screenshot", tmp_path / "s.png")
    assert rc == 2 and err.count("\n") == 1 and "message 1" in err
