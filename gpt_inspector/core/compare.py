"""Greedy decoding vs beam search vs a seeded sample on one prompt.

``compare()`` runs the three and returns a ``Comparison``: typed fields for front ends, the
finished ``BeamSearch`` behind them (so any returned beam can be inspected), and ``to_json()``
for the CLI and scripts.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypedDict

from . import decoding, validate
from .beams import BeamSearch, BeamView, first_difference
from .beams import tree as beam_tree
from .errors import InspectorError
from .models import LoadedModel
from .session import Session


class Decoded(TypedDict, total=False):
    """One decoded output (greedy or the sample). ``diverges_at`` is absent for greedy itself;
    the sample adds ``seed``, ``temperature``, ``top_k`` and ``top_p``; the assisted row ``assisted`` and ``rounds``."""

    token_ids: list[int]  # prompt included
    text: str
    tokens: list[str]  # labels of the generated tokens
    probs: list[float]  # each generated token's probability under its own distribution
    finish_reason: str | None
    diverges_at: int | None
    seed: int
    temperature: float
    top_k: int | None
    top_p: float | None
    assisted: dict  # the assisted row's mode, rounds, proposed, accepted, acceptance_rate
    rounds: list[dict]  # its rounds (Round.to_json())


class BeamOutput(TypedDict):
    """One returned beam, as generate returns it (``token_ids`` padded to the longest returned)."""

    token_ids: list[int]
    text: str
    score: float  # generate's sequences_scores
    tokens: list[str]
    probs: list[float]
    length: int  # unpadded length, prompt included
    diverges_at: int | None


class Settings(TypedDict):
    num_beams: int
    num_return_sequences: int
    length_penalty: float
    early_stopping: bool | str
    eos_token_ids: list[int]
    pad_token_id: int | None


@dataclass(frozen=True)
class Comparison:
    """What ``compare()`` found. Frozen: fields cannot be reassigned (their lists are not copied)."""

    model: str
    prompt: str
    prompt_ids: list[int]
    prompt_length: int
    max_length: int  # prompt included
    settings: Settings
    greedy: Decoded
    beams: list[BeamOutput]  # best first
    sampled: Decoded | None  # None unless compare(..., sample=True)
    beam_tree: list[dict]  # BeamNode.to_json() of every node, 0 = the prompt
    warnings: list[str]
    # the finished search, for inspecting beams; not data, so out of JSON, repr and equality
    search: BeamSearch = field(repr=False, compare=False)
    # assisted decoding (compare(..., assistant=... or prompt_lookup_num_tokens=...)): greedy's tokens,
    # with its rounds; None otherwise
    assisted: Decoded | None = None

    def beam_view(self, r: int) -> BeamView:
        """Returned sequence ``r`` (0 = best) with a Session's read-only accessors."""
        return self.search.result_view(r)

    def to_json(self) -> dict:
        """A JSON-ready dict (``sampled`` and ``warnings`` only when present); a copy, safe to change."""
        out = {k: getattr(self, k) for k in ("model", "prompt", "prompt_ids", "prompt_length", "max_length", "settings",
                                             "greedy", "beams")}  # fmt: skip
        # the key order the CLI has always printed
        if self.warnings:
            out["warnings"] = self.warnings
        if self.sampled is not None:
            out["sampled"] = self.sampled
        if self.assisted is not None:
            out["assisted"] = self.assisted
        out["beam_tree"] = self.beam_tree
        return copy.deepcopy(out)


def _session_output(s: Session, greedy_ids: list[int] | None) -> Decoded:
    out: Decoded = {
        "token_ids": list(s.tokens),
        "text": s.text,
        "tokens": s.token_labels(s.tokens[len(s.prompt_ids) :]),
        "probs": [float(st.prob) for st in s.steps_done],
        "finish_reason": s.finished,
    }
    if greedy_ids is not None:
        out["diverges_at"] = first_difference(s.tokens, greedy_ids)
    return out


