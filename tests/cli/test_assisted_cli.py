"""`trace` and `compare` with --assistant-model / --prompt-lookup-num-tokens: generate's tokens, the rounds
in JSON, bad values exit 2 with one line."""

from __future__ import annotations

import json

import pytest
import tiny_models
import torch

from gpt_inspector.cli import main

PROMPT = "She eats an apple. He eats an apple and she eats an"


def _run(capsys, *argv):
    rc = main([*map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return tiny_models.build(tmp_path_factory.mktemp("draft") / "d", "gpt2", seed=11)


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


def test_trace_with_a_draft_is_generates(tiny_dir, draft, tmp_path, capsys):
    rc, out, err = _run(capsys, "trace", "--model", tiny_dir["llama"], "--device", "cpu", "--prompt", PROMPT,
                        "--steps", 9, "--assistant-model", draft, "--num-assistant-tokens", 4,
                        "--out", tmp_path / "a.safetensors", "--json")  # fmt: skip
    assert rc == 0, err
    got = json.loads(out)
    p = got["prompt_length"]
    hd = _hf(draft)
    hd.generation_config.num_assistant_tokens = 4
    want = _hf(tiny_dir["llama"]).generate(torch.tensor([got["tokens"][:p]]), assistant_model=hd, do_sample=False,
                                           max_new_tokens=9)  # fmt: skip
    assert got["tokens"] == want[0].tolist()
    a = got["assisted"]
    assert a["mode"] == "draft model" and a["new_tokens"] == 9 == sum(len(r["tokens"]) for r in a["rounds"])
    assert a["accepted"] == sum(r["accepted"] for r in a["rounds"]) and all(
        len(r["proposed"]) <= 4 for r in a["rounds"]
    )


def test_trace_prompt_lookup_text(tiny_dir, tmp_path, capsys):
    rc, out, err = _run(capsys, "trace", "--model", tiny_dir["gpt2"], "--device", "cpu", "--prompt", PROMPT,
                        "--steps", 8, "--prompt-lookup-num-tokens", 3, "--out", tmp_path / "p.safetensors")  # fmt: skip
    assert rc == 0, err
    assert "assisted (prompt lookup):" in out and "proposed tokens accepted" in out


def test_compare_assisted_row_is_greedy(tiny_dir, draft, capsys):
    rc, out, err = _run(capsys, "compare", "--model", tiny_dir["gpt2"], "--device", "cpu", "--prompt", PROMPT,
                        "--max-new-tokens", 8, "--assistant-model", draft, "--assistant-confidence-threshold", 0,
                        "--json")  # fmt: skip
    assert rc == 0, err
    got = json.loads(out)
    assert got["assisted"]["token_ids"] == got["greedy"]["token_ids"] and got["assisted"]["diverges_at"] is None
    assert any(len(r["rejected"]) > 1 for r in got["assisted"]["rounds"])  # proposals cut short, greedy all the same
    assert got["assisted"]["rounds"] and got["assisted"]["assisted"]["mode"] == "draft model"
    rc, out, err = _run(capsys, "compare", "--model", tiny_dir["gpt2"], "--device", "cpu", "--prompt", PROMPT,
                        "--max-new-tokens", 8, "--prompt-lookup-num-tokens", 2)  # fmt: skip
    assert rc == 0, err
    assert "\nassisted " in out and "prompt lookup:" in out and "same as greedy" in out


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--prompt-lookup-num-tokens", 0], "--prompt-lookup-num-tokens must be an integer >= 1"),
        (["--num-assistant-tokens", 3], "only applies with --assistant-model"),
        (["--assistant-model", "x", "--assistant-confidence-threshold", 1.5], "from 0 to 1"),
        (["--prompt-lookup-num-tokens", 2, "--assistant-model", "x"], "not both"),
        (["--prompt-lookup-num-tokens", 2, "--temperature", 0.7], "greedy"),
        (["--assistant-model", "OTHER"], "vocabulary has"),
    ],
)
def test_bad_values_exit_2_one_line(argv, msg, tiny_dir, tmp_path, capsys):
    if "OTHER" in argv:  # a draft with another tokenizer
        from transformers import AutoModelForCausalLM

        other = tmp_path / "other"
        other.mkdir()
        tok = tiny_models.build_tokenizer(other, vocab_size=300)
        eos = tok.convert_tokens_to_ids("<|endoftext|>")
        AutoModelForCausalLM.from_config(tiny_models.config_for("gpt2", len(tok), eos)).save_pretrained(other)
        argv = [other if a == "OTHER" else a for a in argv]
    rc, out, err = _run(capsys, "trace", "--model", tiny_dir["gpt2"], "--device", "cpu", "--prompt", PROMPT,
                        "--steps", 3, "--out", tmp_path / "x.safetensors", *argv)  # fmt: skip
    assert rc == 2
    assert err.count("\n") == 1 and msg in err and "Traceback" not in err
