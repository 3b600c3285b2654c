"""Train the small GPT-2 that ships in resources/demo-gpt2.

The app must start offline on a model whose attention shows something (a random
model attends uniformly), so this script needs nothing outside the repository:
the corpus comes from a tiny grammar of everyday English, plus samples that repeat
a segment twice, which is what makes an induction head worth learning.

A 1M-parameter model does not find the induction circuit on its own within a CPU
budget of minutes, so the first part of training adds a loss on two heads'
attention (see ``head_supervision_loss``); the rest is plain language modelling.

    python scripts/train_demo_model.py                     # ~7 min on 2 CPU cores
    python scripts/train_demo_model.py --steps 200 --out /tmp/demo   # quick try
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    # run as `python scripts/...`, sys.path[0] is scripts/, not the repo
    sys.path.insert(0, str(REPO))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

EOT = "<|endoftext|>"
TRAIN_SEED = 1234
# Held-out text and the head-score probes use seeds the training corpus never sees.
HELDOUT_SEED = 987_654
INDUCTION_SEED = 4242
INDUCTION_HALF_LEN = 30
INDUCTION_ROWS = 8
DEMO_PROMPT = "She eats apple"
# The heads the warm-up supervises, (layer, head); the card reports the best heads as measured.
PREV_HEAD = (0, 0)
INDUCTION_HEAD = (1, 0)

# --------------------------------------------------------------------------- lexicon

NUMBERS = [
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
COLOURS = ["red", "blue", "green", "yellow", "white", "black", "brown", "orange", "pink", "grey"]

# (text, possessive, person): person picks the verb form; "3" = third person singular
PRONOUNS = [("She", "her", "3"), ("He", "his", "3"), ("They", "their", "p"), ("I", "my", "1"), ("We", "our", "p")]
WOMEN = ["Anna", "Maria", "Lucy", "Emma", "Sara", "Lily", "Grace", "Nora", "Mia", "Julia", "Kate", "Rosa"]
MEN = ["Tom", "Ben", "Sam", "Jack", "Leo", "Max", "Peter", "David", "Paul", "Noah", "Oscar", "Hugo"]
PEOPLE_NP = [
    ("The old man", "his", "3"),
    ("The little girl", "her", "3"),
    ("My mother", "her", "3"),
    ("My father", "his", "3"),
    ("The teacher", "her", "3"),
    ("The baker", "his", "3"),
    ("My sister", "her", "3"),
    ("My brother", "his", "3"),
    ("The children", "their", "p"),
    ("My friends", "their", "p"),
    ("Our neighbours", "their", "p"),
    ("The boys", "their", "p"),
    ("The girls", "their", "p"),
    ("Grandma", "her", "3"),
    ("Grandpa", "his", "3"),
]
RELATIVES = [
    "friend",
    "friend",
    "friend",
    "friends",
    "mother",
    "father",
    "sister",
    "brother",
    "family",
    "grandmother",
    "grandfather",
    "teacher",
    "children",
    "dog",
    "neighbour",
    "cousin",
    "aunt",
    "uncle",
]

FOODS = [
    "an apple",
    "apple pie",
    "a banana",
    "bread",
    "soup",
    "rice",
    "pasta",
    "a sandwich",
    "cheese",
    "eggs",
    "fish",
    "chicken",
    "salad",
    "cake",
    "an orange",
    "cherries",
    "pizza",
    "toast",
    "porridge",
    "noodles",
    "cookies",
    "grapes",
    "carrots",
    "potatoes",
    "a pear",
    "strawberries",
    "beans",
    "yogurt",
]
DRINKS = ["tea", "coffee", "milk", "water", "orange juice", "apple juice", "lemonade", "hot chocolate", "green tea"]
DISHES = ["dinner", "lunch", "breakfast", "soup", "pasta", "rice", "fish", "chicken", "a stew", "pancakes", "eggs"]
BAKES = ["bread", "a cake", "apple pie", "cookies", "muffins", "a lemon cake", "buns"]
READABLES = [
    "a book",
    "the newspaper",
    "a letter",
    "a story",
    "a magazine",
    "a poem",
    "the map",
    "the menu",
    "an old book",
    "a comic",
    "the news",
    "a long novel",
    "the recipe",
]
WRITABLES = ["a letter", "a note", "a story", "an email", "a poem", "a postcard", "a list"]
PLACES = [
    "the park",
    "the shop",
    "the market",
    "school",
    "work",
    "the library",
    "the beach",
    "the station",
    "the river",
    "the garden",
    "the cafe",
    "the zoo",
    "the bakery",
    "the office",
    "the lake",
    "the city",
    "the farm",
    "the hill",
    "the museum",
    "the bus stop",
]
WHERE = [
    "in the kitchen",
    "in the garden",
    "in the park",
    "at home",
    "at school",
    "in bed",
    "on the bus",
    "at the table",
    "in the library",
    "by the window",
    "on the sofa",
    "at the cafe",
    "under a tree",
]
THINGS_SEEN = [
    "a bird",
    "a cat",
    "a dog",
    "the sea",
    "a big tree",
    "a red car",
    "a small boat",
    "the moon",
    "a rainbow",
    "a horse",
    "the mountains",
    "a yellow bus",
    "the stars",
    "a duck",
]
WATCHABLES = ["a film", "the birds", "the rain", "the news", "the children", "the sunset", "a game", "the clouds"]
GAMES = ["football", "chess", "the piano", "cards", "tennis", "the guitar", "a game", "hide and seek"]
OPENABLES = ["the window", "the door", "a box", "the shop", "a letter", "the gate", "a present", "the fridge"]
WASHABLES = ["the dishes", "the car", "the floor", "the windows", "the clothes", "the cups"]
ADJECTIVES = [
    "happy",
    "tired",
    "hungry",
    "busy",
    "sleepy",
    "ready",
    "late",
    "early",
    "cold",
    "warm",
    "sad",
    "glad",
    "thirsty",
    "kind",
]
LIKES = [
    "apples",
    "books",
    "dogs",
    "cats",
    "music",
    "tea",
    "coffee",
    "flowers",
    "the rain",
    "long walks",
    "apple pie",
    "bread",
    "cheese",
    "soup",
    "football",
    "chess",
    "summer",
    "winter",
    "the sea",
    "stories",
]
SHOPPING = [
    "milk",
    "bread",
    "eggs",
    "butter",
    "cheese",
    "apples",
    "tea",
    "rice",
    "sugar",
    "flour",
    "salt",
    "oranges",
    "bananas",
    "jam",
    "honey",
    "coffee",
    "pasta",
    "tomatoes",
    "onions",
    "carrots",
    "fish",
]
ANIMALS = ["cats", "dogs", "birds", "apples", "books", "cups", "chairs", "eggs", "pens", "boxes", "cows", "ducks"]
TIME_PRESENT = [
    "every day",
    "every morning",
    "every evening",
    "in the morning",
    "in the evening",
    "at night",
    "after school",
    "after work",
    "before dinner",
    "at noon",
    "today",
    "every week",
    "on weekends",
    "on Monday",
    "on Sunday",
    "on Friday",
    "now",
]
TIME_PAST = [
    "yesterday",
    "last night",
    "last week",
    "this morning",
    "on Monday",
    "on Sunday",
    "on Saturday",
    "in the morning",
    "after school",
    "after work",
    "two days ago",
    "last summer",
    "in the evening",
]

# base, third person singular, past
VERBS = {
    "eat": ("eat", "eats", "ate"),
    "drink": ("drink", "drinks", "drank"),
    "read": ("read", "reads", "read"),
    "walk": ("walk", "walks", "walked"),
    "cook": ("cook", "cooks", "cooked"),
    "bake": ("bake", "bakes", "baked"),
    "go": ("go", "goes", "went"),
    "like": ("like", "likes", "liked"),
    "buy": ("buy", "buys", "bought"),
    "see": ("see", "sees", "saw"),
    "watch": ("watch", "watches", "watched"),
    "play": ("play", "plays", "played"),
    "write": ("write", "writes", "wrote"),
    "open": ("open", "opens", "opened"),
    "wash": ("wash", "washes", "washed"),
    "help": ("help", "helps", "helped"),
    "sleep": ("sleep", "sleeps", "slept"),
    "visit": ("visit", "visits", "visited"),
    "make": ("make", "makes", "made"),
    "count": ("count", "counts", "counted"),
    "need": ("need", "needs", "needed"),
    "have": ("have", "has", "had"),
    "sing": ("sing", "sings", "sang"),
    "run": ("run", "runs", "ran"),
    "sit": ("sit", "sits", "sat"),
    "love": ("love", "loves", "loved"),
    "find": ("find", "finds", "found"),
}
BE = {"1": ("am", "was"), "3": ("is", "was"), "p": ("are", "were")}

# Every example the brief names must be in the corpus verbatim, often enough that a
# greedy continuation of "She eats apple" follows it.
ANCHORS = [
    "She eats apple pie with her friend.",
    "He eats an apple every day.",
    "She eats apple pie with her friend.",
    "They eat apple pie after dinner.",
    "I read a book every evening.",
    "We walk to the park on Sunday.",
    "He cooks soup for his family.",
]


class Grammar:
    """Random everyday sentences; all randomness goes through one seeded ``random.Random``."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)

    # ---- small helpers
    def pick(self, seq):
        return self.r.choice(seq)

    def subject(self) -> tuple[str, str, str]:
        x = self.r.random()
        if x < 0.5:
            return self.pick(PRONOUNS)
        if x < 0.7:
            return self.pick(WOMEN), "her", "3"
        if x < 0.85:
            return self.pick(MEN), "his", "3"
        return self.pick(PEOPLE_NP)

    @staticmethod
    def verb(name: str, person: str, past: bool) -> str:
        base, third, past_form = VERBS[name]
        if past:
            return past_form
        return third if person == "3" else base

    def time(self, past: bool) -> str:
        return self.pick(TIME_PAST if past else TIME_PRESENT)

    def extra(self, poss: str, past: bool, where: bool = True) -> str:
        x = self.r.random()
        if x < 0.35:
            return " with " + poss + " " + self.pick(RELATIVES)
        if x < 0.65:
            return " " + self.time(past)
        if x < 0.85 and where:
            return " " + self.pick(WHERE)
        return ""

    # ---- sentences
    def sentence(self) -> str:
        if self.r.random() < 0.04:
            return self.pick(ANCHORS)
        subj, poss, person = self.subject()
        past = self.r.random() < 0.4
        v = lambda name: self.verb(name, person, past)
        kind = self.r.randrange(17)
        if kind in (0, 1):
            body = f"{v('eat')} {self.pick(FOODS)}{self.extra(poss, past)}"
        elif kind == 2:
            body = f"{v('drink')} {self.pick(DRINKS)}{self.extra(poss, past)}"
        elif kind == 3:
            body = f"{v('read')} {self.pick(READABLES)}{self.extra(poss, past)}"
        elif kind == 4:
            if self.r.random() < 0.7:
                body = f"{v('walk')} to {self.pick(PLACES)}{self.extra(poss, past, where=False)}"
            else:
                body = f"{v('walk')} {poss} dog {self.time(past)}"
        elif kind == 5:
            body = f"{v('cook')} {self.pick(DISHES)} for {poss} {self.pick(RELATIVES)}"
        elif kind == 6:
            body = f"{v('bake')} {self.pick(BAKES)}{self.extra(poss, past)}"
        elif kind == 7:
            body = f"{v('go')} to {self.pick(PLACES)} {self.time(past)}"
        elif kind == 8:
            body = f"{v('like')} {self.pick(LIKES)}"
        elif kind == 9:
            body = f"{v('buy')} {self.shopping_list()} at the market"
        elif kind == 10:
            be = BE[person][1 if past else 0]
            body = f"{be} {self.pick(ADJECTIVES)}{self.extra(poss, past, where=False)}"
        elif kind == 11:
            body = f"{v('play')} {self.pick(GAMES)}{self.extra(poss, past)}"
        elif kind == 12:
            body = f"{v('write')} {self.pick(WRITABLES)} to {poss} {self.pick(RELATIVES)}"
        elif kind == 13:
            body = f"{v('see')} {self.pick(THINGS_SEEN)}{self.extra(poss, past)}"
        elif kind == 14:
            body = f"{v('watch')} {self.pick(WATCHABLES)}{self.extra(poss, past)}"
        elif kind == 15:
            body = f"{v('help')} {poss} {self.pick(RELATIVES)} {self.pick(WHERE)}"
        else:
            x = self.r.random()
            if x < 0.35:
                body = f"{v('open')} {self.pick(OPENABLES)}"
            elif x < 0.7:
                body = f"{v('wash')} {self.pick(WASHABLES)}{self.extra(poss, past, where=False)}"
            else:
                body = f"{v('visit')} {poss} {self.pick(RELATIVES)} {self.time(past)}"
        return f"{subj} {body}."

    def shopping_list(self, k: int | None = None) -> str:
        k = k or self.r.randint(2, 5)
        items = self.r.sample(SHOPPING, k)
        return ", ".join(items[:-1]) + " and " + items[-1]

    # ---- documents
    def story(self) -> str:
        return " ".join(self.sentence() for _ in range(self.r.randint(2, 7)))

    def counting(self) -> str:
        kind = self.r.randrange(5)
        if kind == 0:
            start = self.r.randrange(0, 6)
            words = NUMBERS[start : start + self.r.randint(4, 14)]
            return (" ".join(words) + ".").capitalize()
        if kind == 1:
            n = self.r.randint(3, 20)
            who = self.pick(WOMEN + MEN)
            return f"{who} counts to {NUMBERS[n - 1]}: " + ", ".join(NUMBERS[:n]) + "."
        if kind == 2:
            n = self.r.randint(3, 10)
            return "Let us count: " + ", ".join(NUMBERS[:n]) + ". " + self.sentence()
        if kind == 3:
            n = self.r.randint(3, 10)
            return (", ".join(reversed(NUMBERS[:n])) + ". Go!").capitalize()
        a, b = self.r.randint(1, 9), self.r.randint(1, 9)
        thing = self.pick(ANIMALS)
        return (
            f"I have {NUMBERS[a - 1]} {thing}. You have {NUMBERS[b - 1]} {thing}. "
            f"Together we have {NUMBERS[a + b - 1]} {thing}."
        )

    def listing(self) -> str:
        kind = self.r.randrange(5)
        if kind == 0:
            return f"The shopping list: {self.shopping_list(self.r.randint(3, 7))}."
        if kind == 1:
            return f"For the picnic we need {self.shopping_list()}. {self.sentence()}"
        if kind == 2:
            start = self.r.randrange(7)
            n = self.r.randint(3, 7)
            return "The days are " + ", ".join(DAYS[(start + i) % 7] for i in range(n)) + "."
        if kind == 3:
            cs = self.r.sample(COLOURS, self.r.randint(2, 5))
            return f"My favourite colours are {', '.join(cs[:-1])} and {cs[-1]}."
        subj, _, person = self.subject()
        return f"{subj} {self.verb('need', person, False)} {self.shopping_list()}. {self.sentence()}"

    def question(self) -> str:
        food = self.pick(LIKES)
        if self.r.random() < 0.5:
            who, _, _ = self.pick(PRONOUNS[:2])
            yes = self.r.random() < 0.6
            return f"Does {who.lower()} like {food}? " + (
                f"Yes, {who.lower()} does." if yes else f"No, {who.lower()} does not."
            )
        return f"Do you like {food}? " + ("Yes, I do." if self.r.random() < 0.6 else "No, I do not.")

    def repeated_sentences(self) -> str:
        part = " ".join(self.sentence() for _ in range(self.r.randint(1, 4)))
        return part + " " + part

    def repeated_words(self) -> str:
        words = self.r.sample(WORD_LIST, self.r.randint(6, 30))
        part = " ".join(words)
        return part + ". " + part + "."

    def document(self) -> str:
        x = self.r.random()
        if x < 0.55:
            return self.story()
        if x < 0.65:
            return self.counting()
        if x < 0.73:
            return self.listing()
        if x < 0.78:
            return self.question()
        if x < 0.90:
            return self.repeated_sentences()
        return self.repeated_words()


