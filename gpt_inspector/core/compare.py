"""Greedy decoding vs beam search vs seeded samples on one prompt.

``compare()`` runs them and returns a ``Comparison``: typed fields for front ends, ``rows`` (every
output in display order, each with its ``kind``: greedy, beam, sample; another decoder adds rows of
its own kind), the fan-out tree of all outputs, the finished ``BeamSearch`` behind them (so any
returned beam can be inspected), and ``to_json()`` for the CLI and scripts.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypedDict

from . import chat, decoding, validate
from .beams import BeamSearch, BeamView, first_difference
from .beams import tree as beam_tree
from .errors import InspectorError
from .models import LoadedModel
from .session import Session

MAX_SAMPLES = 64  # per temperature: each is a whole run of the model
MAX_TEMPERATURES = 16


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


class Row(TypedDict, total=False):
    """One output in ``Comparison.rows``: a ``Decoded`` or a ``BeamOutput`` with its kind and name.

    ``kind`` is "greedy", "beam" or "sample" (a decoder added later brings its own kind); ``name``
    is what the table and the text show ("greedy", "beam 1", "sample 2 · T 0.7")."""

    kind: str
    name: str
    token_ids: list[int]
    text: str
    tokens: list[str]
    probs: list[float]
    diverges_at: int | None
    finish_reason: str | None
    score: float
    length: int
    seed: int
    temperature: float
    top_k: int | None
    top_p: float | None
    assisted: dict  # an assisted row's summary and rounds, as in ``Decoded``
    rounds: list[dict]


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
    sampled: Decoded | None  # the first of ``samples``; None without samples
    beam_tree: list[dict]  # BeamNode.to_json() of every node, 0 = the prompt
    warnings: list[str]
    samples: list[Decoded]  # each temperature's samples, seeds seed, seed + 1, ...
    rows: list[Row]  # greedy, beams, samples (then any other kind), in display order
    fanout_tree: list[dict]  # ``fanout()`` of ``rows``
    chat: dict | None  # the turns the prompt was built from (chat.Chat.to_json()), or None
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
        if self.chat is not None:
            out["chat"] = self.chat
        if self.warnings:
            out["warnings"] = self.warnings
        if self.sampled is not None:
            out["sampled"] = self.sampled
            out["samples"] = self.samples
        if self.assisted is not None:
            out["assisted"] = self.assisted
        out["beam_tree"] = self.beam_tree
        out["rows"] = self.rows  # the same outputs again, in display order with their kinds: what front ends draw
        out["fanout_tree"] = self.fanout_tree
        return copy.deepcopy(out)


def fanout(rows: list[Row], prompt_length: int, prompt: str) -> list[dict]:
    """Every row's generated tokens as one prefix tree: rows share a node while their tokens agree.

    Node 0 is the prompt. Each node: ``id``, ``parent``, ``step`` (generated-token index),
    ``token_id``, ``text``, ``rows`` (indices into ``rows`` passing through), ``probs`` (each of those
    rows' probability of the token, same order), ``greedy`` (on greedy's path) and ``parts`` (the rows
    whose first token that differs from greedy this is). ``rank`` orders siblings: greedy's first.
    """
    nodes: list[dict] = [{"id": 0, "parent": None, "step": -1, "token_id": None, "text": prompt, "rows": [],
                          "probs": [], "greedy": True, "parts": [], "rank": 0}]  # fmt: skip
    child: dict[tuple[int, int], int] = {}
    n_children: dict[int, int] = {}
    greedy = next((i for i, r in enumerate(rows) if r["kind"] == "greedy"), None)
    order = ([greedy] if greedy is not None else []) + [i for i in range(len(rows)) if i != greedy]
    for i in order:
        r = rows[i]
        at = 0
        nodes[0]["rows"].append(i)
        for j, tok in enumerate(r["token_ids"][prompt_length : prompt_length + len(r["tokens"])]):
            key = (at, int(tok))
            if key not in child:
                child[key] = len(nodes)
                n_children[at] = n_children.get(at, 0) + 1
                nodes.append({"id": len(nodes), "parent": at, "step": j, "token_id": int(tok), "text": r["tokens"][j],
                              "rows": [], "probs": [], "greedy": i == greedy, "parts": [],
                              "rank": n_children[at] - 1})  # fmt: skip
            at = child[key]
            nodes[at]["rows"].append(i)
            nodes[at]["probs"].append(float(r["probs"][j]))
            if r.get("diverges_at") == prompt_length + j:
                nodes[at]["parts"].append(i)
    return nodes


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
    samples: int | None = None,
    temperatures: list[float] | None = None,
    prompt_ids: list[int] | None = None,
    messages: list[dict] | None = None,
    add_generation_prompt: bool = True,
    progress: Callable[[str, int], None] | None = None,
    sampler: dict | None = None,
    assistant: LoadedModel | None = None,
    prompt_lookup_num_tokens: int | None = None,
    num_assistant_tokens: int | None = None,
    assistant_confidence_threshold: float | None = None,
) -> Comparison:
    """Greedy decoding, beam search and (with ``sample`` or ``samples``) seeded samples on one prompt.

    ``samples`` draws that many samples at each of ``temperatures`` (default: ``[temperature]``),
    sample j with seed ``seed + j`` at every temperature, so each equals ``torch.manual_seed(seed + j)``
    then ``generate(do_sample=True, temperature=t, ...)``; ``sample=True`` alone is ``samples=1``.

    Every output has ``token_ids`` (prompt included, as generate returns them), ``text``,
    per-token ``probs`` of the generated tokens and, except greedy, ``diverges_at`` (the first
    token index where it differs from greedy, None if identical). ``progress(what, step)`` is
    called as work advances (``what``: greedy, beams, sample, assisted). ``messages``: the prompt is the
    tokenizer's chat template of these turns (as ``Session(messages=...)``). ``sampler``: more of generate's
    sampler settings for the sample (``decoding.Decoding``'s names). ``assistant`` (a draft model) or
    ``prompt_lookup_num_tokens`` adds an assisted-decoding row (greedy: its tokens are greedy's) with its rounds.
    """
    seed = validate.seed(seed)
    made = None
    if messages is not None:  # the prompt the tokenizer's chat template makes (Session's rule)
        if prompt or prompt_ids is not None:
            raise InspectorError("give messages or a prompt, not both")
        made = chat.build(lm.tokenizer, messages, add_generation_prompt)
        prompt_ids = list(made.ids)
    search = BeamSearch(
        lm, prompt, num_beams, num_return_sequences, max_length, max_new_tokens, length_penalty, early_stopping,
        prompt_ids=prompt_ids,
    )  # fmt: skip
    n_samples = validate.integer("samples", samples, 0) if samples is not None else int(bool(sample))
    if n_samples > MAX_SAMPLES:
        raise InspectorError(f"samples: at most {MAX_SAMPLES} per temperature, got {n_samples}")
    temps = [temperature] if temperatures is None else list(temperatures)
    if n_samples:
        if not temps or len(temps) > MAX_TEMPERATURES:
            raise InspectorError(f"temperatures: give 1 to {MAX_TEMPERATURES} of them")
        for t in temps:
            decoding.validate(t, top_k, top_p)
            if float(t) <= 0:
                raise InspectorError("sampling needs a temperature > 0")
        validate.seed(seed + n_samples - 1)
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
    drawn: list[Decoded] = []
    greedy_out = _session_output(greedy, None)
    rows: list[Row] = [{"kind": "greedy", "name": "greedy", **greedy_out}]
    rows += [{"kind": "beam", "name": f"beam {i + 1}", **b} for i, b in enumerate(beams)]
    for t in temps if n_samples else []:
        for j in range(n_samples):
            s = Session(lm, prompt_ids=search.prompt_ids, temperature=t, top_k=top_k, top_p=top_p, seed=seed + j,
                        **(sampler or {}))  # fmt: skip
            run("sample", s.steps(new_tokens))
            out = _session_output(s, greedy_ids)
            out.update({"seed": seed + j, "temperature": float(t), "top_k": top_k, "top_p": top_p,
                        **{k: v for k, v in s.decoding.to_json().items() if k not in ("temperature", "top_k", "top_p")}})  # fmt: skip
            drawn.append(out)
            name = "sample" if n_samples == 1 and len(temps) == 1 else f"sample {j + 1} · T {float(t):g}"
            rows.append({"kind": "sample", "name": name, **out})

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
        rows.append({"kind": "assisted", "name": "assisted", **assisted})

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
        greedy=greedy_out,
        beams=beams,
        sampled=drawn[0] if drawn else None,
        beam_tree=search.tree_json(),
        warnings=warnings,
        samples=drawn,
        rows=rows,
        fanout_tree=fanout(rows, p, search.prompt),
        chat=None if made is None else made.to_json(),
        search=search,
        assisted=assisted,
    )


__all__ = ["BeamOutput", "Comparison", "Decoded", "Row", "Settings", "compare", "fanout", "first_difference"]
