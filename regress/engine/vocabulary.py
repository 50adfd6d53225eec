"""A run's ``tokens.json``: the vocabulary a report needs to show tokens.

The file (format in :mod:`regress.runs`) holds every token id's text, and the raw bytes of the
ids whose text is only part of a character, so reports show tokens without loading a tokenizer.

Runs inside the candidate's environment: standard library only; the tokenizer is the engine's.
"""

from __future__ import annotations

import re
import sys
from typing import Any


def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-unicode table: the character a byte-level BPE vocabulary
    writes for each of the 256 bytes (printable Latin-1 bytes stand for themselves, the other 68
    are moved to U+0100 and up, in byte order) -> that byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in keep}
    moved = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + moved)] = b
            moved += 1
    return table


_BYTE_DECODER = _gpt2_byte_decoder()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(token: Any, text: str) -> bytes | None:
    """Raw bytes of a vocabulary entry (``convert_ids_to_tokens``) whose decoded ``text`` lost
    bytes to U+FFFD: a sentencepiece byte-fallback token ``<0xE5>``, or a byte-level BPE token
    mapped back through the GPT-2 table. None when the entry is neither (or does not decode to
    ``text``, spaces aside: a tokenizer that is not byte-level)."""
    if not isinstance(token, str) or not token:
        return None
    match = _BYTE_FALLBACK.fullmatch(token)
    if match:
        return bytes([int(match.group(1), 16)])
    try:
        raw = bytes(_BYTE_DECODER[c] for c in token)
    except KeyError:
        return None
    # decode() may have cleaned up spaces around punctuation, and decoders may differ in how many
    # U+FFFD one broken sequence becomes; anything else means another scheme
    if _loose(raw.decode("utf-8", "replace")) != _loose(text):
        return None
    return raw


def _loose(text: str) -> str:
    return re.sub("\ufffd+", "\ufffd", text.replace(" ", ""))


def vocabulary(tokenizer: Any) -> dict[str, Any]:
    """The content of a run's tokens.json (format in regress.runs): every id's decoded text, and
    the raw bytes (hex) of each id whose text lost bytes to U+FFFD (byte pieces of a character)."""
    size = len(tokenizer)
    pieces = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=False)
    data: dict[str, Any] = {"size": size, "tokens": pieces}
    # a slow sentencepiece tokenizer may decode a byte-fallback piece to "" rather than U+FFFD
    lossy = [i for i, text in enumerate(pieces) if "\ufffd" in text or text == ""]
    found: dict[str, str] = {}
    try:
        tokens = tokenizer.convert_ids_to_tokens(lossy) if lossy else []
        for i, token in zip(lossy, tokens):
            raw = token_bytes(token, pieces[i])
            if raw is not None and (pieces[i] or _BYTE_FALLBACK.fullmatch(token)):
                found[str(i)] = raw.hex()
    except Exception as exc:  # noqa: BLE001 - only the byte pieces' display is lost
        print(f"regress: bytes of partial tokens not recorded: {exc}", file=sys.stderr)
        found = {}
    if found:
        data["bytes"] = found
    return data
