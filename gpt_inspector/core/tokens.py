"""Readable labels for tokens, byte-level pieces and partial UTF-8 included."""

from __future__ import annotations

import codecs
from functools import lru_cache

_HEX_BYTES = "gpt_inspector_hex_bytes"


def _hex_bytes(e: UnicodeError) -> tuple[str, int]:
    assert isinstance(e, UnicodeDecodeError)  # registered for decoding only
    return "".join(f"<0x{b:02X}>" for b in e.object[e.start : e.end]), e.end


codecs.register_error(_HEX_BYTES, _hex_bytes)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # GPT-2's byte-level BPE maps every byte to a printable character; invert that table
    from .hf import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def token_label(tokenizer, token_id: int) -> str:
    """What to print for one token: spaces as '␣', newlines as '↵', broken UTF-8 as <0xNN>."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    dec = _byte_decoder()
    if piece is None or token_id in getattr(tokenizer, "all_special_ids", ()) or not all(ch in dec for ch in piece):
        # not a byte-level BPE token (another tokenizer, a special token): its decoded text
        text = tokenizer.decode([int(token_id)])
        if (piece or "").startswith("▁"):  # sentencepiece word start
            text = " " + text.lstrip(" ")
    else:  # the token's raw bytes, every byte no valid UTF-8 sequence covers as <0xNN>
        text = bytes(dec[ch] for ch in piece).decode("utf-8", _HEX_BYTES)
    return text.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍") or "∅"