def _words_of(*groups) -> set[str]:
    out: set[str] = set()
    for g in groups:
        for item in g:
            text = item[0] if isinstance(item, tuple) else item
            out.update(w.strip(".,:!?").lower() for w in text.split())
    return out


WORD_LIST = sorted(
    _words_of(
        NUMBERS,
        DAYS,
        COLOURS,
        PRONOUNS,
        WOMEN,
        MEN,
        PEOPLE_NP,
        RELATIVES,
        FOODS,
        DRINKS,
        DISHES,
        BAKES,
        READABLES,
        WRITABLES,
        PLACES,
        WHERE,
        THINGS_SEEN,
        WATCHABLES,
        GAMES,
        OPENABLES,
        WASHABLES,
        ADJECTIVES,
        LIKES,
        SHOPPING,
        ANIMALS,
        TIME_PRESENT,
        TIME_PAST,
        [f for v in VERBS.values() for f in v],
        [f for v in BE.values() for f in v],
    )
    - {""}
)


def grammar_vocabulary() -> set[str]:
    """Every lower-cased word the grammar can produce (the tests check generated text against it)."""
    fixed = _words_of(ANCHORS) | {
        "with",
        "to",
        "for",
        "at",
        "the",
        "a",
        "an",
        "and",
        "his",
        "her",
        "their",
        "my",
        "our",
        "dog",
        "market",
        "counts",
        "let",
        "us",
        "count",
        "go",
        "i",
        "have",
        "you",
        "together",
        "we",
        "list",
        "picnic",
        "need",
        "days",
        "are",
        "favourite",
        "colours",
        "shopping",
        "does",
        "do",
        "like",
        "yes",
        "no",
        "not",
        "is",
    }
    return set(WORD_LIST) | fixed


