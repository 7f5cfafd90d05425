"""Text generation over the engine's engine.batch.Batch: rows of text that join and leave.

A :class:`TextBatch` is what every generation runs on: ``Decoder.generate`` / ``stream`` on one
prompt (a :class:`TextStream`), on a list of prompts (a :class:`BatchStream`), and the server's
continuous batching. Rows join with their own text-level settings (prompt, sampling, seed, stop
strings, max_new_tokens, response_format; inputs.RequestSettings), either at once
(:meth:`TextBatch.add`) or in turn (:meth:`TextBatch.submit`, then :meth:`TextBatch.admit`
between rounds: at most the batch's prefill budget of prompt tokens a gap, a long prompt
prefilled in chunks while the others decode; admission.py). Every :meth:`TextBatch.step` is one
verified round for all of them, and each row's tokens become text through its own
stream.RowText. A row whose text is complete (a stop token, max_new_tokens, a stop string, or
its grammar's end token under ignore_eos) leaves the batch at once. A row that fails on a fault
of its own (the engine's Row.fail, or its text's: the tokenizer) leaves too, its Completion with
finish_reason "error" and the typed error; the other rows go on unchanged.

What this is not: the round (engine/batch.py), tokenisation and checks (decoder.Decoder), or
threads and queues (the server's worker).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ..config import plain_number
from ..engine.batch import Batch
from ..engine.constraints import ConstraintSet
from ..engine.metrics import GenerationMetrics
from ..engine.prefill import ChunkedPrefill
from ..engine.rows import Row, TokenLogprob
from ..errors import ConfigError
from ..sample.sampling import make_generator
from .admission import Admission
from .inputs import (
    CALL_OPTIONS,
    PendingRow,
    PreparedRow,
    RequestSettings,
    RowPreparer,
    check_keywords,
)
from .stream import Completion, RowText, row_end_token_ids

# what the server, which reaches the engine only through text/, reads of a row and its metrics
__all__ = ["BatchStream", "GenerationMetrics", "PendingRow", "TextBatch", "TextRow",
           "TextStream", "TokenLogprob", "is_batch", "row_settings"]


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
    """Rows of text decoded together; rows join (:meth:`add`, or :meth:`submit` and
    :meth:`admit`) and leave (:meth:`remove`, or when complete) between rounds. Not
    thread-safe: one thread calls its methods."""

    def __init__(self, decoder: RowPreparer, batch: Batch) -> None:
        self.decoder = decoder
        self.batch = batch
        self._rows: dict[int, TextRow] = {}  # engine row id -> its text row
        self._admission = Admission(batch.options)

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def num_draft_tokens(self) -> int:
        """The width of the latest round (0: plain)."""
        return self.batch.last_num_draft_tokens

    def add(self, prompt: str | Sequence[int], tag: object = None, **settings) -> TextRow:
        """A row joins now: ``settings`` are RequestSettings' fields (text/inputs.py), checked as
        Decoder.stream checks them (``speculative``, ``adaptive`` and the other batch options
        are the batch's: a different one is a ConfigError). Its generator is its own, seeded by
        ``seed``: the same
        seed gives the same text whatever else is in the batch."""
        return self.add_rows([self.prepare(prompt, tag, **settings)])[0]

    def prepare(self, prompt: str | Sequence[int], tag: object = None,
                settings: RequestSettings | None = None, **keywords) -> PendingRow:
        """:meth:`add`'s checks and encoding without joining: raises the row's typed error
        (ConfigError, InputError, ContextLengthExceeded, ...), so that rows prepared one by one
        can join together (:meth:`add_rows`, :meth:`submit`) with every bad one already
        refused. ``settings``: built already (the server's), else from ``keywords``."""
        if settings is None:
            check_keywords(RequestSettings, "TextBatch.add", keywords, CALL_OPTIONS)
            self._check_batch_options(keywords)
            settings = RequestSettings(**{name: value for name, value in keywords.items()
                                          if name not in CALL_OPTIONS})
        elif keywords:
            raise ConfigError(f"pass settings= or keywords, not both; got {sorted(keywords)}.",
                              field=min(keywords))
        depth = self.batch.options.num_draft_tokens if self.batch.speculative else 0
        return PendingRow(self.decoder.prepare(prompt, settings, depth), tag)

    def _check_batch_options(self, keywords: dict[str, object]) -> None:
        """A row may name the batch's own options (CALL_OPTIONS: ``speculative``, ``adaptive``,
        ...); a different one is a ConfigError naming it (a row cannot change how its batch
        decodes)."""
        own = {name: getattr(self.batch.options, name) for name in CALL_OPTIONS[1:]}
        own["speculative"] = self.batch.speculative
        for name in CALL_OPTIONS:
            if name in keywords and keywords[name] != own[name]:
                raise ConfigError(
                    f"{name}={keywords[name]!r:.60} differs from this batch's {name}="
                    f"{own[name]!r:.60}: it is an option of the batch, not of a row; open a "
                    f"batch with it (Decoder.open_batch) or drop it.", field=name)

    def start_prefill(self, pending: PendingRow) -> ChunkedPrefill | None:
        """A prepared row's prompt prefilled apart, a chunk between rounds
        (engine/prefill.py), to join with :meth:`add_rows`' ``prefilled`` once done; None
        where the target's backend cannot (the row then joins as any other)."""
        return self.batch.start_prefill(pending.prepared.prompt_ids, checked=True)

    def add_rows(self, pending: Sequence[PendingRow],
                 prefilled: Sequence[ChunkedPrefill] | None = None) -> list[TextRow]:
        """Prepared rows join together, prefilled in one pass, or copied from their finished
        chunked prefills (returned in the order given)."""
        if not pending:
            return []
        prepared = [row.prepared for row in pending]
        generators = [make_generator(p.config.seed, self.batch.device) for p in prepared]
        rows = self.batch.add([p.prompt_ids for p in prepared], [p.config for p in prepared],
                              generators, _joined_constraints(prepared), prefilled,
                              checked=True)  # by Decoder.prepare
        text_rows = []
        for row, item in zip(rows, pending):
            text = RowText(self.decoder.tokenizer, item.prepared.stop,
                           len(item.prepared.prompt_ids),
                           row_end_token_ids(item.prepared.constraints, 0))
            text_rows.append(TextRow(row, text, item.tag))
            self._rows[row.id] = text_rows[-1]
        return text_rows

    # --- admission: rows that wait their turn (admission.py) --------------------------------

    def submit(self, pending: PendingRow) -> None:
        """A prepared row waits to join; :meth:`admit` takes it in its turn."""
        self._admission.waiting.append(pending)

    def withdraw(self, pending: PendingRow) -> bool:
        """A submitted row leaves before it joined (False: it is not waiting)."""
        return self._admission.withdraw(pending)

    def has_room(self) -> bool:
        """Whether one more row may be submitted (BatchOptions.max_batch_size)."""
        return self._admission.has_room(len(self))

    @property
    def num_waiting(self) -> int:
        """Submitted rows not yet joined, those being prefilled apart included."""
        return len(self._admission)

    @property
    def num_prefilling(self) -> int:
        """Submitted rows whose long prompts are being prefilled apart."""
        return len(self._admission.prefilling)

    @property
    def idle(self) -> bool:
        """No row running and none waiting."""
        return not self._rows and not len(self._admission)

    def admit(self) -> list[TextRow]:
        """A gap between rounds: the submitted rows whose turn it is join (admission.py), the
        ones prefilled apart first; returns them."""
        ready, joining = self._admission.gap(len(self), self.start_prefill)
        return (self.add_rows([pending for pending, _ in ready],
                              [chunked for _, chunked in ready])
                + self.add_rows(joining))

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
    when the iteration ends. The prompts join in their turn (TextBatch.admit)."""

    def __init__(self, text_batch: TextBatch, num_prompts: int) -> None:
        self.text_batch = text_batch
        self.completions: list[Completion | None] = [None] * num_prompts
        self._pending: list[tuple[int, str]] = []

    def __iter__(self) -> Iterator[tuple[int, str]]:
        return self

    def __next__(self) -> tuple[int, str]:
        while not self._pending:
            if self.text_batch.idle:
                raise StopIteration
            self.text_batch.admit()
            for text_row, delta in self.text_batch.step():
                if text_row.completion is not None:
                    self.completions[text_row.tag] = text_row.completion
                if delta:
                    self._pending.append((text_row.tag, delta))
        return self._pending.pop(0)


class TextStream:
    """Text deltas of one prompt decoded alone (Decoder.stream: a TextBatch of that one row);
    ``completion`` is set when its text is complete. A row that fails on a fault of its own
    (engine.rows.Row.fail) raises its typed error from the iteration."""

    def __init__(self, text_batch: TextBatch, row: TextRow) -> None:
        self.text_batch = text_batch
        self.row = row
        self.num_prompt_tokens = row.num_prompt_tokens
        self.token_ids = row.token_ids  # the new tokens so far
        self.completion: Completion | None = None

    @property
    def text(self) -> str:
        return self.row.text.text

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """The new tokens' logprobs so far (one per token the engine emitted), or None when
        the request did not ask for them."""
        return self.row.logprobs

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        while self.completion is None:
            delta = "".join(text for row, text in self.text_batch.step() if row is self.row)
            if self.row.completion is not None:
                if self.row.completion.error is not None:  # the one prompt failed: ours too
                    raise self.row.completion.error
                self.completion = self.row.completion
            if delta:
                return delta
        raise StopIteration


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
