"""What one step computed and chose, the same record for sessions, beams and traces."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from . import decoding

TOP_N = 10


@dataclass(frozen=True)
class TopEntry:
    token_id: int
    label: str  # readable token text (see tokens.token_label)
    prob: float
    logit: float

    @property
    def text(self) -> str:  # the name the first API used
        return self.label


def top_entries(
    probs: torch.Tensor, logits: torch.Tensor, label: Callable[[int], str], n: int = TOP_N
) -> list[TopEntry]:
    """The ``n`` most likely tokens of ``probs`` (V,), best first, with their labels and raw logits."""
    return top_rows(probs[None], logits[None], label, n)[0]


def top_rows(
    probs: torch.Tensor, logits: torch.Tensor, label: Callable[[int], str], n: int = TOP_N
) -> list[list[TopEntry]]:
    """``top_entries`` of every row of ``probs`` and ``logits`` (R, V), in one top-k on their device.

    Only tokens the decoding keeps (p > 0): top-k / top-p leave the rest at exactly 0, and the top
    ``n`` of a row whose tail is all zeros were arbitrary tokens from ``torch.topk``'s tie. Equal
    probabilities are listed by token id, so the order never depends on the kernel.
    """
    vals, idx = torch.topk(probs, min(n, probs.shape[-1]), dim=-1)  # (R, n)
    # one conversion each, not a tensor index per entry: this runs on every step
    ids, ps, ls = idx.tolist(), vals.tolist(), logits.gather(-1, idx).tolist()
    return [
        [TopEntry(i, label(i), p, lg) for i, p, lg in sorted(zip(*row), key=lambda e: (-e[1], e[0])) if p > 0]
        for row in zip(ids, ps, ls)
    ]


STAGE_TOP = 10  # candidates kept per stage
STAGE_LIST = 8  # removed or moved tokens listed per stage


@dataclass(frozen=True)
class Stage:
    """The distribution after one sampler stage, in brief: what it kept, removed and moved."""

    key: str  # the generate setting that made it ("" for the raw logits)
    label: str  # "repetition penalty 1.3"
    origin: str  # "" (raw), "yours" or "model default"
    top: tuple[TopEntry, ...]  # most likely after this stage, with their scores as ``logit``
    kept: int  # tokens with probability > 0
    removed: tuple[TopEntry, ...]  # removed here, the most likely before first (prob: before this stage)
    n_removed: int
    moved: tuple[tuple[TopEntry, int, int], ...]  # (token after, rank before, rank after), among the top


SMALL = 4096  # a stage keeping at most this many tokens is summarised from those alone


def stage_summaries(stages: list[decoding.StageScores], label: Callable[[int], str]) -> tuple[Stage, ...]:
    """``Stage`` of every stage's scores: the top ``STAGE_TOP`` and what changed from the stage before.

    Runs on every step for every processor, so a vocabulary-wide pass is spent only where needed:
    once a filter has cut the candidates to a few (top-k, top-p, ...), each later stage is read off
    those few, and the removed tokens are ranked among the removed ones only.
    """
    out, prev = [], None  # prev: (scores, probs or None, finite mask, kept, kept ids or None, rank)
    for st in stages:
        scores = st.scores  # (V,)
        if prev is not None and torch.equal(scores, prev[0]):  # a processor with nothing to do at this step
            last = out[-1]
            out.append(Stage(st.key, st.label, st.origin, last.top, last.kept, (), 0, ()))
            continue
        finite = scores > -math.inf  # (V,): -inf is how a processor removes a token
        kept = int(finite.sum())
        if kept <= SMALL:
            ids_kept = finite.nonzero()[:, 0]  # (kept,)
            sub = torch.softmax(scores[ids_kept], dim=-1)  # (kept,): the same probabilities, from the few
            pv, j = torch.topk(sub, min(STAGE_TOP, kept))
            idx, probs = ids_kept[j], None
        else:
            ids_kept, probs = None, torch.softmax(scores, dim=-1)  # (V,)
            pv, idx = torch.topk(probs, min(STAGE_TOP, scores.shape[-1]))
        ids, ps, ls = idx.tolist(), pv.tolist(), scores[idx].tolist()
        top = [TopEntry(i, label(i), p, lg) for i, p, lg in zip(ids, ps, ls)]
        rank = {i: n for n, i in enumerate(ids)}
        removed: tuple[TopEntry, ...] = ()
        n_removed, moved = 0, list[tuple[TopEntry, int, int]]()
        if prev is not None:
            p_scores, p_probs, p_finite, p_kept, p_ids, p_rank = prev
            if kept < p_kept:
                gone = p_ids[~finite[p_ids]] if p_ids is not None else (p_finite & ~finite).nonzero()[:, 0]  # (n,)
                n_removed = int(gone.numel())
                # their probabilities before this stage: the previous stage's softmax at those ids
                if p_ids is not None:
                    before = torch.softmax(p_scores[p_ids], -1)[~finite[p_ids]]
                else:
                    assert p_probs is not None  # a stage without kept ids kept its vocabulary-wide softmax
                    before = p_probs[gone]
                bv, bj = torch.topk(before, min(STAGE_LIST, n_removed))
                removed = tuple(TopEntry(int(i), label(int(i)), p, -math.inf)
                                for i, p in zip(gone[bj].tolist(), bv.tolist()))  # fmt: skip
            for e in top:
                was = p_rank.get(e.token_id)
                if was != rank[e.token_id] and len(moved) < STAGE_LIST:
                    moved.append((e, -1 if was is None else was, rank[e.token_id]))
        out.append(Stage(st.key, st.label, st.origin, tuple(top), kept, removed, n_removed, tuple(moved)))
        prev = (scores, probs, finite, kept, ids_kept, rank)
    return tuple(out)


@dataclass
class Step:
    """What one step computed and chose.

    ``position`` is the query position whose logits gave the token; the chosen token itself is
    not in the cache yet (it is fed by the next step).
    """

    index: int
    position: int
    token_id: int
    token_text: str  # the decoded text of the chosen token
    logits: torch.Tensor  # (V,) float32, raw model output
    probs: torch.Tensor  # (V,) float32 after temperature / top-k / top-p
    top: list[TopEntry]
    entropy: float
    forced: bool = False
    time_s: float = 0.0
    finish_reason: str | None = None
    rng_state: torch.Tensor | None = field(default=None, repr=False)
    label: str = ""  # the chosen token's readable label
    stages: tuple[Stage, ...] = ()  # raw logits, then each of generate's processors in order

    @property
    def prob(self) -> float:
        return float(self.probs[self.token_id])

    def refresh(self, sampler: decoding.Sampler | decoding.Decoding, label: Callable[[int], str],
                text: Callable[[int], str], context: Sequence[int] = (), stages=None) -> None:  # fmt: skip
        """Recompute what depends on the decoding settings and the chosen token. ``context``: the
        tokens before this step (prompt and earlier choices), which penalties and n-grams read;
        ``stages``: the sampler's stages of these logits if already computed."""
        if isinstance(sampler, decoding.Decoding):
            sampler = decoding.Sampler(sampler, prompt_length=len(context))
        stages = stages if stages is not None else sampler.stages(self.logits, context)
        self.probs = torch.softmax(stages[-1].scores, dim=-1)  # (V,)
        self.stages = stage_summaries(stages, label)
        self.entropy = decoding.entropy(self.probs)
        self.top = top_entries(self.probs, self.logits, label)
        self.token_text = text(self.token_id)
        self.label = label(self.token_id)

    def same_as(self, other: Step) -> bool:
        return (
            self.index == other.index
            and self.position == other.position
            and self.token_id == other.token_id
            and torch.equal(self.logits, other.logits)
            and torch.equal(self.probs, other.probs)
            and self.entropy == other.entropy
            and self.finish_reason == other.finish_reason
        )
