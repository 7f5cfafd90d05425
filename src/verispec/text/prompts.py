"""What a text prompt must be before a tokenizer sees it.

check_text is the check of every text field that reaches a tokenizer: a prompt (text/decoder.py,
the server's prompts, a bench prompt file) and a chat message's role and content (text/chat.py).
What this is not: token-id prompts, checked where the Decoder reads them (text/decoder.py).
"""

from __future__ import annotations

from ..errors import InputError


def check_text(text: str, field_name: str) -> None:
    """Text a tokenizer can encode: no lone surrogates. Those are what bytes that are not UTF-8
    become when Python decodes argv or a POSIX-locale stdin (errors="surrogateescape"), and what
    a JSON escape such as \\ud800 decodes to; tokenizers reject them with a bare TypeError.
    InputError names the field, the character and its position."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{field_name} holds {text[exc.start]!r} at character {exc.start}, which "
                         "is not valid Unicode (a lone surrogate: bytes that were not UTF-8, or a "
                         "JSON \\ud800-style escape); pass UTF-8 text.") from None
