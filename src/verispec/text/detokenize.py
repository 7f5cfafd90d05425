"""Incremental detokenisation: the text that each round's new tokens add to a generation.

Decoding the whole output every round costs O(n) per round, O(n^2) per generation, a share of
the time that grows with the output. This decodes a window
instead, the previous step's new tokens plus this step's, and keeps the text after the
previous step's part: the method of Hugging Face's text-generation-inference and vLLM. Keeping
the previous tokens in the window makes tokenizers whose decoding depends on the left
neighbour (SentencePiece's word-start space, dropped at the start of a decode) decode the
boundary as they would in one piece.

What this is not: a tokenizer. It calls ``tokenizer.decode(ids, skip_special_tokens=True)``
(any Hugging Face tokenizer; False where asked, for a text that shows special tokens) and
nothing else.

Worked example, the byte tokens of "ü" = [C3, BC] arriving one per step after "a":
  step 1: window [a]          -> "a"          new text "a"; the window moves to [a]
  step 2: window [a C3]       -> "a\ufffd"     ends inside a character: no new text yet
  step 3: window [a C3 BC]    -> "aü"         new text "ü" (after "a"); the window moves on
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"  # what a decoder makes of the bytes of an incomplete character


class IncrementalDetokenizer:
    """Token ids in, step by step; the new text of each step out. The texts of all steps
    concatenate to the decode of all the tokens (for byte-level BPE exactly; the tests check
    it against whole decodes for byte-level and SentencePiece-style tokenizers)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._window = 0  # first token of the decode window: the previous step's new tokens
        self._read = 0  # tokens whose text has been returned
        self.held = ""  # the text of the tokens not returned yet: "", or ending in U+FFFD

    def add(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Append ``token_ids`` and return the text they complete: "" while the tokens not yet
        returned end inside a character or add no text (special tokens). ``final``: the
        generation is over, so an incomplete character's bytes come out as U+FFFD."""
        self.token_ids.extend(token_ids)
        if self._read == len(self.token_ids):
            return ""
        before = self._decode(self.token_ids[self._window : self._read])
        window = self._decode(self.token_ids[self._window :])
        if not final and (len(window) <= len(before) or window.endswith(REPLACEMENT)):
            self.held = window[len(before) :]
            return ""
        self._window, self._read, self.held = self._read, len(self.token_ids), ""
        return window[len(before) :]

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
