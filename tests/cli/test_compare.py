"""`gpt-inspector compare`: JSON as compare() returns it, text side by side, bad input = exit 2, one line."""

from __future__ import annotations

import json

import pytest
import torch

from gpt_inspector.cli import main


def _run(capsys, *argv):
    rc = main(["compare", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_structure(tiny_dir, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_dir["gpt2"]
    rc, out, err = _run(
        capsys, "--model", folder, "--device", "cpu", "--prompt", "She eats an apple", "--max-new-tokens", 5,
        "--num-beams", 3, "--num-return-sequences", 2, "--sample", "--temperature", 1.3, "--seed", 4, "--json",
    )  # fmt: skip
    assert rc == 0, err
    d = json.loads(out)
    assert set(d) >= {"greedy", "beams", "sampled", "beam_tree", "prompt_length", "settings"}
    ids = AutoTokenizer.from_pretrained(folder)("She eats an apple")["input_ids"]
    assert d["prompt_length"] == len(ids)
    for entry in [d["greedy"], *d["beams"], d["sampled"]]:
        assert entry["token_ids"][: len(ids)] == ids and isinstance(entry["text"], str)
        assert len(entry["probs"]) == len(entry["tokens"]) <= 5
    assert len(d["beams"]) == 2 and all(isinstance(b["score"], float) for b in d["beams"])
    assert d["beams"][0]["score"] >= d["beams"][1]["score"]
    assert "diverges_at" in d["sampled"] and d["sampled"]["seed"] == 4
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=5, num_beams=3, num_return_sequences=2,
                          do_sample=False, output_scores=True, return_dict_in_generate=True)  # fmt: skip
    assert [b["token_ids"] for b in d["beams"]] == ref.sequences.tolist()
    # --json is Comparison.to_json(), nothing added or dropped on the way
    from gpt_inspector import compare, load_model

    again = compare(load_model(folder, device="cpu"), "She eats an apple", max_new_tokens=5, num_beams=3,
                    num_return_sequences=2, sample=True, temperature=1.3, seed=4)  # fmt: skip
    assert d == json.loads(json.dumps(again.to_json()))


def test_text_is_side_by_side(tiny_dir, capsys):
    from transformers import AutoTokenizer

    n_prompt = len(AutoTokenizer.from_pretrained(tiny_dir["llama"])("One two")["input_ids"])
    rc, out, err = _run(
        capsys, "--model", tiny_dir["llama"], "--device", "cpu", "--prompt", "One two", "--max-length", n_prompt + 6,
        "--num-beams", 2, "--num-return-sequences", 2, "--early-stopping", "never",
    )  # fmt: skip
    assert rc == 0, err
    lines = out.splitlines()
    header = next(ln for ln in lines if ln.strip() and ln.split()[0].isdigit())
    # one column per generated position, numbered from the prompt length
    assert header.split()[0] == str(n_prompt)
    rows = {ln.split("  ")[0].strip(): ln for ln in lines[lines.index(header) + 1 :] if ln and not ln[0].isspace()}
    assert {"greedy", "beam 1", "beam 2"} <= set(rows) and "sample" not in rows
    # columns line up: each token column starts under its position number
    starts = [header.index(str(n_prompt + i)) for i in range(2)]
    greedy = lines[lines.index(header) + 1]
    assert greedy[starts[0] - 1] == " " and greedy[starts[1] - 1] == " "
    assert "score" in out and "greedy" in out


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--max-new-tokens", 3, "--num-beams", 2, "--num-return-sequences", 3], "cannot exceed"),
        (["--max-new-tokens", 3, "--num-beams", 0], "num-beams"),
        (["--max-length", 2], "no room"),
        ([], "exactly one"),
        (["--max-length", 9, "--max-new-tokens", 3], "exactly one"),
        (["--max-new-tokens", 3, "--early-stopping", "maybe"], "early_stopping"),
        (["--max-new-tokens", 3, "--temperature", 0.7], "--sample"),
    ],
)
def test_bad_input_exit_2_one_line(argv, msg, tiny_dir, capsys):
    rc, out, err = _run(capsys, "--model", tiny_dir["gpt2"], "--device", "cpu", "--prompt", "One two three", *argv)
    assert rc == 2
    assert err.count("\n") == 1 and msg in err and "Traceback" not in err
    assert out == ""
