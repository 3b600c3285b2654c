"""generate's sampler arguments on the command line: trace, compare, lens and the window's start."""

from __future__ import annotations

import json

import pytest
import torch

import gpt_inspector as gi
from gpt_inspector.cli import main

PROMPT = "She eats an apple. He eats an apple and she eats an"
FLAGS = ["--temperature", "1.2", "--seed", "3", "--repetition-penalty", "1.5", "--no-repeat-ngram-size", "2",
         "--min-p", "0.02", "--suppress-tokens", "5,6", "--bad-words-ids", "7;8,9", "--min-new-tokens", "2"]  # fmt: skip
SETTINGS = dict(temperature=1.2, seed=3, repetition_penalty=1.5, no_repeat_ngram_size=2, min_p=0.02,
                suppress_tokens=[5, 6], bad_words_ids=[[7], [8, 9]], min_new_tokens=2)  # fmt: skip


def _run(capsys, *argv):
    try:
        rc = main([*map(str, argv)])
    except SystemExit as e:  # argparse's own refusals (a value that is not a number)
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_trace_takes_generates_names_and_records_them(tiny_dir, tiny_lm, tmp_path, capsys, hf_eager):
    out = tmp_path / "run.safetensors"
    rc, stdout, err = _run(capsys, "trace", "--model", tiny_dir["gpt2"], "--device", "cpu", "--prompt", PROMPT,
                           "--steps", 6, *FLAGS, "--out", out, "--json")  # fmt: skip
    assert rc == 0, err
    d = json.loads(stdout)
    s = gi.Session(tiny_lm("gpt2"), PROMPT, **SETTINGS)
    s.run(6)
    assert d["tokens"] == s.tokens
    t = gi.load_trace(out)
    assert t.decoding == s.decoding
    assert [x.label for x in t.steps_done[-1].stages] == [x.label for x in s.current.stages]
    # and the same tokens as generate with the same settings
    torch.manual_seed(3)
    x = torch.tensor([s.prompt_ids])
    with torch.no_grad():
        ref = hf_eager("gpt2").generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6,
                                        pad_token_id=s.lm.eos_token_ids[0], **s.decoding.generate_kwargs())  # fmt: skip
    assert ref[0].tolist() == s.tokens


def test_compare_samples_with_them(tiny_dir, tiny_lm, capsys):
    rc, stdout, err = _run(capsys, "compare", "--model", tiny_dir["gpt2"], "--device", "cpu", "--prompt", PROMPT,
                           "--max-new-tokens", 5, "--sample", *FLAGS, "--json")  # fmt: skip
    assert rc == 0, err
    sampled = json.loads(stdout)["sampled"]
    assert sampled["repetition_penalty"] == 1.5 and sampled["bad_words_ids"] == [[7], [8, 9]]
    s = gi.Session(tiny_lm("gpt2"), PROMPT, **SETTINGS)
    s.run(5)
    assert sampled["token_ids"] == s.tokens
    rc, _, err = _run(capsys, "compare", "--model", tiny_dir["gpt2"], "--prompt", PROMPT, "--max-new-tokens", 5,
                      "--repetition-penalty", 1.5)  # fmt: skip
    assert rc == 2 and "only applies with --sample" in err and err.count("\n") == 1


def test_lens_and_bad_words_as_text(tiny_dir, tiny_lm, capsys):
    lm = tiny_lm("gpt2")
    first = gi.Session(lm, PROMPT, no_repeat_ngram_size=3)
    first.step()  # the word greedy decoding picks first: banning it must change the text
    word = lm.tokenizer.decode(first.tokens[-1:])
    ids = lm.tokenizer.encode(word, add_special_tokens=False)
    rc, stdout, err = _run(capsys, "lens", "--model", tiny_dir["gpt2"], "--device", "cpu", "--prompt", PROMPT,
                           "--steps", 3, "--bad-words", word, "--no-repeat-ngram-size", 3, "--json")  # fmt: skip
    assert rc == 0, err
    s = gi.Session(lm, PROMPT, bad_words_ids=[ids], no_repeat_ngram_size=3)
    s.run(3)
    assert json.loads(stdout)["text"] == s.text
    if len(ids) == 1:
        assert s.tokens[len(s.prompt_ids)] != first.tokens[-1]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--repetition-penalty", "0"], "repetition_penalty"),
        (["--min-p", "2"], "min_p"),
        (["--typical-p", "0"], "typical_p"),
        (["--epsilon-cutoff", "1"], "epsilon_cutoff"),
        (["--no-repeat-ngram-size", "-1"], "no_repeat_ngram_size"),
        (["--suppress-tokens", "a,b"], "--suppress-tokens"),
        (["--bad-words-ids", ";"], "--bad-words-ids"),
        (["--suppress-tokens", "99999"], "outside the vocabulary"),
        (["--repetition-penalty", "x"], "repetition-penalty"),
        (["--bad-words", "a\ud800b"], "--bad-words is not valid text"),  # the tokenizer's TypeError escaped
    ],
)
def test_bad_values_exit_2_with_one_line(tiny_dir, tmp_path, capsys, argv, needle):
    for cmd in (["trace", "--out", tmp_path / "x.safetensors", "--steps", 1], ["lens", "--steps", 1]):
        rc, _, err = _run(capsys, *cmd, "--model", tiny_dir["gpt2"], "--device", "cpu", "--prompt", "a", *argv)
        assert rc == 2 and needle in err and err.count("\n") == 1, err
        assert "Traceback" not in err


def test_the_window_start_refuses_bad_values_before_any_window(capsys):
    rc, _, err = _run(capsys, "--prompt", "a", "--min-p", "2")
    assert rc == 2 and "min_p" in err and err.count("\n") == 1
    rc, _, err = _run(capsys, "--prompt", "a", "--bad-words", "x")
    assert rc == 2 and "--bad-words-ids" in err
