"""Text out of a row's tokens: stop strings, incremental detokenisation, the Completion.

A :class:`RowText` turns the token chunks of one row into text deltas: never a split multi-byte
character, never text that may turn out to be the start of a stop string; at the end, a
:class:`Completion` whose text and token ids stop where the client's text stops. What this is
not: the decoding (batch.py's TextBatch over engine/batch.py) or the tokenizer's loading
(load.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..engine.constraints import ConstraintSet
from ..engine.metrics import GenerationMetrics
from ..engine.rows import TokenLogprob
from ..errors import ConfigError
from .detokenize import IncrementalDetokenizer


@dataclass(frozen=True)
class Completion:
    """text: the new text (cut before a stop string); token_ids: the new tokens only, up to the
    one where the text ends (tokens verified past a stop string's start are not included).
    A prompt of a batch that failed on a fault of its own (its grammar's dead end, non-finite
    logits, ...) ends with finish_reason "error" and ``error``, the typed exception, its text
    what it had generated before; the batch's other prompts ran on unchanged."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length", or "error" (see error)
    metrics: GenerationMetrics
    num_prompt_tokens: int
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, where asked
    error: Exception | None = None  # what the generation failed with (finish_reason "error")

    def to_dict(self) -> dict[str, object]:
        out = {"text": self.text, "token_ids": self.token_ids,
               "finish_reason": self.finish_reason, "num_prompt_tokens": self.num_prompt_tokens,
               "metrics": self.metrics.to_dict()}
        if self.logprobs is not None:
            out["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob,
                                "top": [list(pair) for pair in lp.top]} for lp in self.logprobs]
        if self.error is not None:
            out["error"] = f"{type(self.error).__name__}: {self.error}"
        return out


def check_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    # a string is one stop; a list is many; anything else is checked as one (and fails)
    stops = tuple(stop) if isinstance(stop, Sequence) and not isinstance(stop, str) else (stop,)
    if not all(isinstance(s, str) and s for s in stops):
        raise ConfigError(f"stop={stop!r} is invalid: expected a non-empty string or a list of "
                          "non-empty strings.", field="stop")
    return stops


def row_end_token_ids(constraints: ConstraintSet | None, row: int) -> frozenset[int]:
    """The tokens that end a row's text (ConstraintSet.end_token_ids; none without a grammar)."""
    return frozenset() if constraints is None else constraints.end_token_ids(row)


