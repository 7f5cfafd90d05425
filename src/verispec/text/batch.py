"""Text generation for many prompts at once: rows of text over the engine's engine.batch.Batch.

A :class:`TextBatch` is what ``Decoder.generate`` / ``Decoder.stream`` over a list of prompts
and the server's continuous batching run on: rows join with their own text-level settings
(prompt, sampling, seed, stop strings, max_new_tokens, response_format; checked exactly as a
one-prompt call checks them), every :meth:`TextBatch.step` is one verified round for all of
them, and each row's tokens become text through its own stream.RowText. A row whose text
is complete (a stop token, max_new_tokens, a stop string, or its grammar's end token under
ignore_eos) leaves the batch at once. A row that fails on a fault of its own (the engine's
Row.fail, or its text's: the tokenizer) leaves too, its Completion with finish_reason "error"
and the typed error; the other rows go on unchanged.

What this is not: the round (engine/batch.py) or tokenisation and checks (decoder.Decoder).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

from ..config import plain_number
from ..engine.batch import Batch, check_prompts
from ..engine.constraints import ConstraintSet
from ..engine.prefill import ChunkedPrefill
from ..engine.rows import Row, TokenLogprob
from ..errors import ConfigError
from ..spec.sampling import make_generator
from .inputs import PreparedRow, RequestSettings, RowPreparer, check_keywords
from .stream import Completion, RowText, row_end_token_ids


class TextRow:
    """One prompt's generation in a :class:`TextBatch`: ``completion`` is set when its text is
    complete; ``row`` is the engine's row (tokens, metrics)."""

    def __init__(self, row: Row, text: RowText, tag: object = None) -> None:
        self.row = row
        self.text = text
        self.tag = tag  # the caller's: an index, a request
        self.completion: Completion | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return self.text.num_prompt_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.text.token_ids

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """The new tokens' logprobs so far (engine.rows.TokenLogprob, one per token the engine
        emitted), or None when the row's settings did not ask for them."""
        return None if self.row.config.logprobs is None else self.row.logprobs


class PendingRow(NamedTuple):
    """A row checked and encoded (TextBatch.prepare), not yet in the batch."""

    prepared: PreparedRow
    tag: object


def _joined_constraints(prepared: Sequence[PreparedRow]) -> ConstraintSet | None:
    """The joining rows' grammars as one set over them (None when no row has one)."""
    sets = [p.constraints for p in prepared]
    present = [c for c in sets if c is not None]
    if not present:
        return None
    joined = ConstraintSet(present[0].index, [])
    for constraints in sets:
        joined.add_rows(constraints, 1)
    return joined


