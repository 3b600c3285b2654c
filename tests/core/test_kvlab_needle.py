"""The needle check on the demo model: HF generate (greedy, full cache) answers every planted fact, so the
check's cases are ones the model retrieves; a policy's answers are its own run's greedy tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import gpt_inspector as gi
from gpt_inspector.core.kvlab import make, needle
from gpt_inspector.core.kvlab.sweep import plan, sweep


@pytest.fixture(scope="module")
def demo():
    return gi.load_model(device="cpu")


def test_the_demo_model_retrieves_every_planted_fact_with_the_full_cache(demo):
    hf = AutoModelForCausalLM.from_pretrained(demo.name).eval()
    for case in needle.CASES:
        ids = demo.tokenizer.encode(case.prompt, add_special_tokens=False)
        want = needle.answer_ids(demo, case)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=len(want), pad_token_id=0)
        assert out[0, len(ids) :].tolist() == want, case.fact
        assert demo.tokenizer.decode(want) == case.answer
    full = needle.check(demo, lambda: make("h2o", None))
    assert full.found == full.same == full.reference_found == len(needle.CASES)


def test_a_policy_that_drops_the_fact_loses_the_answer(demo):
    # StreamingLLM keeps 4 sinks and the newest entries: the fact (positions 4 onwards) is gone
    r = needle.check(demo, lambda: make("streaming", 16), name="streaming")
    assert r.reference_found == len(needle.CASES) and r.found == 0 and r.same == 0
    d = r.to_json()
    assert d["cases"] == len(needle.CASES) and d["found"] == 0
    assert all(c["policy_answer"] != c["answer"] for c in d["detail"])


def test_the_sweep_puts_the_needle_beside_kl(demo):
    res = sweep(demo, ["She eats an apple every day and then"], plan(["streaming", "snapkv"], [16]), 2, probe=False,
                needle=True)  # fmt: skip
    pts = {p["policy"]: p for p in res.points()}
    assert pts["streaming"]["needle_found"] == 0.0 and pts["streaming"]["needle_reference_found"] == 1.0
    assert 0.0 < pts["snapkv"]["needle_found"] <= 1.0  # SnapKV's observation window votes for the fact
    n = len(needle.CASES)
    assert [(d["policy"], d["found"] / n) for d in res.to_json()["needle"]] == [
        (name, pts[name]["needle_found"]) for name in ("streaming", "snapkv")
    ]
    # the frontier's last panel: needles answered against bytes, one line per policy
    from gpt_inspector.figures import frontier_figure

    fig = frontier_figure(res)
    ax = fig.axes[-1]
    assert len(fig.axes) == 2 and "needles answered (full cache: 100%)" in ax.get_ylabel()
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [
        [pts["streaming"]["needle_found"]],
        [pts["snapkv"]["needle_found"]],
    ]