class RowText:
    """One row's text: its token chunks in, text deltas out, never splitting a multi-byte
    character and never showing text that may turn out to be the start of a stop string. Each
    chunk is detokenised incrementally (detokenize.IncrementalDetokenizer), not the whole
    output. One per row of a TextBatch (batch.py).

    ``end_token_ids``: tokens after which the text is complete even where the engine goes on
    (a grammar's end tokens under ignore_eos: ConstraintSet.end_token_ids); the first one is
    kept in token_ids, as the engine keeps a stop token, and nothing after it."""

    def __init__(self, tokenizer, stop: tuple[str, ...], num_prompt_tokens: int,
                 end_token_ids: frozenset[int] = frozenset()) -> None:
        self.stop = stop
        self.num_prompt_tokens = num_prompt_tokens
        self.end_token_ids = end_token_ids
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self.token_ids = self._detokenizer.token_ids  # the new tokens so far
        self.text = ""  # their text so far: what was emitted, plus held-back text
        self._emitted = 0  # characters of text already given out
        self.stopped_by_string = False
        self.stopped_by_token = False  # an end token came
        self._shown = 0  # tokens the text given out covers, as last found (num_tokens_shown)

    def feed(self, token_ids: Sequence[int], final: bool) -> tuple[str, bool]:
        """A round's new tokens (``final``: the row has ended) -> (the text now safe to show,
        whether the text is complete: the row ended, an end token came or a stop string was
        found)."""
        token_ids = self._cut_after_end_token(token_ids)
        final = final or self.stopped_by_token
        # at the end, partial bytes of a character are decoded too (as U+FFFD)
        self.text += self._detokenizer.add(token_ids, final=final)
        cut = self._find_stop(self.text)
        if cut is not None:
            self.text, self.stopped_by_string, final = self.text[:cut], True, True
        end = len(self.text) if final else len(self.text) - self._held_back(self.text)
        delta = self.text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return delta, final

    def completion(self, finish_reason: str, metrics: GenerationMetrics,
                   logprobs: list[TokenLogprob] | None = None,
                   error: Exception | None = None) -> Completion:
        """The finished text's Completion (finish_reason: the engine's, "stop" or "length";
        a stop string or an end token makes it "stop"; an ``error`` makes it "error");
        ``logprobs``: the row's, one per token the engine emitted (None: not asked for), cut
        as the token ids are."""
        token_ids = list(self.token_ids)
        if self.stopped_by_string:  # the tokens after the stop string's start were not shown
            token_ids = token_ids[: self._tokens_covering(token_ids, self.text)]
        reason = "stop" if self.stopped_by_string or self.stopped_by_token else finish_reason
        kept = None if logprobs is None else list(logprobs[: len(token_ids)])
        return Completion(self.text, token_ids, "error" if error is not None else reason,
                          metrics, self.num_prompt_tokens, kept, error)

    def _cut_after_end_token(self, token_ids: Sequence[int]) -> Sequence[int]:
        """A round's tokens up to and including the first end token (a speculative round may
        verify several end tokens in a row: plain decoding would have stopped at the first)."""
        for i, token in enumerate(token_ids):
            if token in self.end_token_ids:
                self.stopped_by_token = True
                return token_ids[: i + 1]
        return token_ids

    def _tokens_covering(self, token_ids: list[int], text: str, low: int = 0) -> int:
        """The fewest leading tokens whose decode starts with ``text`` (a round may verify
        several tokens past a stop string; the client gets, and is billed for, only those up to
        the one where the kept text ends: a character split over tokens needs all of them, as
        its partial decode is U+FFFD). Binary search over prefix decodes, from ``low``: a
        count known not to exceed the answer."""
        high = len(token_ids)
        while low < high:
            middle = (low + high) // 2
            decoded = self._detokenizer.tokenizer.decode(token_ids[:middle],
                                                         skip_special_tokens=True)
            if decoded.startswith(text):
                high = middle
            else:
                low = middle + 1
        return low

    def _find_stop(self, text: str) -> int | None:
        """Where the text is cut: the start of the stop string that completes first (the
        earliest end; at one end, the longest). Token-by-token decoding cuts there, so the cut
        depends on the text alone, never on how many tokens a round delivered: with stops
        ["\\n\\nUser:", "User"] the text "hello\\n\\nUser: hi" is cut to "hello\\n\\n" (the
        earliest start would give "hello" only when one round holds both). Every match ends
        in the text added since the last search: an earlier one would have cut it then."""
        start = max(0, self._emitted - max((len(s) for s in self.stop), default=0))
        found = [(i + len(s), i) for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(found)[1] if found else None

    def _held_back(self, text: str) -> int:
        """Trailing characters not safe to show yet: a suffix that starts a stop string. (Text
        never ends inside a character here: the detokenizer waits for its last byte.)"""
        prefix = 0
        for s in self.stop:
            for size in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:size]):
                    prefix = max(prefix, size)
                    break
        return prefix

    def num_tokens_shown(self) -> int:
        """How many of the new tokens the text given out so far covers: the fewest leading
        tokens whose decode starts with it (a token whose text is held back, as a possible
        stop string's start, is not shown yet). What a stream sends a token's logprob by:
        never for a token a stop string may still cut."""
        # the count only grows with the text given out: search from the last one, so a round
        # costs a few prefix decodes, not a search over every token so far
        self._shown = self._tokens_covering(list(self.token_ids), self.text[: self._emitted],
                                            low=self._shown)
        return self._shown