def generate_documents(n: int, seed: int) -> list[str]:
    g = Grammar(seed)
    return [g.document() for _ in range(n)]


def heldout_text(seed: int = HELDOUT_SEED, n_sentences: int = 24) -> str:
    """Plain running text (no repeats) from a seed that training never used."""
    g = Grammar(seed)
    return " ".join(g.sentence() for _ in range(n_sentences))


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    # GPT-2's own pipeline: spaces become the "Ġ" prefix and decoding is byte-exact.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, out: Path):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        unk_token=EOT,
        pad_token=EOT,
        model_max_length=256,
    )
    hf.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["add_prefix_space"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return hf


# --------------------------------------------------------------------------- data


class Stream:
    """All documents' ids back to back, each followed by EOT; rows start at a document start
    so the model sees prompts at position 0 without a BOS, as the app feeds them."""

    def __init__(self, docs_ids: list[list[int]], eot: int) -> None:
        starts, flat = [], []
        for ids in docs_ids:
            starts.append(len(flat))
            flat.extend(ids)
            flat.append(eot)
        self.ids = torch.tensor(flat, dtype=torch.long)
        self.starts = np.asarray(starts, dtype=np.int64)

    def batch(self, rng: np.random.Generator, batch_size: int, seq_len: int) -> torch.Tensor:
        ok = self.starts[self.starts + seq_len <= len(self.ids)]
        picks = rng.choice(ok, size=batch_size)
        return torch.stack([self.ids[s : s + seq_len] for s in picks])


def random_repeat_docs(rng: np.random.Generator, n: int, vocab_size: int, eot: int) -> list[list[int]]:
    """Random ids, repeated: nothing but an induction head can predict the second half, and
    drawing from the whole vocabulary trains it for every token, not just common words."""
    docs = []
    for _ in range(n):
        half = rng.integers(0, vocab_size - 1, size=int(rng.integers(8, 60)))
        half[half >= eot] += 1  # skip EOT without biasing the rest
        docs.append(np.concatenate([half, half]).tolist())
    return docs


def induction_targets(x: torch.Tensor) -> torch.Tensor:
    """For each position i, the key an induction head should read: j + 1 for the latest j < i - 1
    where the bigram (x[j-1], x[j]) equals (x[i-1], x[i]); -1 where the bigram is new.

    Matching the bigram, not just the token, keeps the targets to genuinely repeated segments
    (repeated sentences, word lists, random ids) instead of every earlier "the" or ".".
    """
    rows = x.tolist()
    out = torch.full(x.shape, -1, dtype=torch.long)
    for b, row in enumerate(rows):
        last: dict[tuple[int, int], int] = {}
        for i in range(1, len(row)):
            key = (row[i - 1], row[i])
            j = last.get(key)
            if j is not None and j + 1 < i:
                out[b, i] = j + 1
            last[key] = i
    return out


def head_supervision_loss(attentions, x: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of two chosen heads' attention against the previous-token and induction
    targets (see ``--supervise-steps``)."""
    (pl, ph), (il, ih) = PREV_HEAD, INDUCTION_HEAD
    prev = torch.diagonal(attentions[pl][:, ph], offset=-1, dim1=-2, dim2=-1)
    loss = -(prev + 1e-6).log().mean()
    tgt = induction_targets(x)
    b, i = (tgt >= 0).nonzero(as_tuple=True)
    if len(b):
        loss = loss - (attentions[il][:, ih][b, i, tgt[b, i]] + 1e-6).log().mean()
    return loss


# --------------------------------------------------------------------------- evaluation


def measure_heads(model, tokenizer) -> dict:
    """The numbers the model card reports; tests/core/test_demo_model.py runs the same probes."""
    from gpt_inspector.core.head_scores import (
        best_head,
        induction_score,
        previous_token_score,
        repeated_random_tokens,
        stack_attentions,
    )

    model.eval()
    with torch.no_grad():
        ids = tokenizer(heldout_text(), return_tensors="pt")["input_ids"]
        attn = stack_attentions(model(ids, output_attentions=True).attentions)
        prev = previous_token_score(attn)
        rep = repeated_random_tokens(
            len(tokenizer),
            INDUCTION_HALF_LEN,
            n=INDUCTION_ROWS,
            seed=INDUCTION_SEED,
            exclude=[tokenizer.eos_token_id],
        )
        out = model(rep, output_attentions=True)
        ind = induction_score(stack_attentions(out.attentions), INDUCTION_HALF_LEN)
        nll = -torch.log_softmax(out.logits[:, :-1], -1).gather(-1, rep[:, 1:, None])[..., 0]
        h = INDUCTION_HALF_LEN
        copy_loss = (nll[:, : h - 1].mean().item(), nll[:, h:].mean().item())
    return {
        "copy_loss": copy_loss,
        "previous_token": prev,
        "induction": ind,
        "best_previous_token": best_head(prev),
        "best_induction": best_head(ind),
    }


def demo_generations(model, tokenizer) -> dict:
    model.eval()
    enc = tokenizer(DEMO_PROMPT, return_tensors="pt")
    n = enc["input_ids"].shape[1]
    with torch.no_grad():
        greedy = model.generate(**enc, do_sample=False, max_new_tokens=12, pad_token_id=tokenizer.eos_token_id)
        beams = model.generate(
            **enc,
            do_sample=False,
            num_beams=2,
            num_return_sequences=2,
            max_new_tokens=8,
            pad_token_id=tokenizer.eos_token_id,
        )
    dec = lambda row: tokenizer.decode(row[n:], skip_special_tokens=True)
    return {"greedy": dec(greedy[0]), "beams": [dec(b) for b in beams]}


@torch.no_grad()
def evaluate_loss(model, rows: torch.Tensor, batch_size: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(rows), batch_size):
        x = rows[i : i + batch_size]
        total += model(input_ids=x, labels=x).loss.item() * len(x)
        count += len(x)
    model.train()
    return total / count


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "resources" / "demo-gpt2")
    p.add_argument("--steps", type=int, default=2400)
    p.add_argument("--seed", type=int, default=TRAIN_SEED)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument(
        "--supervise-steps",
        type=int,
        default=None,
        help="steps with the attention-supervision warm-up (default: 35%% of --steps; 0 = off)",
    )
    p.add_argument("--supervise-weight", type=float, default=1.0)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--docs", type=int, default=60_000)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.supervise_steps is None:
        args.supervise_steps = round(0.35 * args.steps)

    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    t_start = time.perf_counter()

    if args.seed == HELDOUT_SEED:
        raise SystemExit("--seed must differ from the held-out seed")
    train_docs = generate_documents(args.docs, args.seed)
    val_docs = generate_documents(2_000, args.seed + 1)
    tok = train_tokenizer(train_docs, args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in args.out.glob("*"):
        if stale.is_file() and stale.suffix in {".bin", ".pt", ".pth", ".pkl", ".safetensors", ".json"}:
            stale.unlink()
    save_tokenizer(tok, args.out)
    eot = tok.token_to_id(EOT)
    vocab_size = tok.get_vocab_size()
    print(f"corpus: {len(train_docs)} documents, tokenizer vocab {vocab_size}, EOT id {eot}", flush=True)

    def encode(docs):
        return [e.ids for e in tok.encode_batch(docs)]

    train_ids = encode(train_docs) + random_repeat_docs(rng, len(train_docs) // 10, vocab_size, eot)
    order = rng.permutation(len(train_ids))
    train = Stream([train_ids[i] for i in order], eot)
    val_rng = np.random.default_rng(args.seed + 1)
    val_text_ids = encode(val_docs)
    val = Stream(val_text_ids + random_repeat_docs(val_rng, 200, vocab_size, eot), eot)
    val_rows = val.batch(val_rng, 128, args.seq_len)
    # the mixture's loss is dominated by the unpredictable first halves of random ids
    val_text_rows = Stream(val_text_ids, eot).batch(val_rng, 128, args.seq_len)
    print(f"train tokens: {len(train.ids):,}  ({time.perf_counter() - t_start:.1f}s to build)", flush=True)

    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=256,
        n_embd=128,
        n_layer=4,
        n_head=4,
        n_inner=512,
        activation_function="gelu_new",
        # the corpus is large against 1.2M parameters and seen about once: no dropout needed
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        tie_word_embeddings=True,
    )
    # eager: the warm-up needs the attention weights (on CPU it is as fast as sdpa at this size)
    model = GPT2LMHeadModel._from_config(config, attn_implementation="eager")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
    )
    warmup = max(1, args.steps // 20)

    def lr_at(step):
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    t_train = time.perf_counter()
    running = running_aux = None
    val_loss = float("nan")
    for step in range(args.steps):
        # positions beyond --seq-len must not stay untrained: the app may run up to 256 tokens
        seq_len = 256 if step % 8 == 7 else args.seq_len
        bs = args.batch_size * args.seq_len // seq_len
        x = train.batch(rng, bs, seq_len)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        supervised = step < args.supervise_steps
        out = model(input_ids=x, labels=x, output_attentions=supervised)
        loss = out.loss
        if supervised:
            aux = head_supervision_loss(out.attentions, x)
            running_aux = aux.item() if running_aux is None else 0.95 * running_aux + 0.05 * aux.item()
            loss = loss + args.supervise_weight * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lm = out.loss.item()
        running = lm if running is None else 0.95 * running + 0.05 * lm
        if step % 100 == 0 or step == args.steps - 1:
            val_loss = evaluate_loss(model, val_rows, 32)
            aux_txt = f"  heads {running_aux:.3f}" if supervised else ""
            print(
                f"step {step:5d}  train {running:.3f}  val {val_loss:.3f}{aux_txt}  lr {lr_at(step):.2e}  "
                f"{time.perf_counter() - t_train:6.1f}s",
                flush=True,
            )
    train_seconds = time.perf_counter() - t_train

    model.eval()
    model.config.use_cache = True
    model.save_pretrained(args.out, safe_serialization=True)

    # Measure what ships: reload from disk with the attention weights exposed.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shipped = AutoModelForCausalLM.from_pretrained(args.out, attn_implementation="eager")
    shipped_tok = AutoTokenizer.from_pretrained(args.out)
    val_loss = evaluate_loss(shipped, val_rows, 32)
    val_text_loss = evaluate_loss(shipped, val_text_rows, 32)
    heads = measure_heads(shipped, shipped_tok)
    gens = demo_generations(shipped, shipped_tok)
    total_seconds = time.perf_counter() - t_start
    pl, ph, ps = heads["best_previous_token"]
    il, ih, iscore = heads["best_induction"]
    print(
        f"final val loss {val_loss:.3f} (grammar text only {val_text_loss:.3f}); "
        f"training {train_seconds:.0f}s, total {total_seconds:.0f}s"
    )
    print(
        f"random ids repeated: loss {heads['copy_loss'][0]:.2f} on the first copy, {heads['copy_loss'][1]:.2f} on the second"
    )
    print(f"best previous-token head {pl}.{ph}: {ps:.3f}")
    print(f"best induction head {il}.{ih}: {iscore:.3f}")
    print("previous-token scores:\n" + np.array2string(heads["previous_token"], precision=2))
    print("induction scores:\n" + np.array2string(heads["induction"], precision=2))
    print(f"greedy: {DEMO_PROMPT!r} -> {gens['greedy']!r}")
    print(f"beams:  {gens['beams']!r}")

    write_card(
        args.out,
        config=config,
        n_params=n_params,
        args=args,
        n_docs=len(train_docs),
        n_tokens=len(train.ids),
        vocab_size=vocab_size,
        train_seconds=train_seconds,
        total_seconds=total_seconds,
        val_loss=val_loss,
        val_text_loss=val_text_loss,
        heads=heads,
        gens=gens,
    )
    return 0


def _table(scores: np.ndarray) -> str:
    heads = scores.shape[1]
    lines = ["| layer | " + " | ".join(f"head {h}" for h in range(heads)) + " |"]
    lines.append("|---" * (heads + 1) + "|")
    for layer, row in enumerate(scores):
        lines.append(f"| {layer} | " + " | ".join(f"{v:.2f}" for v in row) + " |")
    return "\n".join(lines)


def write_card(
    out: Path,
    *,
    config,
    n_params,
    args,
    n_docs,
    n_tokens,
    vocab_size,
    train_seconds,
    total_seconds,
    val_loss,
    val_text_loss,
    heads,
    gens,
) -> None:
    pl, ph, ps = heads["best_previous_token"]
    il, ih, iscore = heads["best_induction"]
    size_mb = sum(f.stat().st_size for f in out.iterdir() if f.is_file()) / 1e6
    merges_note = (
        f"the merges the grammar needs (it runs out of pairs before the {args.vocab_size} requested)"
        if vocab_size < args.vocab_size
        else "the most frequent merges"
    )
    beams = "\n".join(f"  {i + 1}. `{DEMO_PROMPT}{b}`" for i, b in enumerate(gens["beams"]))
    card = f"""# demo-gpt2

A tiny GPT-2 (`transformers.GPT2LMHeadModel`) trained from scratch so that gpt-inspector
has a model that has *learned something* on a machine with no network: its attention
heads show a clear previous-token head and an induction head, and it writes fluent
sentences in the style of its corpus.  It knows nothing but that corpus.

Regenerate it with `python scripts/train_demo_model.py` (seeded; every number
below was written by that script, measured on the saved files).

## Corpus

Generated, not downloaded: a small English grammar (`scripts/train_demo_model.py`,
class `Grammar`) of everyday sentences: people eating, drinking, reading, walking,
cooking, baking, shopping, playing; present and simple past; subjects
She/He/They/I/We, first names and noun phrases ("My mother", "The children");
counting ("one two three ..."), count-downs and sums; shopping lists, days,
colours; yes/no questions.  Sentences such as "She eats apple pie with her friend."
and "He eats an apple every day." are in it verbatim.

About a quarter of the documents repeat a segment twice (a few sentences, or
random words of the grammar, or {n_docs // 10:,} extra documents of random token
ids drawn from the whole vocabulary) so that predicting the second copy rewards an
induction head.

- {n_docs:,} grammar documents (seed {args.seed}), {n_tokens:,} training tokens in all
- validation: 2,000 documents from seed {args.seed + 1} plus 200 random-repeat documents

## Tokenizer

Byte-level BPE trained with `tokenizers` on the corpus (GPT-2's pipeline: ByteLevel
pre-tokenizer, spaces become `Ġ`, ByteLevel decoder).  {vocab_size} tokens: the 256
byte symbols, {merges_note}, and `<|endoftext|>` (id {config.eos_token_id}), which is
the BOS, EOS, UNK and pad token.  No BOS is prepended when encoding, as with GPT-2.

## Model

| | |
|---|---|
| layers / heads / width | {config.n_layer} / {config.n_head} / {config.n_embd} (MLP {config.n_inner}) |
| context | {config.n_positions} positions |
| vocabulary | {vocab_size} |
| parameters | {n_params:,} (embeddings tied) |
| files | `config.json`, `generation_config.json`, `model.safetensors` (fp32), tokenizer; {size_mb:.1f} MB |

## Training

AdamW (lr {args.lr:g}, betas 0.9/0.98, weight decay 0.05 on matrices), {max(1, args.steps // 20)}
warm-up steps then cosine decay to 10 %, gradient clipping 1.0, {args.steps} steps of
{args.batch_size} x {args.seq_len} tokens (every eighth step {args.batch_size * args.seq_len // 256} x 256, so
every position is trained).  `torch.set_num_threads({args.threads})`, CPU.

**Head warm-up.**  Left alone, a model this small needs far more tokens than a few CPU
minutes give before its induction head appears (the loss on repeated random ids stayed
flat for thousands of steps in our trials).  So for the first {args.supervise_steps} steps an
auxiliary loss (weight {args.supervise_weight:g}) is added to the language-model loss: the
cross-entropy of head {PREV_HEAD[0]}.{PREV_HEAD[1]}'s attention against "the previous token"
and of head {INDUCTION_HEAD[0]}.{INDUCTION_HEAD[1]}'s attention against "the token after the
last earlier occurrence of the current bigram" (only where such a repeat exists).  The
remaining {args.steps - args.supervise_steps} steps use the plain language-model loss; the heads
stay because the model uses them (the scores below are measured after those steps).

- training time: **{train_seconds / 60:.1f} min** ({train_seconds:.0f} s; {total_seconds:.0f} s for the whole script)
- validation loss: **{val_loss:.3f}** nats/token on the validation mixture; **{val_text_loss:.3f}**
  (perplexity {math.exp(val_text_loss):.2f}) on its grammar documents alone (the mixture's random
  ids cannot be predicted the first time they appear: ln {vocab_size - 1} = {math.log(vocab_size - 1):.2f})
- in-context copying: on the random-id probe below, loss {heads["copy_loss"][0]:.2f} on the first copy,
  {heads["copy_loss"][1]:.2f} on the second

## Attention heads

Measured with `gpt_inspector.core.head_scores` (the same functions
`tests/core/test_demo_model.py` asserts on), eager attention, `layer.head` counted from 0.

- best **previous-token head: {pl}.{ph}, score {ps:.3f}**: mean attention from token i
  to token i-1 on held-out text (24 sentences from seed {HELDOUT_SEED}).
- best **induction head: {il}.{ih}, score {iscore:.3f}**: mean attention from each token
  of the second copy to the token after its first occurrence, on {INDUCTION_ROWS}
  sequences of {INDUCTION_HALF_LEN} distinct random ids repeated twice (seed {INDUCTION_SEED}).

Previous-token scores:

{_table(heads["previous_token"])}

Induction scores:

{_table(heads["induction"])}

## Generation

Prompt `{DEMO_PROMPT}`:

- greedy, 12 new tokens: `{DEMO_PROMPT}{gens["greedy"]}`
- 2-beam search, 8 new tokens, both beams:
{beams}
"""
    (out / "README.md").write_text(card)


if __name__ == "__main__":
    raise SystemExit(main())