class TextBatch:
    """Rows of text decoded together; rows join (:meth:`add`) and leave (:meth:`remove`, or
    when complete) between rounds. Not thread-safe: one thread calls add, step and remove."""

    def __init__(self, decoder: RowPreparer, batch: Batch) -> None:
        self.decoder = decoder
        self.batch = batch
        self._rows: dict[int, TextRow] = {}  # engine row id -> its text row

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, prompt: str | Sequence[int], tag: object = None, **settings) -> TextRow:
        """A row joins: ``settings`` are RequestSettings' fields (text/inputs.py) but
        ``speculative`` (the batch's), checked as Decoder.stream checks them. Its generator is
        its own, seeded by ``seed``: the same seed gives the same text whatever else is in the
        batch."""
        return self.add_rows([self.prepare(prompt, tag, **settings)])[0]

    def prepare(self, prompt: str | Sequence[int], tag: object = None,
                **settings) -> PendingRow:
        """:meth:`add`'s checks and encoding without joining: raises the row's typed error
        (ConfigError, InputError, ContextLengthExceeded, ...), so that rows prepared one by one
        can join together (:meth:`add_rows`) with every bad one already refused."""
        check_keywords(RequestSettings, "TextBatch.add", settings)
        request = RequestSettings(**settings, speculative=self.batch.speculative)
        prepared = self.decoder.prepare(prompt, request)
        check_prompts([prepared.prompt_ids], self.batch.vocab_size)
        return PendingRow(prepared, tag)

    def start_prefill(self, pending: PendingRow) -> ChunkedPrefill | None:
        """A prepared row's prompt prefilled apart, a chunk between rounds
        (engine/prefill.py), to join with :meth:`add_rows`' ``prefilled`` once done; None
        where the target's backend cannot (the row then joins as any other)."""
        return self.batch.start_prefill(pending.prepared.prompt_ids)

    def add_rows(self, pending: Sequence[PendingRow],
                 prefilled: Sequence[ChunkedPrefill] | None = None) -> list[TextRow]:
        """Prepared rows join together, prefilled in one pass, or copied from their finished
        chunked prefills (returned in the order given)."""
        if not pending:
            return []
        prepared = [row.prepared for row in pending]
        generators = [make_generator(p.config.seed, self.batch.device) for p in prepared]
        rows = self.batch.add([p.prompt_ids for p in prepared], [p.config for p in prepared],
                              generators, _joined_constraints(prepared), prefilled)
        text_rows = []
        for row, item in zip(rows, pending):
            text = RowText(self.decoder.tokenizer, item.prepared.stop,
                           len(item.prepared.prompt_ids),
                           row_end_token_ids(item.prepared.constraints, 0))
            text_rows.append(TextRow(row, text, item.tag))
            self._rows[row.id] = text_rows[-1]
        return text_rows

    def remove(self, text_row: TextRow) -> None:
        """A row leaves before it is complete (a cancelled request)."""
        if self._rows.pop(text_row.row.id, None) is not None and not text_row.row.finished:
            self.batch.remove([text_row.row])

    def step(self) -> list[tuple[TextRow, str]]:
        """One round: [(row, its new text)] for every row that took part (the text may be
        empty); rows whose ``completion`` is now set have left the batch (a failed row's
        has finish_reason "error" and its ``error``)."""
        return [(self._rows[row.id], self._feed(self._rows[row.id], new_tokens))
                for row, new_tokens in self.batch.step()]

    def _feed(self, text_row: TextRow, new_tokens: list[int]) -> str:
        """A row's new tokens into its text -> the text now safe to show; a row whose text is
        complete gets its completion and leaves."""
        row = text_row.row
        in_batch = not row.finished  # else the round has taken it out already
        try:
            delta, done = text_row.text.feed(new_tokens, final=row.finished)
        except Exception as exc:  # its text's own fault (the tokenizer): it fails alone
            row.fail(exc)
            delta, done = "", True
        if done:
            text_row.completion = text_row.text.completion(
                row.finish_reason or "stop", row.metrics, text_row.logprobs, row.error)
            self._rows.pop(row.id)
            if in_batch:  # a stop string ended its text, or it failed here: it leaves now
                self.batch.remove([row])
        return delta


class BatchStream:
    """Text deltas of several prompts decoded together, as (prompt index, delta) pairs in
    the order rounds verify them; ``completions`` (one per prompt, in order) is complete
    when the iteration ends."""

    def __init__(self, text_batch: TextBatch, num_prompts: int) -> None:
        self.text_batch = text_batch
        self.completions: list[Completion | None] = [None] * num_prompts
        self._pending: list[tuple[int, str]] = []

    def __iter__(self) -> Iterator[tuple[int, str]]:
        return self

    def __next__(self) -> tuple[int, str]:
        while not self._pending:
            if not len(self.text_batch):
                raise StopIteration
            for text_row, delta in self.text_batch.step():
                if text_row.completion is not None:
                    self.completions[text_row.tag] = text_row.completion
                if delta:
                    self._pending.append((text_row.tag, delta))
        return self._pending.pop(0)


# the per-row settings a list may give, one value per prompt
PER_ROW_SETTINGS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop",
                    "min_new_tokens", "response_format")


def is_batch(prompt: object) -> bool:
    """A list of prompts (texts or token-id lists), as opposed to one prompt (a text, or one
    list of token ids)."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(item, str) or (isinstance(item, Sequence)
                                                and not isinstance(item, (bytes, bytearray)))
                    for item in prompt))


def row_settings(settings: dict[str, object], num_prompts: int) -> list[dict[str, object]]:
    """Each prompt's settings: a value applies to every row, a list (one per prompt) varies
    per row. ``seed``: an int seeds row i with seed + i (rows differ; pass a list to give
    each its own); ``stop``: a string or a list of strings applies to every row, a list with
    one list (or None) per prompt varies per row."""
    rows: list[dict[str, object]] = [dict(settings) for _ in range(num_prompts)]
    for name in PER_ROW_SETTINGS:
        value = plain_number(settings.get(name))  # a numpy seed is an int seed too
        if name == "seed" and isinstance(value, int) and not isinstance(value, bool):
            for i, row in enumerate(rows):
                row["seed"] = (value + i) % 2**63
            continue
        per_row = isinstance(value, (list, tuple)) and (
            name != "stop" or (len(value) > 0 and all(v is None or isinstance(v, (list, tuple))
                                                      for v in value)))
        if not per_row:
            continue
        if len(value) != num_prompts:
            raise ConfigError(f"{name} has {len(value)} values for {num_prompts} prompts; give "
                              "one value for all of them or one per prompt.", field=name)
        for row, item in zip(rows, value):
            row[name] = item
    return rows
