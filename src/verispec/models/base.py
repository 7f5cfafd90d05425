"""The protocol every model backend implements (the target side built on it: engine/scorer.py).

Legend: B batch, n tokens fed in one call, K draft tokens, V vocabulary.

A :class:`LanguageModel` opens :class:`LMSession` objects: stateful, batched views over growing
token sequences whose (KV) cache holds exactly the tokens fed so far. The session has six
verbs, all the engine calls on any backend:
  start      prefill one prompt per row (a fresh batch)
  extend     feed tokens [B, n], get the logits after each
  feed       append ragged rows of tokens, no logits (a draft catching up)
  rewind     drop the last few tokens of each row, ragged
  add_rows   rows joining between rounds, each with its prompt
  keep_rows  rows leaving between rounds: keep these, in this order
Rewind must leave the session exactly as if the dropped tokens had never been fed; the engine
relies on it after every rejection. Optional abilities are protocols of their own, each
checked once where the engine opens a session (engine/scorer.py): AdoptsRows (rows prefilled
apart, chunked prefill), PrefillsThroughLastToken (prompts decoded with their last token) and
ExtendsRagged (each row fed only its own draft); CapturesSteps and ScoresApart are models'.

The engine knows nothing about tokenisation, devices or caches: it only calls these verbs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from ..errors import ShapeError


@runtime_checkable
class LMSession(Protocol):
    """A batch of sequences with a cache; see the module docstring."""

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        """Reset and feed one prompt per row (rows may differ in length, and may be empty)."""

    def extend(self, tokens: torch.Tensor, logits_at: Sequence[int] | None = None
               ) -> torch.Tensor:
        """Feed tokens [B, n] int64; return logits [B, n, V]: row b, position i holds the
        next-token logits after tokens[b, :i+1] (on top of everything fed before).
        ``logits_at`` [B] (column per row): return only row b's logits at column logits_at[b],
        [B, V]; a backend may then skip the output layer at the other columns (a draft feeding
        ragged rows needs one position a row, see proposers/draft_model.py)."""

    def feed(self, rows: Sequence[Sequence[int]]) -> None:
        """Append rows[b] (host ids; ragged, possibly empty) to row b, computing no logits: a
        draft catching up on tokens it did not propose. The cache then holds exactly what an
        ``extend`` of each row's tokens would have left."""

    def rewind(self, num_tokens: torch.Tensor | Sequence[int]) -> None:
        """Drop the last num_tokens[b] fed tokens of each row b; num_tokens [B] ints >= 0 (a
        list, as the engine passes, or an int64 tensor)."""

    def add_rows(self, prompts: Sequence[Sequence[int]], ride: bool = False) -> bool:
        """New rows at the end, one per prompt (host ids, possibly empty), fed as ``start``
        would; the rows already here are untouched. ``ride``: the prompts may instead be fed
        with the next ``extend`` in the same pass, where the backend can (it then feeds them
        first, and they get no logits). Returns whether they ride."""

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only these rows (distinct indices), in this order; the others' caches go."""


@runtime_checkable
class AdoptsRows(Protocol):
    """A session that takes rows prefilled apart: one-row sessions of the same model, each
    prefilled in chunks between rounds (engine/prefill.py), whose caches it copies in at the
    end as new rows. Without it a long prompt joins by ``add_rows``."""

    def adopt_rows(self, sessions: Sequence[LMSession]) -> None:
        """New rows at the end holding the one-row ``sessions``' tokens (copied, not fed)."""


@runtime_checkable
class PrefillsThroughLastToken(Protocol):
    """A session that takes whole prompts and decodes each in one batch with its last token:
    the rows hold all but the last token (as ``start`` of p[:-1] would), and the next
    ``extend``, which begins with the last, decodes the prompt together with it. Where a
    backend's numbers depend on a pass's shape (llama.cpp's quantized kernels), this is what
    makes the first token the one a server decoding the prompt in one batch (llama-server)
    gets. TargetScorer uses it where a session has it."""

    def start_through(self, prompts: Sequence[Sequence[int]]) -> None:
        """``start`` over whole prompts (>= 1 token each), decoded with the next extend."""

    def add_rows_through(self, prompts: Sequence[Sequence[int]]) -> bool:
        """``add_rows`` over whole prompts, decoded with the next extend; returns whether
        they ride the next pass."""