def compare(
    lm: LoadedModel,
    prompt: str = "",
    max_length: int | None = None,
    max_new_tokens: int | None = None,
    num_beams: int = 2,
    num_return_sequences: int = 1,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    *,
    prompt_ids: list[int] | None = None,
    progress: Callable[[str, int], None] | None = None,
    sampler: dict | None = None,
    assistant: LoadedModel | None = None,
    prompt_lookup_num_tokens: int | None = None,
    num_assistant_tokens: int | None = None,
    assistant_confidence_threshold: float | None = None,
) -> Comparison:
    """Greedy decoding, beam search and (with ``sample``) a seeded sample on one prompt.

    Every output has ``token_ids`` (prompt included, as generate returns them), ``text``,
    per-token ``probs`` of the generated tokens and, except greedy, ``diverges_at`` (the first
    token index where it differs from greedy, None if identical). ``progress(what, step)`` is
    called as work advances (``what``: greedy, beams, sample). ``sampler``: more of generate's
    sampler settings for the sample (``decoding.Decoding``'s names). ``assistant`` (a draft model) or
    ``prompt_lookup_num_tokens`` adds an assisted-decoding row (greedy: its tokens are greedy's) with its rounds.
    """
    seed = validate.seed(seed)
    search = BeamSearch(
        lm, prompt, num_beams, num_return_sequences, max_length, max_new_tokens, length_penalty, early_stopping,
        prompt_ids=prompt_ids,
    )  # fmt: skip
    if sample:
        decoding.validate(temperature, top_k, top_p)
        if float(temperature) <= 0:
            raise InspectorError("sampling needs a temperature > 0")
    p = len(search.prompt_ids)
    new_tokens = search.max_length - p

    def run(what: str, steps) -> None:
        for st in steps:
            if progress:
                progress(what, st.index)

    greedy = Session(lm, prompt_ids=search.prompt_ids, temperature=0.0)
    run("greedy", greedy.steps(new_tokens))
    greedy_ids = list(greedy.tokens)
    run("beams", search.steps())
    res = search.result()
    tok = lm.tokenizer
    beams: list[BeamOutput] = []
    for seq, score, hyp in zip(res.sequences, res.sequences_scores, res.hypotheses):
        path = beam_tree.path(search.nodes, hyp.node)
        beams.append({
            "token_ids": seq,
            "text": tok.decode(hyp.token_ids),
            "score": float(score),
            "tokens": [n.text for n in path],
            "probs": [n.prob for n in path],
            "length": len(hyp.token_ids),
            "diverges_at": first_difference(hyp.token_ids, greedy_ids),
        })  # fmt: skip

    warnings = []
    if search.unmirrored:
        warnings.append(
            "the model's generation_config sets " + ", ".join(search.unmirrored)
            + "; generate() would apply them, this comparison does not"
        )  # fmt: skip
    sampled: Decoded | None = None
    if sample:
        s = Session(lm, prompt_ids=search.prompt_ids, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                    **(sampler or {}))  # fmt: skip
        run("sample", s.steps(new_tokens))
        sampled = _session_output(s, greedy_ids)
        sampled.update({"seed": seed, "temperature": float(temperature), "top_k": top_k, "top_p": top_p,
                        **{k: v for k, v in s.decoding.to_json().items() if k not in ("temperature", "top_k", "top_p")}})  # fmt: skip

    assisted: Decoded | None = None
    if assistant is not None or prompt_lookup_num_tokens is not None:
        from .assisted import Assisted

        a = Assisted(Session(lm, prompt_ids=search.prompt_ids, temperature=0.0), assistant,
                     prompt_lookup_num_tokens=prompt_lookup_num_tokens, num_assistant_tokens=num_assistant_tokens,
                     assistant_confidence_threshold=assistant_confidence_threshold, max_new_tokens=new_tokens)  # fmt: skip
        for r in a.iter_rounds():
            if progress:
                progress("assisted", r.first_step)
        assisted = _session_output(a.session, greedy_ids)
        assisted.update({"assisted": a.summary(), "rounds": [r.to_json() for r in a.rounds]})

    return Comparison(
        model=lm.name,
        prompt=search.prompt,
        prompt_ids=list(search.prompt_ids),
        prompt_length=p,
        max_length=search.max_length,
        settings={
            "num_beams": search.num_beams,
            "num_return_sequences": search.num_return_sequences,
            "length_penalty": search.length_penalty,
            "early_stopping": search.early_stopping,
            "eos_token_ids": list(search.eos_token_ids),
            "pad_token_id": search.pad_token_id,
        },
        greedy=_session_output(greedy, None),
        beams=beams,
        sampled=sampled,
        beam_tree=search.tree_json(),
        warnings=warnings,
        search=search,
        assisted=assisted,
    )


__all__ = ["BeamOutput", "Comparison", "Decoded", "Settings", "compare", "first_difference"]
