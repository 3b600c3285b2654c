"""Turn logits into a next-token choice with transformers' own logits processors, stage by stage.

``Decoding`` holds the user's settings under ``generate``'s keyword names; ``Sampler`` resolves
them over the model's shipped generation-config defaults and asks transformers for the very
``LogitsProcessorList`` ``generate`` builds (``hf.logits_processor_list``), then applies it one
processor at a time so every stage's scores can be shown. Temperature 0 means greedy, as
``do_sample=False`` in ``generate``: the warpers (temperature, top-k, top-p, min-p, typical-p,
epsilon, eta) are not applied, the processors (penalties, n-grams, suppressed and bad words, min
new tokens, forced EOS) are, and the token is the argmax of their output.

"Off" means off: transformers' global fallbacks (top-k 50 when sampling) apply only where the
checkpoint's own generation config sets them, so ``generate_kwargs()`` spells every setting out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from . import hf
from .errors import InspectorError

# applied only when sampling (do_sample), after the processors, in generate's order
WARPERS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
PROCESSORS = ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "min_new_tokens",
              "forced_eos_token_id", "suppress_tokens")  # fmt: skip
# which setting gave each processor class transformers builds (others come from settings we do not
# expose, which only a checkpoint ships: min_length, begin_suppress_tokens, ...)
SETTING_OF = {
    "TemperatureLogitsWarper": "temperature", "TopKLogitsWarper": "top_k", "TopPLogitsWarper": "top_p",
    "MinPLogitsWarper": "min_p", "TypicalLogitsWarper": "typical_p", "EpsilonLogitsWarper": "epsilon_cutoff",
    "EtaLogitsWarper": "eta_cutoff", "RepetitionPenaltyLogitsProcessor": "repetition_penalty",
    "NoRepeatNGramLogitsProcessor": "no_repeat_ngram_size", "NoBadWordsLogitsProcessor": "bad_words_ids",
    "MinNewTokensLengthLogitsProcessor": "min_new_tokens", "ForcedEOSTokenLogitsProcessor": "forced_eos_token_id",
    "SuppressTokensLogitsProcessor": "suppress_tokens", "MinLengthLogitsProcessor": "min_length",
    "SuppressTokensAtBeginLogitsProcessor": "begin_suppress_tokens", "TopHLogitsWarper": "top_h",
    "ForcedBOSTokenLogitsProcessor": "forced_bos_token_id", "SequenceBiasLogitsProcessor": "sequence_bias",
    "ExponentialDecayLengthPenalty": "exponential_decay_length_penalty",
    "InfNanRemoveLogitsProcessor": "remove_invalid_values", "LogitNormalization": "renormalize_logits",
}  # fmt: skip
MODEL_DEFAULT = "model default"
YOURS = "yours"


@dataclass(frozen=True)
class Decoding:
    """The user's settings, by ``generate``'s names; None: not set (the model's default, if it ships one)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    epsilon_cutoff: float | None = None
    eta_cutoff: float | None = None
    repetition_penalty: float | None = None
    no_repeat_ngram_size: int | None = None
    suppress_tokens: tuple[int, ...] | None = None
    bad_words_ids: tuple[tuple[int, ...], ...] | None = None
    min_new_tokens: int | None = None
    forced_eos_token_id: int | None = None
    max_new_tokens: int | None = None  # where forced EOS fires (generate's max_length = prompt + this)

    def __post_init__(self):
        # lists from JSON or a caller become tuples: the settings are hashable and compare by value
        if self.suppress_tokens is not None and not isinstance(self.suppress_tokens, tuple):
            object.__setattr__(self, "suppress_tokens", _id_tuple(self.suppress_tokens, "suppress_tokens"))
        if self.bad_words_ids is not None and not (
            isinstance(self.bad_words_ids, tuple) and all(isinstance(w, tuple) for w in self.bad_words_ids)
        ):
            object.__setattr__(self, "bad_words_ids", _bad_words(self.bad_words_ids))
        check(**self.settings())
        for k in ("temperature", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty"):
            if getattr(self, k) is not None:
                object.__setattr__(self, k, float(getattr(self, k)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def settings(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_json(self) -> dict:
        """temperature, top_k and top_p always (the first format's keys), every other setting where set."""
        d = asdict(self)
        out = {k: d.pop(k) for k in ("temperature", "top_k", "top_p")}
        for k, v in d.items():
            if v is not None:
                out[k] = [list(w) for w in v] if k == "bad_words_ids" else list(v) if k == "suppress_tokens" else v
        return out

    @classmethod
    def from_json(cls, d: dict) -> Decoding:
        """The settings ``to_json`` wrote; InspectorError for a key or value this version does not know."""
        if not isinstance(d, dict):
            raise InspectorError(f"decoding settings must be an object, got {d!r:.40}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise InspectorError(f"unknown decoding setting {unknown[0]!r}")
        return cls(**{k: v for k, v in d.items() if k in names})

    def replace(self, **changes) -> Decoding:
        return Decoding.from_json({**self.settings(), **changes})

    def generate_kwargs(self) -> dict:
        """``generate``'s keyword arguments for exactly these settings (off spelled out, so its
        global fallbacks do not apply); the model's shipped defaults apply in both alike."""
        kw: dict = {"do_sample": not self.greedy}
        if not self.greedy:
            kw.update(temperature=self.temperature, top_k=self.top_k or 0, top_p=self.top_p or 1.0)
            for k in WARPERS[3:]:
                if getattr(self, k) is not None:
                    kw[k] = getattr(self, k)
        for k in PROCESSORS:
            v = getattr(self, k)
            if v is not None:
                kw[k] = [list(w) for w in v] if k == "bad_words_ids" else list(v) if k == "suppress_tokens" else v
        if self.max_new_tokens is not None:
            kw["max_new_tokens"] = self.max_new_tokens
        return kw


def _id_tuple(v, what: str) -> tuple[int, ...]:
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
        raise InspectorError(f"{what} must be a list of token ids, got {v!r:.40}")
    out = tuple(v)
    for i in out:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise InspectorError(f"{what} must hold token ids (integers >= 0), got {i!r:.40}")
    return out


def _bad_words(v) -> tuple[tuple[int, ...], ...]:
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
        raise InspectorError(f"bad_words_ids must be a list of token-id lists, got {v!r:.40}")
    out = tuple(_id_tuple(w, "bad_words_ids") for w in v)
    if not out or any(not w for w in out):
        raise InspectorError("bad_words_ids must hold at least one non-empty list of token ids")
    return out


def _number(v, what: str) -> float:
    if isinstance(v, bool):
        raise InspectorError(f"{what} must be a number, got {v!r}")
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise InspectorError(f"{what} must be a number, got {v!r:.40}") from None
    if math.isnan(x) or math.isinf(x):
        raise InspectorError(f"{what} must be a finite number, got {v!r}")
    return x


def _int(v, what: str, low: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise InspectorError(f"{what} must be an integer >= {low}, got {v!r:.40}")


# (low, high, low included, high included) of each probability-like setting, as its processor accepts it
_RANGES = {
    "top_p": (0.0, 1.0, False, True), "min_p": (0.0, 1.0, True, True), "typical_p": (0.0, 1.0, False, True),
    "epsilon_cutoff": (0.0, 1.0, True, False), "eta_cutoff": (0.0, 1.0, True, False),
}  # fmt: skip


# logits / temperature overflows float32 (inf, then NaN probabilities) for temperatures near float32's
# smallest normal; below this floor a temperature is indistinguishable from greedy anyway
MIN_TEMPERATURE = 1e-30


def check(temperature=0.0, top_k=None, top_p=None, **rest) -> None:
    """InspectorError naming the first setting out of range (before any model load)."""
    t = _number(temperature, "temperature")
    if t < 0:
        raise InspectorError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if 0 < t < MIN_TEMPERATURE:
        raise InspectorError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature!r}")
    if top_k is not None:
        _int(top_k, "top_k", 1)
    for name, v in (
        ("top_p", top_p),
        *((k, rest.get(k)) for k in ("min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")),
    ):
        if v is None:
            continue
        x, (lo, hi, lo_in, hi_in) = _number(v, name), _RANGES[name]
        if not ((lo <= x if lo_in else lo < x) and (x <= hi if hi_in else x < hi)):
            raise InspectorError(
                f"{name} must be in {'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}, got {v!r}"
            )
    rp = rest.get("repetition_penalty")
    if rp is not None and _number(rp, "repetition_penalty") <= 0:
        raise InspectorError(f"repetition_penalty must be > 0 (1 = off), got {rp!r}")
    for name, low in (("no_repeat_ngram_size", 0), ("min_new_tokens", 0), ("forced_eos_token_id", 0),
                      ("max_new_tokens", 1)):  # fmt: skip
        if rest.get(name) is not None:
            _int(rest[name], name, low)
    if rest.get("suppress_tokens") is not None:
        _id_tuple(rest["suppress_tokens"], "suppress_tokens")
    if rest.get("bad_words_ids") is not None:
        _bad_words(rest["bad_words_ids"])


def validate(temperature, top_k, top_p) -> None:
    """The first three settings' checks (the first API's name)."""
    check(temperature, top_k, top_p)


@dataclass(frozen=True)
class StageScores:
    """The scores after one stage: ``key`` the setting ("" for the raw logits), ``origin`` yours or the model's."""

    key: str
    label: str
    origin: str
    scores: torch.Tensor  # (V,) float32, -inf where removed


def describe(key: str, value) -> str:
    """A stage's short label: the setting's name as generate spells it, and its value."""
    if isinstance(value, (list, tuple)) and len(value) > 4:
        value = f"{len(value)} entries"
    elif isinstance(value, float):
        value = f"{value:g}"
    return f"{key.replace('_', ' ')} {value}"


class Sampler:
    """``generate``'s processors for one set of settings, one prompt length and one model's defaults.

    ``shipped``: the model's generation-config values (``hf.generation_defaults``); the user's settings
    override them. ``settings`` is what ``generate`` is effectively given; ``origins`` says, per
    setting, whether it is yours or the model's default.
    """

    def __init__(self, dec: Decoding, shipped: dict | None = None, eos_token_ids=(), prompt_length: int = 0,
                 max_length: int | None = None):  # fmt: skip
        self.decoding = dec
        # only the fields that make processors: a trace's record is input from outside
        self.shipped = {k: v for k, v in (shipped or {}).items() if k in hf.SHIPPED_FIELDS}
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.prompt_length = int(prompt_length)
        if dec.max_new_tokens is not None:
            max_length = self.prompt_length + dec.max_new_tokens
        self.max_length = int(max_length if max_length is not None else 1 << 30)
        self.settings, self.origins = self._resolve()
        try:
            self.processors = hf.logits_processor_list(self.settings, self.eos_token_ids, self.prompt_length,
                                                       self.max_length)  # fmt: skip
        except ValueError as e:  # a value only the processor can judge (an id list it cannot use)
            raise InspectorError(f"transformers refused the decoding settings: {str(e).splitlines()[0]}") from None

    def _resolve(self) -> tuple[dict, dict]:
        dec = self.decoding
        out: dict[str, Any] = {"do_sample": not dec.greedy}
        origins: dict[str, str] = {}
        mine = {k: v for k, v in dec.settings().items() if v is not None and k != "max_new_tokens"}
        for k, v in self.shipped.items():
            if k in WARPERS and dec.greedy:
                continue  # generate applies no warper when not sampling
            if k not in mine:
                out[k], origins[k] = v, MODEL_DEFAULT
        for k, v in mine.items():
            if k in WARPERS and dec.greedy:
                continue
            out[k] = [list(w) for w in v] if k == "bad_words_ids" else list(v) if k == "suppress_tokens" else v
            origins[k] = YOURS
        return out, origins

    def stages(self, logits: torch.Tensor, context: Sequence[int]) -> list[StageScores]:
        """Raw logits, then the scores after each processor in generate's order. logits: (V,)."""
        ids = torch.tensor([list(context)], dtype=torch.long)  # (1, t): the sequence so far, as generate's input_ids
        scores = logits.float()[None]  # (1, V): the processors take a batch
        out = [StageScores("", "raw logits", "", scores[0])]
        for p in self.processors:
            # a fresh tensor per stage: some processors write into the scores they are given
            scores = p(ids, scores.clone())
            key = SETTING_OF.get(type(p).__name__, type(p).__name__)
            value = self.settings.get(key)
            label = describe(key, value) if value is not None else type(p).__name__
            out.append(StageScores(key, label, self.origins.get(key, MODEL_DEFAULT), scores[0]))
        return out

    def scores(self, logits: torch.Tensor, context: Sequence[int]) -> torch.Tensor:
        return self.stages(logits, context)[-1].scores

    def distribution(self, logits: torch.Tensor, context: Sequence[int]) -> torch.Tensor:
        """Probabilities (V,) float32 after every processor (greedy: the processors, at temperature 1)."""
        return torch.softmax(self.scores(logits, context), dim=-1)

    def choose_from(self, scores: torch.Tensor, generator: torch.Generator | None) -> int:
        """generate's choice from the final scores (V,): argmax, or one multinomial draw on (1, V)."""
        if self.decoding.greedy:
            return int(torch.argmax(scores))
        probs = torch.softmax(scores[None], dim=-1)  # (1, V), as generate's _sample
        return int(torch.multinomial(probs, num_samples=1, generator=generator)[0, 0])

    def choose(self, logits: torch.Tensor, context: Sequence[int], generator: torch.Generator | None) -> int:
        return self.choose_from(self.scores(logits, context), generator)


def warp(logits: torch.Tensor, dec: Decoding, context: Sequence[int] = ()) -> torch.Tensor:
    """Final scores (V,) (-inf for removed tokens) under ``dec`` alone, no model defaults."""
    return Sampler(dec, prompt_length=len(context)).scores(logits, context)


def distribution(logits: torch.Tensor, dec: Decoding, context: Sequence[int] = ()) -> torch.Tensor:
    return torch.softmax(warp(logits, dec, context), dim=-1)


def choose(logits: torch.Tensor, dec: Decoding, generator: torch.Generator | None, context: Sequence[int] = ()) -> int:
    return Sampler(dec, prompt_length=len(context)).choose(logits, context, generator)


def entropy(probs: torch.Tensor) -> float:
    """Shannon entropy in nats (entr(0) = 0, so filtered tokens count for nothing)."""
    return float(torch.special.entr(probs).sum())
