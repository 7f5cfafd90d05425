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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..engine.rows import TokenLogprob

EXCLUDED_LOGPROB = -9999.0  # -inf as JSON


@dataclass(frozen=True)
class Echo:
    """The prompt a completions choice echoes: its text, its token ids and, when logprobs are
    asked for, their scores (Decoder.prompt_logprobs; the first is None)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None


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
                            token_ids: Sequence[int], offset: int) -> dict[str, object]:
        """OpenAI's completions ``logprobs`` object of these tokens (one entry each; None for a
        token nothing predicts: an echoed prompt's first), whose text starts at character
        ``offset`` of the choice's text."""
        tokens = [self(token) for token in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens,
                "token_logprobs": [None if lp is None else json_logprob(lp.logprob)
                                   for lp in logprobs],
                "top_logprobs": [None if lp is None else self._top_dict(lp) for lp in logprobs],
                "text_offset": offsets}

    def _top_dict(self, logprob: TokenLogprob) -> dict[str, float]:
        """The alternatives and the token itself, {text: logprob}, most likely first (two
        tokens of one text: the likelier)."""
        top: dict[str, float] = {}
        for token, value in (*logprob.top, (logprob.token_id, logprob.logprob)):
            top.setdefault(self(token), json_logprob(value))
        return top
