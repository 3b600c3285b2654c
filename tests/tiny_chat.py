"""A tiny checkpoint whose tokenizer has a chat template (Jinja, ChatML-like, with the tokenizer's own
special token as the turn marker), made from a tiny_models folder."""

from __future__ import annotations

import shutil
from pathlib import Path

TEMPLATE = (
    "{% for m in messages %}<|endoftext|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}"
)  # the tiny models' context is 64 tokens: short markup, short turns

MESSAGES = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "She eats"},
    {"role": "assistant", "content": "an apple."},
    {"role": "user", "content": "One two"},
]


def with_template(src: Path, dst: Path) -> Path:
    from transformers import AutoTokenizer

    shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(dst)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(dst)
    return dst