@runtime_checkable
class ExtendsRagged(Protocol):
    """A session whose pass takes each row's own number of tokens (llama.cpp's packed batch),
    so a row that drafted fewer tokens than the round's widest costs only what it fed. Where a
    pass costs about its token count (quantized kernels on a CPU), padding the rows that found
    no draft to the widest one's width made a round of 8 rows with one long draft cost several
    plain rounds. TargetScorer uses it where a session has it."""

    def extend_ragged(self, tokens: torch.Tensor, num_tokens: Sequence[int]) -> torch.Tensor:
        """Feed row b the first num_tokens[b] (1 <= n_b <= n) of tokens [B, n] int64 -> logits
        [B, n, V] fp32: row b's columns below n_b as ``extend`` gives them, its columns from
        n_b on copies of its column n_b - 1 (never fed: nothing reads them as a prediction)."""


@runtime_checkable
class CapturesSteps(Protocol):
    """A model (or a proposer over one) that captures its steps as CUDA graphs
    (models/fast_llama/step_graphs.py): ``num_captured`` counts the captures so far. A capture is a
    one-off cost of the round that made it, which the depth policy must not take for the depth's
    price (policy.scheduler.Scheduler.report)."""

    @property
    def num_captured(self) -> int: ...


@runtime_checkable
class ScoresApart(Protocol):
    """A model whose one-off passes over a whole sequence (a prompt's logprobs,
    engine/scoring.py) need a session apart from the decoding ones: llama.cpp keeps one live
    session per model (opening another would end the running batch's), and the fast path on a
    GPU would capture a CUDA graph for every prompt length and cache it beside the decoding
    steps. Without it a scoring pass opens an ordinary session (``new_session``)."""

    def scoring_session(self) -> LMSession:
        """A session that leaves this model's other sessions untouched."""


@runtime_checkable
class LanguageModel(Protocol):
    """A causal LM that can open sessions. ``vocab_size`` is the width V of its logits;
    ``device`` is where its logits live (the engine's generator is created there);
    ``max_positions``: the longest sequence a row may reach (None: no limit)."""

    vocab_size: int
    device: torch.device
    max_positions: int | None

    def new_session(self) -> LMSession:
        ...


@runtime_checkable
class TokenText(Protocol):
    """One model's tokenizer seen as bytes: what a draft of another tokenizer needs to turn the
    target's tokens into its own context and its drafts into the target's tokens
    (proposers/cross_vocab.py). Implemented for transformers and llama.cpp tokenizers in
    models/token_text.py; tests implement it for fixture vocabularies.

    ``vocab_size``: ids are 0 .. vocab_size - 1. ``piece(id)``: the bytes the token appends to
    the text: byte-level BPE's mapped bytes decoded, SentencePiece's "\u2581" as a space and its
    <0xNN> byte-fallback tokens as the byte; a special token with text (<|im_end|>) gives that
    text; a control token with none (padding) gives b"". A piece may be part of a UTF-8
    character. ``is_special(id)``: a control or added special token (BOS, EOS, chat markers):
    matched across tokenizers by its text, never drawn from the intersection. ``encode(text)``:
    the ids of ``text`` with no BOS added and special-token text parsed as special tokens, so
    that ``b"".join(piece(i) for i in encode(s)) == s.encode()`` for text without a leading-space
    convention of its own (a SentencePiece tokenizer that adds a "\u2581" before the first word
    is asked for text that does not start a sequence: it must not add one)."""

    vocab_size: int

    def piece(self, token_id: int) -> bytes:
        ...

    def is_special(self, token_id: int) -> bool:
        ...

    def encode(self, text: str) -> list[int]:
        ...


