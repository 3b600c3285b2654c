"""Assisted (speculative) decoding, one round at a time, on a live session.

A proposer (a draft model with the target's tokenizer, or prompt lookup's n-gram match) offers
tokens; the target verifies them all in one forward through the inspector's capture, so every
view works on the target's steps; the target's greedy choices are kept up to the first one that
differs from the proposal (that one is the target's own, the "bonus" token when all agree), and
the cache positions of the rejected tokens are cropped from the target's cache (and from the
draft's). The proposals come from transformers' own candidate generators
(``AssistedCandidateGenerator``, ``PromptLookupCandidateGenerator``: ``hf.candidate_generator``),
built as ``generate`` builds them, so a run gives ``generate(assistant_model=..., do_sample=False)``'s
(or ``prompt_lookup_num_tokens``') tokens, and the same proposals round by round.

Greedy only: with ``do_sample=True`` generate verifies by speculative sampling, not shown here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

from . import hf, validate
from .errors import InspectorError
from .forward import crop_cache, interrupts_deferred, undo
from .models import LoadedModel
from .session import Session
from .step import Step


@dataclass(frozen=True)
class Round:
    """One proposal and its verification. Cache lengths are positions; bytes what the cache tensors hold."""

    index: int  # rounds count from 0
    first_step: int  # Step.index of the first step it committed
    proposed: tuple[int, ...]  # the proposer's tokens, in order
    accepted: int  # how many of them the target kept (a prefix)
    rejected: tuple[int, ...]  # proposed[accepted:]: cut from both caches
    tokens: tuple[int, ...]  # the target's tokens this round committed: the accepted ones, then its own
    target_cache_verified: int  # the target's cache after the verifying forward (every proposal fed)
    target_cache: int  # after the crop
    target_cache_bytes: int
    draft_cache_proposed: int | None  # the draft's cache after proposing (None: prompt lookup, no cache)
    draft_cache: int | None  # after the crop
    draft_cache_bytes: int | None
    seconds: float  # proposing and verifying

    def to_json(self) -> dict:
        out = asdict(self)
        out["proposed"], out["rejected"], out["tokens"] = list(self.proposed), list(self.rejected), list(self.tokens)
        return out


def _cache_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", ()):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                total += t.numel() * t.element_size()
    return total


def check_assistant(target: LoadedModel, draft: LoadedModel) -> None:
    """The draft must speak the target's tokens: same vocabulary size and the same token ids."""
    if draft.vocab_size != target.vocab_size:
        raise InspectorError(
            f"the assistant model's vocabulary has {draft.vocab_size} tokens, the target's {target.vocab_size}: "
            "assisted decoding needs a draft with the target's tokenizer"
        )
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise InspectorError(
            "the assistant model's tokenizer maps tokens to other ids than the target's: "
            "assisted decoding needs a draft with the target's tokenizer"
        )


