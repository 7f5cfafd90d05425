"""What a prompt must be: text before a tokenizer sees it, token ids before a model does.

check_text is the check of every text field that reaches a tokenizer: a prompt (text/decoder.py,
the server's prompts, a bench prompt file) and a chat message's role and content (text/chat.py).
check_prompt_ids is the vocabulary check of a prompt's token ids, encoded or given (the
Decoder's, and the server's for an echoed prompt). Each error names its field (``field``).
What this is not: reading token ids from lists and tensors (text/decoder.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import InputError, TokenOutOfRangeError


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
                         "JSON \\ud800-style escape); pass UTF-8 text.", field=field_name) from None


def check_prompt_ids(token_ids: Sequence[int], vocab_size: int, field_name: str = "prompt"
                     ) -> None:
    """Every id in [0, vocab_size), else TokenOutOfRangeError naming the field, the id and its
    position."""
    for position, token in enumerate(token_ids):
        if not 0 <= token < vocab_size:
            raise TokenOutOfRangeError(
                f"{field_name}[{position}] is token id {token}, outside the model's vocabulary "
                f"[0, {vocab_size}); pass ids the model's tokenizer gives.", field=field_name)
