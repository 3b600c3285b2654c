"""A task-level check beside KL: a fact planted early in a long prompt, asked for at its end (a
needle in a haystack). Does a cache policy still answer it?

Each case is a prompt (the fact, filler, the question) and the answer the model gives with the
full cache. The check runs a free-running lab per case for as many steps as the answer has
tokens and records two things per policy: whether the policy run's greedy answer is the planted
answer (``found``) and whether it is the same as the full cache's (``same``). ``found`` only means
something where the full cache finds the answer; ``reference_found`` says so per case.

The default cases suit the demo model (``resources/demo-gpt2``, a 256-token context): a list of
eight words of its corpus planted first, eight filler sentences (~60 tokens), then the list's first
three words again; with the full cache it continues with the next three (by copying: its induction
head), verified by ``tests/core/test_kvlab_needle.py``. On another model, a case the full cache
does not answer still measures ``same``: whether the policy's greedy answer is the full cache's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import InspectorError
from .lab import KVLab
from .policy import Policy

# the demo corpus's everyday sentences: filler the model reads without anything to retrieve in it
FILLER = (
    "She eats an apple every day.",
    "He reads a book in the park.",
    "They walk to school in the morning.",
    "We cook soup for dinner.",
    "The children play with the ball.",
    "I drink tea with milk.",
    "My mother bakes bread on Sunday.",
    "He buys eggs and cheese at the shop.",
)


@dataclass(frozen=True)
class NeedleCase:
    """A fact planted before ``filler`` sentences of filler, and the question at the end."""

    fact: str  # the sentence planted first
    question: str  # the prompt's last words, which the answer continues
    answer: str  # the planted continuation (with its leading space)
    filler: int = 8  # sentences of ``FILLER`` (in turn) between the fact and the question

    @property
    def prompt(self) -> str:
        return " ".join([self.fact, *(FILLER[i % len(FILLER)] for i in range(self.filler)), self.question])


# a list of the corpus's words planted once and its first three words asked again: the demo model continues
# the list by copying (its induction head); these are lists it retrieves with the full cache, ~60 tokens back
CASES = tuple(
    NeedleCase(f"{words}.", " ".join(words.split()[:3]), " " + " ".join(words.split()[3:6]))
    for words in (
        "pink bread Monday yellow melon window kitten lemons",
        "cheese lemons river seven ducks melon window apple",
        "ducks cheese Friday apple yellow kitten garden river",
        "yellow river ducks seven kitten apple garden Monday",
        "cheese lemons garden ducks Friday yellow river window",
        "kitten melon lemons river garden cheese honey window",
        "seven pink cheese bread lemons garden window apple",
    )
)


@dataclass
class NeedleResult:
    """One policy on every case: per case, the reference's and the policy's answer tokens."""

    policy: str
    cases: list[dict] = field(default_factory=list)

    @property
    def found(self) -> int:
        return sum(c["found"] for c in self.cases)

    @property
    def same(self) -> int:
        return sum(c["same"] for c in self.cases)

    @property
    def reference_found(self) -> int:
        return sum(c["reference_found"] for c in self.cases)

    def to_json(self) -> dict:
        return {"policy": self.policy, "cases": len(self.cases), "found": self.found, "same": self.same,
                "reference_found": self.reference_found, "detail": self.cases}  # fmt: skip


def answer_ids(lm, case: NeedleCase) -> list[int]:
    """The answer's tokens as they follow the question in one text (BPE may merge across the seam)."""
    tok = lm.tokenizer
    q = tok.encode(case.prompt, add_special_tokens=False)
    full = tok.encode(case.prompt + case.answer, add_special_tokens=False)
    if full[: len(q)] != q or len(full) == len(q):
        raise InspectorError(f"the needle's answer {case.answer!r} does not tokenize after its question")
    return full[len(q) :]


def check(lm, make_policy: Callable[[], Policy], cases: Sequence[NeedleCase] = CASES, name: str = "") -> NeedleResult:
    """Run ``make_policy()`` (a fresh policy per case) on every case, greedy and free-running."""
    out = NeedleResult(name)
    for case in cases:
        want = answer_ids(lm, case)
        ids = lm.tokenizer.encode(case.prompt, add_special_tokens=False)
        if len(ids) + len(want) > lm.context_length:
            raise InspectorError(f"the needle prompt is {len(ids)} tokens; the model's context is {lm.context_length}")
        lab = KVLab(lm, policy=make_policy(), prompt_ids=ids, free_running=True)
        lab.run_steps(len(want))
        while lab.reference.n_steps < len(want) and not lab.reference.finished:
            lab.reference.step()  # the policy run ended early (EOS): the full cache's answer still counts
        ref = lab.reference.tokens[len(ids) : len(ids) + len(want)]
        got = lab.run.tokens[len(ids) : len(ids) + len(want)]
        out.cases.append({
            "question": case.question, "answer": case.answer, "prompt_tokens": len(ids),
            "reference_answer": lm.tokenizer.decode(ref), "policy_answer": lm.tokenizer.decode(got),
            "reference_found": ref == want, "found": got == want, "same": got == ref,
        })  # fmt: skip
    return out
