"""Readable labels for tokens, byte-level pieces and partial UTF-8 included."""

from __future__ import annotations

import codecs
from functools import lru_cache

_HEX_BYTES = "gpt_inspector_hex_bytes"
codecs.register_error(_HEX_BYTES, lambda e: ("".join(f"<0x{b:02X}>" for b in e.object[e.start : e.end]), e.end))


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # GPT-2's byte-level BPE maps every byte to a printable character; invert that table
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(tokenizer, token_id: int) -> bytes | None:
    """The raw bytes of a byte-level BPE token, or None for other tokenizers and special tokens."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if piece is None or token_id in getattr(tokenizer, "all_special_ids", ()):
        return None
    dec = _byte_decoder()
    if not all(ch in dec for ch in piece):
        return None
    return bytes(dec[ch] for ch in piece)


def token_label(tokenizer, token_id: int) -> str:
    """What to print for one token: spaces as '␣', newlines as '↵', broken UTF-8 as <0xNN>."""
    raw = token_bytes(tokenizer, token_id)
    if raw is None:
        text = tokenizer.decode([int(token_id)])
        piece = tokenizer.convert_ids_to_tokens(int(token_id)) or ""
        if piece.startswith("▁"):  # sentencepiece word start
            text = " " + text.lstrip(" ")
    else:
        text = raw.decode("utf-8", _HEX_BYTES)  # every byte no valid UTF-8 sequence covers as <0xNN>
    return text.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍") or "∅"
