"""compare(): N seeded samples at several temperatures, each exactly generate(do_sample=True, ...) with
the same seed; every output a row with its kind; the fan-out tree joins them where they agree."""

from __future__ import annotations

import pytest
import torch

import gpt_inspector as gi
from gpt_inspector.core.errors import InspectorError

PROMPT = "She eats an apple and"
NEW = 6


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_each_sample_is_generate_with_its_seed(family, tiny_lm, hf_eager):
    lm, hf = tiny_lm(family), hf_eager(family)
    r = gi.compare(lm, PROMPT, max_new_tokens=NEW, num_beams=2, samples=3, temperatures=[0.7, 1.6], seed=11,
                   top_k=40, sampler={"repetition_penalty": 1.2})  # fmt: skip
    assert [(x["seed"], x["temperature"]) for x in r.samples] == [(s, t) for t in (0.7, 1.6) for s in (11, 12, 13)]
    x = torch.tensor([r.prompt_ids])
    eos = lm.eos_token_ids[0]
    for out in r.samples:
        torch.manual_seed(out["seed"])  # generate draws from the global generator
        with torch.no_grad():
            ref = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=True, temperature=out["temperature"],
                              top_k=40, repetition_penalty=1.2, max_new_tokens=NEW, pad_token_id=eos)  # fmt: skip
        assert out["token_ids"] == ref[0].tolist(), out
    # the samples differ among themselves (the seeds and temperatures bite)
    assert len({tuple(o["token_ids"]) for o in r.samples}) > 1
    greedy = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW, pad_token_id=eos)
    assert r.greedy["token_ids"] == greedy[0].tolist()
    for out in r.samples:
        div = gi.core.compare.first_difference(out["token_ids"], r.greedy["token_ids"])
        assert out["diverges_at"] == div


def test_rows_and_fanout_tree(tiny_lm):
    r = gi.compare(tiny_lm("gpt2"), PROMPT, max_new_tokens=NEW, num_beams=2, num_return_sequences=2, samples=2,
                   temperatures=[1.0, 2.0], seed=3)  # fmt: skip
    assert [x["kind"] for x in r.rows] == ["greedy", "beam", "beam", "sample", "sample", "sample", "sample"]
    assert [x["name"] for x in r.rows][3:] == ["sample 1 · T 1", "sample 2 · T 1", "sample 1 · T 2", "sample 2 · T 2"]
    assert r.sampled == r.samples[0] and r.rows[3]["token_ids"] == r.samples[0]["token_ids"]
    p = r.prompt_length
    nodes = r.fanout_tree
    by_id = {n["id"]: n for n in nodes}
    for i, row in enumerate(r.rows):
        # walking up from the node each row ends at gives exactly its generated tokens
        end = max((n for n in nodes if i in n["rows"]), key=lambda n: n["step"])
        path = []
        while end["parent"] is not None:
            path.append(end["token_id"])
            end = by_id[end["parent"]]
        assert path[::-1] == row["token_ids"][p : p + len(row["tokens"])]
        parts = [n for n in nodes if i in n["parts"]]
        if row["kind"] == "greedy" or row["diverges_at"] is None:
            assert not parts
        else:  # the first node of this row off greedy's path
            assert len(parts) == 1 and parts[0]["step"] == row["diverges_at"] - p
            assert not parts[0]["greedy"] and by_id[parts[0]["parent"]]["greedy"]
    # a node is shared exactly by the rows whose tokens agree up to it
    for n in nodes[1:]:
        prefixes = {tuple(r.rows[i]["token_ids"][p : p + n["step"] + 1]) for i in n["rows"]}
        assert len(prefixes) == 1
    assert len(r.to_json()["rows"]) == 7 and r.to_json()["fanout_tree"] == nodes


def test_sample_true_is_one_sample_as_before(tiny_lm):
    lm = tiny_lm("gpt2")
    a = gi.compare(lm, PROMPT, max_new_tokens=4, sample=True, temperature=1.3, seed=4)
    b = gi.compare(lm, PROMPT, max_new_tokens=4, samples=1, temperatures=[1.3], seed=4)
    assert a.sampled == b.sampled and len(a.samples) == 1 and a.rows[-1]["name"] == "sample"


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        (dict(samples=-1), "samples must be"),
        (dict(samples=2, temperatures=[]), "temperatures"),
        (dict(samples=2, temperatures=[0.0]), "temperature > 0"),
        (dict(samples=2, temperatures=[float("nan")]), "temperature"),
        (dict(samples=10**6), "at most"),
    ],
)
def test_bad_sample_settings_refused(kwargs, msg, tiny_lm):
    with pytest.raises(InspectorError, match=msg):
        gi.compare(tiny_lm("gpt2"), PROMPT, max_new_tokens=2, **kwargs)
