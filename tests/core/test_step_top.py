"""Step.top lists only the tokens the decoding keeps, in an order that never depends on the kernel."""

from __future__ import annotations

import torch

from gpt_inspector import Session
from gpt_inspector.core.step import top_entries


def test_ties_are_listed_by_token_id_and_cut_tokens_not_at_all():
    probs = torch.zeros(50)
    probs[[41, 7, 23, 3]] = torch.tensor([0.25, 0.25, 0.4, 0.1])  # 41 and 7 tie; the other 46 are cut
    logits = torch.arange(50, dtype=torch.float32)
    top = top_entries(probs, logits, str)
    assert [(e.token_id, e.prob) for e in top] == [
        (23, 0.4000000059604645),
        (7, 0.25),
        (41, 0.25),
        (3, 0.10000000149011612),
    ]
    assert [e.logit for e in top] == [23.0, 7.0, 41.0, 3.0]


def test_top_p_keeps_the_nucleus_only(tiny_lm):
    s = Session(tiny_lm("gpt2"), "She eats an apple", temperature=1.0, top_p=0.3, seed=1)
    st = s.step()
    p = torch.softmax(st.logits.double(), -1)  # (V,) the equation, written out: the smallest set reaching 0.3
    order = sorted(range(len(p)), key=lambda i: -float(p[i]))
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += float(p[i])
        if mass >= 0.3:
            break
    assert [e.token_id for e in st.top] == kept[:10]
    assert all(e.prob > 0 for e in st.top)
