"""Fixture TokenTexts (verispec.models.base.TokenText) for the cross-vocabulary tests.

PieceText: a vocabulary given as a list of pieces (bytes), encoded by longest match, special
tokens' text parsed first; small enough for laws enumerated exactly. ByteLevelText: a
transformers byte-level BPE tokenizer (tiny_models.build_tokenizer) seen as bytes, for the
tiny real models. Not the library's adapters (models/token_text.py): what the proposer's tests
need of a tokenizer, and nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode


class PieceText:
    """Token i appends pieces[i]; ``specials``: the ids of special tokens (their piece is
    their text, or b"" for a control token with none)."""

    def __init__(self, pieces: Sequence[bytes], specials: Sequence[int] = ()) -> None:
        self.pieces = [bytes(piece) for piece in pieces]
        self.specials = frozenset(specials)
        self.vocab_size = len(self.pieces)
        self._plain = {piece: i for i, piece in reversed(list(enumerate(self.pieces)))
                       if i not in self.specials and piece}
        self._special = {piece: i for i, piece in enumerate(self.pieces)
                         if i in self.specials and piece}
        self._longest = max(map(len, self.pieces))

    def piece(self, token_id: int) -> bytes:
        return self.pieces[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id in self.specials

    def encode(self, text: str) -> list[int]:
        """Greedy longest match over the text's bytes, special texts first."""
        return self.encode_bytes(text.encode())

    def encode_bytes(self, data: bytes) -> list[int]:
        """encode of any bytes (a script's continuation may begin inside a character)."""
        ids, at = [], 0
        while at < len(data):
            special = next((i for piece, i in self._special.items()
                            if data.startswith(piece, at)), None)
            if special is not None:
                ids.append(special)
                at += len(self.pieces[special])
                continue
            for length in range(min(self._longest, len(data) - at), 0, -1):
                if data[at: at + length] in self._plain:
                    ids.append(self._plain[data[at: at + length]])
                    at += length
                    break
            else:
                raise ValueError(f"no token for byte {data[at]:#x} at {at} in {data!r}")
        return ids

    def ids(self, *pieces: bytes) -> list[int]:
        """The ids of these pieces (a test's shorthand)."""
        return [self.pieces.index(piece) for piece in pieces]


class ByteLevelText:
    """A byte-level BPE tokenizer (GPT-2's byte-to-character map) as a TokenText."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        decoder = {char: byte for byte, char in bytes_to_unicode().items()}
        tokens = tokenizer.convert_ids_to_tokens(list(range(self.vocab_size)))
        self._specials = frozenset(tokenizer.all_special_ids) | frozenset(
            i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
        self._pieces = [token.encode() if i in self._specials else
                        bytes(decoder[char] for char in token)
                        for i, token in enumerate(tokens)]

    def piece(self, token_id: int) -> bytes:
        return self._pieces[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._specials

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
