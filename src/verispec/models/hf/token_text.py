"""A transformers tokenizer seen as bytes (:class:`verispec.models.base.TokenText`).

What this is: each token's piece, the bytes it appends to the text, read from a fast
tokenizer's vocabulary (its ``tokenizers`` backend), and ``encode`` by that backend. Two
conventions are decoded:

  byte-level BPE  (GPT-2, Qwen, SmolLM2, the demo pair) each character of a token stands for one
                  byte: GPT-2's ``bytes_to_unicode`` table, inverted ("Ġ" -> b" ")
  SentencePiece   (Llama, Mistral, Gemma's HF files) "\u2581" stands for a space, a byte-fallback
                  token <0xNN> for the byte NN, any other character for its UTF-8
Added tokens, special or not, give their text. ``encode`` runs a copy of the backend with every
option that puts a space before the first word turned off (Metaspace's prepend_scheme, a
normalizer's Prepend("\u2581"), ByteLevel's add_prefix_space) and no special tokens added; the
text of an added token is parsed as that token, as the tokenizer itself does.

What this is not: WordPiece (BERT's "##" marks drop the spaces between words, so pieces cannot
rebuild the text) nor slow (Python) tokenizers; both raise IncompatibleModelsError. A normalizer
that changes text (Qwen's NFC, lowercasing) is kept: pieces then rebuild the normalized text.
"""

from __future__ import annotations

import json
import re

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from ...errors import IncompatibleModelsError, TokenOutOfRangeError

SPACE_MARK = "\u2581"  # SentencePiece's visible space
BYTE_LEVEL = "byte-level BPE"
SENTENCEPIECE = "SentencePiece"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: each byte -> the printable character byte-level BPE writes for it (the
    printable Latin-1 bytes stand for themselves, the others for chr(256 + n) in order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    table = {byte: chr(byte) for byte in printable}
    for extra, byte in enumerate(b for b in range(256) if b not in table):
        table[byte] = chr(256 + extra)
    return table


class HfTokenText:
    """A fast transformers tokenizer as a TokenText (see the module docstring). ``kind``:
    BYTE_LEVEL or SENTENCEPIECE; ``role`` ("draft", "target") names it in errors."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, role: str = "draft") -> None:
        if not tokenizer.is_fast:
            raise IncompatibleModelsError(
                f"the {role}'s tokenizer {type(tokenizer).__name__} is a slow (Python) "
                "tokenizer, whose pieces verispec cannot read as bytes; expected a fast one: "
                "load it with AutoTokenizer.from_pretrained(..., use_fast=True).", field=role)
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
        self.kind = tokenizer_kind(spec, role)
        vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)  # text -> id
        self.vocab_size = max(len(tokenizer), max(vocab.values(), default=-1) + 1)
        added = {int(i): token.content for i, token in tokenizer.added_tokens_decoder.items()}
        specials = {int(i) for i in tokenizer.all_special_ids} | {
            int(i) for i, token in tokenizer.added_tokens_decoder.items() if token.special}
        text_of = [None] * self.vocab_size
        for text, token_id in vocab.items():
            text_of[token_id] = text
        decode = _piece_decoder(self.kind, _has_byte_fallback(spec))
        self._pieces = tuple(
            added[i].encode() if i in added else b"" if text is None else decode(text)
            for i, text in enumerate(text_of))
        # an id the vocabulary skips has no text: a control token like padding
        self._specials = frozenset(specials | {i for i, t in enumerate(text_of) if t is None})
        self._backend = Tokenizer.from_str(json.dumps(without_prefix_space(spec)))

    def piece(self, token_id: int) -> bytes:
        return self._pieces[self._check(token_id)]

    def is_special(self, token_id: int) -> bool:
        return self._check(token_id) in self._specials

    def encode(self, text: str) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def _check(self, token_id: int) -> int:
        if not 0 <= token_id < self.vocab_size:
            raise TokenOutOfRangeError(f"token id {token_id} is out of range: expected 0 <= id "
                                       f"< {self.vocab_size}.", field="token_id")
        return token_id


def tokenizer_kind(spec: dict, role: str) -> str:
    """BYTE_LEVEL or SENTENCEPIECE, read from a ``tokenizers`` JSON ``spec``; anything else
    raises IncompatibleModelsError naming what it is."""
    decoder = spec.get("decoder")
    if spec["model"]["type"] == "WordPiece" or _has_type(decoder, "WordPiece"):
        raise IncompatibleModelsError(
            f"the {role}'s tokenizer is WordPiece: its '##' continuation marks drop the spaces "
            "between words, so its tokens cannot be turned back into text; expected a "
            "byte-level BPE or SentencePiece tokenizer (most causal LMs have one).", field=role)
    if _has_type(decoder, "ByteLevel"):
        return BYTE_LEVEL
    marks = json.dumps([spec.get("normalizer"), spec.get("pre_tokenizer"), decoder])
    if _has_type(decoder, "Metaspace") or SPACE_MARK in marks or "\\u2581" in marks:
        return SENTENCEPIECE
    raise IncompatibleModelsError(
        f"the {role}'s tokenizer ({spec['model']['type']} model, decoder "
        f"{json.dumps(decoder)[:80]}) is neither byte-level BPE nor SentencePiece, so verispec "
        "cannot read its tokens as bytes; use a draft with one of those tokenizers.", field=role)


def without_prefix_space(spec: dict) -> dict:
    """A copy of ``spec`` that puts no space before the first word: Metaspace's prepend_scheme
    "never", ByteLevel's add_prefix_space False, a normalizer's Prepend("\u2581") dropped."""
    spec = json.loads(json.dumps(spec))
    for part in ("normalizer", "pre_tokenizer"):
        for node in _nodes(spec.get(part)):
            if node.get("type") == "Metaspace":
                node["prepend_scheme"] = "never"
            if node.get("type") in ("Metaspace", "ByteLevel") and "add_prefix_space" in node:
                node["add_prefix_space"] = False
    normalizer = spec.get("normalizer")
    if _is_space_prepend(normalizer):
        spec["normalizer"] = None
    elif normalizer is not None and normalizer.get("type") == "Sequence":
        normalizer["normalizers"] = [n for n in normalizer["normalizers"]
                                     if not _is_space_prepend(n)]
    return spec


def _piece_decoder(kind: str, byte_fallback: bool):
    """token text -> its bytes, under ``kind``'s convention."""
    if kind == BYTE_LEVEL:
        byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        # a character outside the table stands for itself, as the ByteLevel decoder reads it
        return lambda text: b"".join(bytes([byte_of[c]]) if c in byte_of else c.encode()
                                     for c in text)

    def sentencepiece(text: str) -> bytes:
        byte = _BYTE_TOKEN.fullmatch(text) if byte_fallback else None
        return bytes([int(byte.group(1), 16)]) if byte else text.replace(SPACE_MARK, " ").encode()
    return sentencepiece


def _has_byte_fallback(spec: dict) -> bool:
    return (bool(spec["model"].get("byte_fallback"))
            or _has_type(spec.get("decoder"), "ByteFallback"))


def _has_type(node, name: str) -> bool:
    return any(child.get("type") == name for child in _nodes(node))


def _is_space_prepend(node) -> bool:
    return (isinstance(node, dict) and node.get("type") == "Prepend"
            and node.get("prepend") == SPACE_MARK)


def _nodes(node):
    """Every dict in a JSON tree, ``node`` first."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _nodes(value)
    elif isinstance(node, list):
        for value in node:
            yield from _nodes(value)
