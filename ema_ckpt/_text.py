"""Names from checkpoints shown safely: keys and paths are untrusted text.

A key may hold terminal escape sequences, other control characters, bidi overrides or lone
surrogates: :func:`escaped` writes each as a Python-style escape, so a printed name never acts
on the terminal or fails to encode.

Example:
    >>> escaped("model.w\\x1b[2J")
    'model.w\\\\x1b[2J'
    >>> escaped("fc\\udcff.weight")
    'fc\\\\udcff.weight'
"""

from __future__ import annotations

import unicodedata

_BIDI = set("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _unsafe(ch: str) -> bool:
    code = ord(ch)
    if code < 0x20 or 0x7F <= code < 0xA0 or 0xD800 <= code < 0xE000 or ch in _BIDI:
        return True
    return unicodedata.category(ch) in ("Cc", "Cs", "Zl", "Zp")


def escaped(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with control characters, bidi overrides and lone surrogates escaped
    (``keep_newlines``: but ``\n``, for whole messages)."""
    if text.isascii() and text.isprintable():
        return text
    out = []
    for ch in text:
        if _unsafe(ch) and not (keep_newlines and ch == "\n"):
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)