class Tally:
    """What a run of rounds adds up to, for a local ``Assisted`` and a remote engine's alike (both keep
    ``session``, ``rounds``, ``mode`` and ``max_length``)."""

    session: Session
    rounds: list[Round]
    mode: str
    max_length: int

    @property
    def ended(self) -> bool:
        return bool(self.session.finished) or len(self.session.tokens) >= self.max_length

    @property
    def proposed(self) -> int:
        return sum(len(r.proposed) for r in self.rounds)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rounds)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over proposed tokens, over the run; None before anything was proposed."""
        n = self.proposed
        return self.accepted / n if n else None

    def summary(self) -> dict:
        return {"mode": self.mode, "rounds": len(self.rounds), "proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": self.acceptance_rate, "new_tokens": len(self.session.steps_done)}  # fmt: skip


class Assisted(Tally):
    """Assisted decoding on ``session`` (the target), a round per ``round()``.

    ``assistant``: a draft ``LoadedModel`` with the target's tokenizer; or ``prompt_lookup_num_tokens``
    (with ``max_matching_ngram_size``, generate's default 2). ``num_assistant_tokens`` sets the
    draft's tokens per round and ``assistant_confidence_threshold`` where its own generate stops early
    (generate reads both off the draft's generation config: 20 and 0.4 by default; 0 never stops).
    ``max_new_tokens`` caps the run as generate's does (proposals included); default the context.

    On a remote engine's session (``gi.connect``) the engine runs it, with the same API: the assistant is
    then a draft model's folder on the engine's machine (a str), which the engine loads.
    """

    def __new__(cls, session, *args, **kwargs):
        if getattr(session, "engine", None) is not None:  # the model is on a remote engine: it runs the rounds
            return session.remote_assisted(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, session: Session, assistant: LoadedModel | None = None, *,
                 prompt_lookup_num_tokens: int | None = None, max_matching_ngram_size: int | None = None,
                 num_assistant_tokens: int | None = None, assistant_confidence_threshold: float | None = None,
                 max_new_tokens: int | None = None):  # fmt: skip
        self.check(session, assistant, prompt_lookup_num_tokens=prompt_lookup_num_tokens,
                   max_matching_ngram_size=max_matching_ngram_size, num_assistant_tokens=num_assistant_tokens,
                   max_new_tokens=max_new_tokens)  # fmt: skip
        if assistant_confidence_threshold is not None:
            t = assistant_confidence_threshold
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 1:
                raise InspectorError(f"assistant_confidence_threshold must be a number from 0 to 1, not {t!r}")
            if assistant is None:
                raise InspectorError("assistant_confidence_threshold applies to a draft model, not to prompt lookup")
        if session.steps_done:
            raise InspectorError("assisted decoding starts at the prompt: restart the session first")
        lm = session.lm
        self.session = session
        self.assistant = assistant
        self.mode = "prompt lookup" if assistant is None else "draft model"
        p = len(session.prompt_ids)
        self.max_length = min(p + max_new_tokens, lm.context_length) if max_new_tokens else lm.context_length
        sampler = session.sampler()
        self.generator = hf.candidate_generator(
            sampler.settings, lm.eos_token_ids, self.max_length, session.prompt_ids, lm.vocab_size, lm.device,
            assistant_model=None if assistant is None else assistant.model,
            prompt_lookup_num_tokens=prompt_lookup_num_tokens, max_matching_ngram_size=max_matching_ngram_size,
            num_assistant_tokens=num_assistant_tokens, assistant_confidence_threshold=assistant_confidence_threshold,
        )  # fmt: skip
        self.settings = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens,
                         "max_matching_ngram_size": max_matching_ngram_size,
                         "num_assistant_tokens": num_assistant_tokens,
                         "assistant_confidence_threshold": assistant_confidence_threshold,
                         "max_new_tokens": max_new_tokens}  # fmt: skip
        self.rounds: list[Round] = []
        self._draft_fed: list[int] = []  # the tokens whose positions the draft's cache holds

    @staticmethod
    def check(session: Session, assistant: LoadedModel | None = None, **numbers) -> None:
        """Refuse what cannot run (InspectorError, one line) before anything changes: ``numbers`` are the
        keyword arguments of ``Assisted`` other than the assistant."""
        if (assistant is None) == (numbers.get("prompt_lookup_num_tokens") is None):
            raise InspectorError("assisted decoding needs an assistant model or prompt_lookup_num_tokens, one of them")
        if not session.decoding.greedy:
            raise InspectorError("assisted decoding here is greedy (do_sample=False): set the temperature to 0")
        for name, v in numbers.items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise InspectorError(f"{name} must be a whole number >= 1, not {v!r}")
            limit = session.context_length
            if name != "max_new_tokens" and v is not None and v > limit:  # transformers overflowed a C long on 10**30
                raise InspectorError(f"{name} must be at most the model's context, {limit} tokens, not {v}")
        if assistant is not None:
            check_assistant(session.lm, assistant)
        if session.recorder.kv_policy is not None:
            raise InspectorError("a KV cache policy's run evicts after every single step: "
                                 "assisted decoding runs on the live session, not on the lab's policy run")  # fmt: skip
        if hasattr(session.cache, "rewind_states"):
            # a state-space layer's state after the verifying forward holds the rejected tokens too
            raise InspectorError("a hybrid model's state-space layers cannot be cut back to the middle of a "
                                 "forward: no assisted decoding for it")  # fmt: skip

    # ------------------------------------------------------------------ state
    @property
    def draft_cache(self):
        return None if self.assistant is None else self.generator.assistant_kwargs.get("cache")

    # ------------------------------------------------------------------ rounds
    def _sync_draft(self) -> None:
        """Crop the draft's cache to the tokens it shares with the target's (after a step back or a
        forced token as after a rejection); generate's own crop to length - 2 follows in get_candidates."""
        cache = self.draft_cache
        if cache is None:
            return
        tokens, fed = self.session.tokens, self._draft_fed
        common = 0
        for a, b in zip(fed, tokens):
            if a != b:
                break
            common += 1
        keep = min(common, len(tokens) - 2, cache.get_seq_length())
        crop_cache(cache, max(keep, 0))
        self._draft_fed = list(fed[: max(keep, 0)])

    def round(self) -> Round:
        """Propose, verify in one forward of the target, keep the agreed prefix and the target's next token."""
        s = self.session
        if self.ended:
            raise InspectorError(f"generation has finished ({s.finished or 'max length'}); step back or restart")
        t0 = time.perf_counter()
        self._sync_draft()
        before = torch.tensor([s.tokens], dtype=torch.long)  # (1, L): generate's input_ids
        with torch.inference_mode():
            cand, _ = self.generator.get_candidates(before.to(self._proposer_device))
        proposed = [int(t) for t in cand[0, before.shape[1] :].tolist()]
        cache = self.draft_cache
        draft_len = None if cache is None else cache.get_seq_length()
        if cache is not None:
            self._draft_fed = [int(t) for t in cand[0, :draft_len].tolist()]
        ids, start, rng = s.next_input()
        index = s.n_steps
        sampler = s.sampler()
        try:
            logits = s._forward(ids + proposed, len(proposed) + 1)  # (k + 1, V)
            verified = s.cache_length
            chosen: list[int] = []
            budget = self.max_length - len(s.tokens)
            for i in range(len(proposed) + 1):
                token = sampler.choose(logits[i], s.tokens + chosen, None)
                chosen.append(token)
                full = len(s.tokens) + len(chosen) > s.lm.context_length  # as the session's step ends
                if token in s.lm.eos_token_ids or full or len(chosen) >= budget:
                    break
                if i < len(proposed) and token != proposed[i]:
                    break
            accepted = 0
            while accepted < min(len(chosen), len(proposed)) and chosen[accepted] == proposed[accepted]:
                accepted += 1
            keep = start + len(ids) + len(chosen) - 1  # every chosen token fed but the last
            seconds = time.perf_counter() - t0

            def crop() -> None:
                crop_cache(s.cache, keep)
                s.recorder.crop(keep)

            undo(crop)
            with interrupts_deferred():  # every step of the round or none
                steps = [s.commit_step(logits[i], seconds / len(chosen)) for i in range(len(chosen))]
        except BaseException:
            if s.n_steps == index:
                s.undo_forward(start, rng)
            else:  # a fault between two commits: the steps made stay, the cache and records cut to match them
                fed = len(s.tokens) - 1

                def match() -> None:
                    crop_cache(s.cache, fed)
                    s.recorder.crop(fed)

                undo(match)
            raise
        assert [st.token_id for st in steps] == chosen, "a step chose another token than the verification"
        self.generator.update_candidate_strategy(
            torch.tensor([s.tokens], device=self._proposer_device), logits[None], len(chosen) - 1
        )
        self._sync_draft()
        cache = self.draft_cache
        r = Round(
            index=len(self.rounds), first_step=index, proposed=tuple(proposed), accepted=accepted,
            rejected=tuple(proposed[accepted:]), tokens=tuple(chosen), target_cache_verified=verified,
            target_cache=s.cache_length, target_cache_bytes=_cache_bytes(s.cache), draft_cache_proposed=draft_len,
            draft_cache=None if cache is None else cache.get_seq_length(),
            draft_cache_bytes=None if cache is None else _cache_bytes(cache), seconds=seconds,
        )  # fmt: skip
        self.rounds.append(r)
        return r

    @property
    def _proposer_device(self) -> torch.device:
        return self.session.lm.device if self.assistant is None else self.assistant.device

    def iter_rounds(self, max_rounds: int | None = None) -> Iterator[Round]:
        """Rounds until the run ends (EOS, max length) or ``max_rounds``; front ends may stop any time."""
        if max_rounds is not None:
            validate.count(max_rounds)
        n = 0
        while not self.ended and (max_rounds is None or n < max_rounds):
            yield self.round()
            n += 1

    def run(self, max_rounds: int | None = None) -> list[Round]:
        return list(self.iter_rounds(max_rounds))

    def back(self) -> Round:
        """Undo the last round: its steps stepped back (the target's cache cropped), the draft's cache synced."""
        if not self.rounds:
            raise InspectorError("no round to undo")
        r = self.rounds[-1]
        s = self.session
        if s.n_steps != r.first_step + len(r.tokens) or s.tokens[-len(r.tokens) :] != list(r.tokens):
            raise InspectorError("the session has moved on since the last round (a step or a forced token)")
        for _ in r.tokens:
            s.step_back()
        self.rounds.pop()
        self._sync_draft()
        return r

    def steps_of(self, r: Round) -> list[Step]:
        return self.session.steps_done[r.first_step : r.first_step + len(r.tokens)]


def assisted(lm: LoadedModel, prompt: str = "", assistant: LoadedModel | None = None, *,
             prompt_lookup_num_tokens: int | None = None, max_matching_ngram_size: int | None = None,
             num_assistant_tokens: int | None = None, assistant_confidence_threshold: float | None = None,
             max_new_tokens: int = 20, prompt_ids: list[int] | None = None, **settings) -> Assisted:  # fmt: skip
    """A greedy session on ``lm`` run to ``max_new_tokens`` by assisted decoding; the rounds are on the result."""
    s = Session(lm, prompt, prompt_ids=prompt_ids, **settings)
    a = Assisted(s, assistant, prompt_lookup_num_tokens=prompt_lookup_num_tokens,
                 max_matching_ngram_size=max_matching_ngram_size, num_assistant_tokens=num_assistant_tokens,
                 assistant_confidence_threshold=assistant_confidence_threshold, max_new_tokens=max_new_tokens)  # fmt: skip
    a.run()
    return a


__all__ = ["Assisted", "Round", "assisted", "check_assistant"]
