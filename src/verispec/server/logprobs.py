"""Token logprobs in OpenAI's two shapes, and the prompt a completion echoes.

/v1/chat/completions (``logprobs: true, top_logprobs: N``), per choice:

    "logprobs": {"content": [{"token": " the", "logprob": -0.31, "bytes": [32, 116, 104, 101],
                              "top_logprobs": [{"token", "logprob", "bytes"}, ... N]}, ...]}

/v1/completions (``logprobs: N``), per choice, one entry per token (the echoed prompt's first,
its first token's logprob and alternatives null, as OpenAI's):

    "logprobs": {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}],
                 "text_offset": [...]}

A completions entry's alternatives are the N most likely tokens and the token itself (up to
N + 1, as OpenAI's and vLLM's). Values are what the library reports (engine/rows.py
TokenLogprob: the target's processed distribution; engine/scoring.py: a prompt token's raw
one); a token the distribution excludes, -inf, is sent as -9999.0 (JSON has no infinity; vLLM
sends the same). A token's text is its own decode with special tokens kept, its bytes that
text's UTF-8 (a token holding part of a character decodes to U+FFFD).

A token's ``text_offset`` is the number of characters of the choice's text before the token's
text starts (OpenAI's), counted by the incremental detokenizer that makes the text
(TextOffsets), not by adding up the tokens' own decodes, which count a character split over
byte tokens once per byte.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..text.batch import TokenLogprob
from ..text.detokenize import REPLACEMENT, IncrementalDetokenizer

EXCLUDED_LOGPROB = -9999.0  # -inf as JSON


@dataclass(frozen=True)
class Echo:
    """The prompt a completions choice echoes: its text, its token ids and, when logprobs are
    asked for, their scores (Decoder.prompt_logprobs; the first is None) and text offsets in
    ``text`` (TextOffsets)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None
    text_offsets: list[int] | None = None


class TextOffsets:
    """The text_offset of one choice's tokens, fed in order: ``start`` plus the characters of
    the text before each token's, as the detokenizer (text/detokenize.py) makes the choice's
    text, never more than ``end`` where given. A token holding the rest of a character split
    over tokens starts where that character starts; a byte that forms no character (U+FFFD in
    the text) counts as one. So offsets never decrease, and each whole token's text is found at
    its offset. Worked example, "héllo" as the byte-level tokens [h, C3, A9, llo] ("é" is
    C3 A9): offsets 0, 1, 1, 2."""

    def __init__(self, tokenizer, start: int = 0, skip_special_tokens: bool = True,
                 end: int | None = None) -> None:
        self.start, self.end = start, end
        self._detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._length = 0  # characters the detokenizer has returned

    def __call__(self, token_ids: Sequence[int]) -> list[int]:
        """The next tokens' offsets."""
        offsets = []
        for token in token_ids:
            held = self._detokenizer.held  # the text of tokens whose character is not complete
            text = self._detokenizer.add([token])
            continues = self._continues(held, text or self._detokenizer.held, token)
            offset = self.start + self._length + len(held) - int(continues)
            offsets.append(offset if self.end is None else min(offset, self.end))
            self._length += len(text)
        return offsets

    def _continues(self, held: str, after: str, token: int) -> bool:
        """Whether ``token``'s first byte belongs to the character ``held`` ends in (a U+FFFD
        that may be the start of one), given the text ``after`` of those tokens and this one:
        the character completed, or the token's bytes joined it (the held text did not grow
        by a U+FFFD), unless the token itself starts with a whole character."""
        if not held.endswith(REPLACEMENT):
            return False
        last = len(held) - 1
        if len(after) <= last or after[last] != REPLACEMENT:  # joined, or the character completed
            return True
        tokenizer = self._detokenizer.tokenizer
        own = tokenizer.decode([token], skip_special_tokens=self._detokenizer.skip_special_tokens)
        if not own.startswith(REPLACEMENT):
            return False
        return len(after) == len(held) or after[len(held)] != REPLACEMENT


def json_logprob(value: float) -> float:
    return EXCLUDED_LOGPROB if value == -math.inf else value


class TokenTexts:
    """Each token id's text, decoded once (the logprobs of every request name the same few
    thousand tokens again and again)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text

    def chat_logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict[str, object]:
        """OpenAI's chat ``logprobs`` object of these tokens."""
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(token, value)
                                              for token, value in lp.top]}
                            for lp in logprobs]}

    def _entry(self, token_id: int, logprob: float) -> dict[str, object]:
        text = self(token_id)
        return {"token": text, "logprob": json_logprob(logprob),
                "bytes": list(text.encode("utf-8"))}

    def completion_logprobs(self, logprobs: Sequence[TokenLogprob | None],
                            token_ids: Sequence[int], offsets: Sequence[int]
                            ) -> dict[str, object]:
        """OpenAI's completions ``logprobs`` object of these tokens (one entry each; None for a
        token nothing predicts: an echoed prompt's first) at these text offsets (TextOffsets)."""
        tokens = [self(token) for token in token_ids]
        return {"tokens": tokens,
                "token_logprobs": [None if lp is None else json_logprob(lp.logprob)
                                   for lp in logprobs],
                "top_logprobs": [None if lp is None else self._top_dict(lp) for lp in logprobs],
                "text_offset": list(offsets)}

    def _top_dict(self, logprob: TokenLogprob) -> dict[str, float]:
        """The alternatives and the token itself, {text: logprob}, most likely first (two
        tokens of one text: the likelier)."""
        top: dict[str, float] = {}
        for token, value in (*logprob.top, (logprob.token_id, logprob.logprob)):
            top.setdefault(self(token), json_logprob(value))
        return top