def shared_token_pairs(draft: TokenText, target: TokenText, draft_limit: int | None = None,
                       target_limit: int | None = None) -> list[tuple[int, int]]:
    """The tokens two vocabularies share, as (draft id, target id) sorted by draft id: a
    non-special token with a non-special one of identical non-empty bytes, a special token with
    a special one of the same text, never a special with a plain token. Where one vocabulary
    has several ids of the same bytes (a byte-fallback token and a plain one), the lowest
    stands for them (encode yields one; the others are duplicates). ``*_limit``: only ids below
    it (a model's logits narrower than its tokenizer; None: the whole vocabulary)."""
    draft_plain, draft_special = _lowest_ids(draft, draft_limit)
    target_plain, target_special = _lowest_ids(target, target_limit)
    return sorted([(i, target_plain[b]) for b, i in draft_plain.items() if b in target_plain]
                  + [(i, target_special[b]) for b, i in draft_special.items()
                     if b in target_special])


def _lowest_ids(text: TokenText, limit: int | None) -> tuple[dict[bytes, int], dict[bytes, int]]:
    """(bytes -> lowest non-special id, text -> lowest special id) below ``limit``; empty
    pieces left out."""
    plain: dict[bytes, int] = {}
    special: dict[bytes, int] = {}
    for token_id in range(text.vocab_size if limit is None else min(text.vocab_size, limit)):
        piece = text.piece(token_id)
        if piece:
            (special if text.is_special(token_id) else plain).setdefault(piece, token_id)
    return plain, special


def feed_rows(rows: Sequence[Sequence[int]], num_rows: int) -> list[list[int]]:
    """``rows`` (one sequence of ids per row) as lists, checked to be ``num_rows`` of them."""
    if len(rows) != num_rows:
        raise ShapeError(f"feed expects one list of tokens per row ({num_rows}); got {len(rows)}.")
    return [list(row) for row in rows]


def right_padded(rows: Sequence[Sequence[int]], num_rows: int) -> tuple[torch.Tensor, list[int]]:
    """Ragged rows of ids laid out for one pass (prompts to prefill, a ``feed``): rows [B][*]
    -> (tokens [B, u] int64, each row right-padded with id 0 to the longest, u >= 0; the
    widths [B]). The padding lands past its row's length, where every pass masks it and the
    next write overwrites it. A row count other than ``num_rows`` is a ShapeError."""
    rows = feed_rows(rows, num_rows)
    widths = [len(row) for row in rows]
    tokens = torch.zeros((num_rows, max(widths, default=0)), dtype=torch.int64)  # [B, u]
    for row, ids in enumerate(rows):
        tokens[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
    return tokens, widths


def logits_columns(logits: torch.Tensor, logits_at: Sequence[int] | None) -> torch.Tensor:
    """logits [B, n, V] as ``LMSession.extend`` returns them: all of them, or with
    ``logits_at`` [B] row b's at column logits_at[b], [B, V] (for backends that compute
    every position anyway)."""
    if logits_at is None:
        return logits
    columns = check_logits_at(logits_at, logits.shape[0], logits.shape[1])
    return logits[torch.arange(len(columns)), torch.tensor(columns)]


def check_logits_at(logits_at: Sequence[int], num_rows: int, num_new: int) -> list[int]:
    """``extend``'s logits_at as ints: one column per row, each in [0, num_new)."""
    columns = as_ints(logits_at)
    if len(columns) != num_rows or not all(0 <= c < num_new for c in columns):
        raise ShapeError(f"logits_at expects one column in [0, {num_new}) for each of the "
                         f"{num_rows} rows; got {columns}.")
    return columns


def as_ints(values: torch.Tensor | Sequence[int]) -> list[int]:
    """Per-row counts or token ids as a list of ints (one host transfer for a tensor)."""
    return values.tolist() if isinstance(values, torch.Tensor) else [int(v) for v in values]
