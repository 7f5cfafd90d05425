"""llama.cpp's tokenizer of a GGUF file seen as bytes (:class:`verispec.models.base.TokenText`).

What this is: each token's piece as llama.cpp renders it (``llama_token_to_piece`` with special
tokens rendered as their text: SentencePiece's "\u2581" as a space and <0xNN> as the byte,
byte-level BPE's characters as their bytes), special tokens read from llama.cpp's token
attributes, and ``encode`` by ``llama_tokenize`` with no BOS and special-token text parsed.

Special: a control token (BOS, EOS, chat markers, and what llama.cpp itself marks control, such
as an end-of-generation "</s>"), the unknown token, and unused slots (padding rows past the
trained vocabulary, which render as b""). A user-defined token is text: Gemma's runs of
newlines, spaces and tabs and its HTML tags, Qwen's <tool_call>; it is matched by its bytes.

A SentencePiece vocabulary whose file sets tokenizer.ggml.add_space_prefix puts a space before
the first word and after every special token; ``encode`` is asked for text that continues a
sequence, so such a vocabulary is loaded a second time, without weights, with that key
overridden to false.

What this is not: a decoder of text for users (tokenizer.py's ``decode``).
"""

from __future__ import annotations

import ctypes

from ...errors import IncompatibleModelsError, TokenOutOfRangeError
from .model import LlamaCppModel, bindings
from .tokenizer import LlamaCppTokenizer

_PROBE = "a"  # text any vocabulary encodes: a space prefix shows as b" a"


class LlamaCppTokenText:
    """A :class:`LlamaCppTokenizer` as a TokenText (see the module docstring). ``role``
    ("draft", "target") names it in errors."""

    def __init__(self, tokenizer: LlamaCppTokenizer, role: str = "draft") -> None:
        llama_cpp = bindings()
        vocab = tokenizer.model.vocab
        self.vocab_size = len(tokenizer)
        self._pieces = _pieces(llama_cpp, vocab, self.vocab_size)
        not_text = (llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
                    | llama_cpp.LLAMA_TOKEN_ATTR_UNUSED)
        text = (llama_cpp.LLAMA_TOKEN_ATTR_NORMAL | llama_cpp.LLAMA_TOKEN_ATTR_BYTE
                | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED)
        attrs = [llama_cpp.llama_vocab_get_attr(vocab, t) for t in range(self.vocab_size)]
        self._specials = frozenset(t for t, attr in enumerate(attrs)
                                   if attr & not_text or not attr & text)
        self._tokenizer = _without_space_prefix(tokenizer, self._pieces, role)

    def piece(self, token_id: int) -> bytes:
        return self._pieces[self._check(token_id)]

    def is_special(self, token_id: int) -> bool:
        return self._check(token_id) in self._specials

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def _check(self, token_id: int) -> int:
        if not 0 <= token_id < self.vocab_size:
            raise TokenOutOfRangeError(f"token id {token_id} is out of range: expected 0 <= id "
                                       f"< {self.vocab_size}.", field="token_id")
        return token_id


def _pieces(llama_cpp, vocab, vocab_size: int) -> tuple[bytes, ...]:
    """Every token's bytes, special tokens rendered as their text."""
    size = 256
    buffer = ctypes.create_string_buffer(size)
    pieces = []
    for token_id in range(vocab_size):
        length = llama_cpp.llama_token_to_piece(vocab, token_id, buffer, size, 0, True)
        if length > size:
            size = length
            buffer = ctypes.create_string_buffer(size)
            length = llama_cpp.llama_token_to_piece(vocab, token_id, buffer, size, 0, True)
        pieces.append(buffer.raw[:max(length, 0)])
    return tuple(pieces)


def _without_space_prefix(tokenizer: LlamaCppTokenizer, pieces: tuple[bytes, ...],
                          role: str) -> LlamaCppTokenizer:
    """``tokenizer``, or where it puts a space before the first word, the same file's
    vocabulary loaded again without weights and without that space."""
    if _encodes_plainly(tokenizer, pieces):
        return tokenizer
    model = tokenizer.model
    plain = LlamaCppTokenizer(LlamaCppModel(model.path, model.role, vocab_only=True,
                                            add_space_prefix=False))
    if not _encodes_plainly(plain, pieces):
        raise IncompatibleModelsError(
            f"the {role}'s llama.cpp tokenizer ({model.path}) encodes {_PROBE!r} as the bytes "
            f"{b''.join(pieces[t] for t in plain.encode(_PROBE, False))!r}, even with "
            "add_space_prefix off; expected a tokenizer whose tokens spell the text they "
            "encode.", field=role)
    return plain


def _encodes_plainly(tokenizer: LlamaCppTokenizer, pieces: tuple[bytes, ...]) -> bool:
    ids = tokenizer.encode(_PROBE, add_special_tokens=False)
    return b"".join(pieces[t] for t in ids) == _PROBE.encode()
