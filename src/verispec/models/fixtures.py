"""Fixture language models over small vocabularies, for statistical tests and examples.

They are real implementations of the session protocol (history, ragged rewind) whose
next-token distributions are known in closed form, so a test can compute the exact law of
generated text by enumeration and compare it with what the engine emits. They are the object
of the tests, not a stand-in for a transformer (the transformers adapter is tested on tiny real
models).

  FixedDistributionLM  the same logits at every position (context-free).
  MarkovLM             logits depend on the last ``order`` tokens (order 1 or 2): context-
                       dependent, so a wrong rewind or an off-by-one shows up in the law.

Legend: B batch, T history length, n fed tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ShapeError
from .base import logits_columns, right_padded

BOS_STATE = 0  # the context token assumed before the start of a sequence


class _HistorySession:
    """Token history per row with ragged rewind; subclasses map contexts to logits."""

    def __init__(self, model: _FixtureLM) -> None:
        self.model = model
        self.history = torch.zeros((0, 0), dtype=torch.int64)  # [B, capacity]
        self.lengths = torch.zeros(0, dtype=torch.int64)  # [B]

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        width = max((len(p) for p in prompts), default=0)
        self.history = torch.zeros((len(prompts), max(width, 1) + 64), dtype=torch.int64)
        for row, prompt in enumerate(prompts):
            self.history[row, : len(prompt)] = torch.as_tensor(list(prompt), dtype=torch.int64)
        self.lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64)

    def add_rows(self, prompts: Sequence[Sequence[int]], ride: bool = False) -> bool:
        """New rows at the end holding these prompts; the others unchanged. Never rides
        (FastLlamaSession.add_rows): returns False."""
        joining = type(self)(self.model)
        joining.start(prompts)
        width = max(self.history.shape[1], joining.history.shape[1])
        grown = torch.zeros((self.history.shape[0] + len(prompts), width), dtype=torch.int64)
        grown[: self.history.shape[0], : self.history.shape[1]] = self.history
        grown[self.history.shape[0]:, : joining.history.shape[1]] = joining.history
        self.history = grown
        self.lengths = torch.cat([self.lengths, joining.lengths])
        return False

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only these rows, in this order."""
        if len(set(rows)) != len(rows) or not all(0 <= r < len(self.lengths) for r in rows):
            raise ShapeError(f"keep_rows expects distinct rows in [0, {len(self.lengths)}); "
                             f"got {list(rows)}.")
        index = torch.tensor(list(rows), dtype=torch.int64)
        self.history, self.lengths = self.history[index], self.lengths[index]

    def extend(self, tokens: torch.Tensor, logits_at: Sequence[int] | None = None
               ) -> torch.Tensor:
        """tokens [B, n] -> logits [B, n, V] ([B, V] with logits_at: LMSession.extend)."""
        batch_size, num_new = tokens.shape
        if batch_size != self.history.shape[0]:
            raise ShapeError(f"extend got {batch_size} rows; the session has "
                             f"{self.history.shape[0]}.")
        needed = int(self.lengths.max()) + num_new if batch_size else 0
        if needed > self.history.shape[1]:
            grown = torch.zeros((batch_size, 2 * needed), dtype=torch.int64)
            grown[:, : self.history.shape[1]] = self.history
            self.history = grown
        positions = self.lengths[:, None] + torch.arange(num_new)[None, :]  # [B, n]
        self.history.scatter_(1, positions, tokens.cpu())
        self.lengths = self.lengths + num_new
        # context for the logits after position p: tokens at p - order + 1 .. p
        order = self.model.order
        contexts = []
        for back in range(order - 1, -1, -1):
            idx = positions - back
            ctx = self.history.gather(1, idx.clamp_min(0))
            contexts.append(torch.where(idx >= 0, ctx, torch.full_like(ctx, BOS_STATE)))
        logits = self.model.table[tuple(contexts)].to(tokens.device)  # [B, n, V]
        return logits_columns(logits, logits_at)

    def feed(self, rows: Sequence[Sequence[int]]) -> None:
        """Append rows[b] to row b (LMSession.feed): the padded tokens are written, then
        rewound, so each row's history holds exactly its own."""
        tokens, widths = right_padded(rows, self.history.shape[0])  # [B, u]
        if any(widths):
            self.extend(tokens)
            self.rewind(torch.tensor([tokens.shape[1] - width for width in widths]))

    def rewind(self, num_tokens: torch.Tensor) -> None:
        num_tokens = torch.as_tensor(num_tokens, dtype=torch.int64).cpu()
        if bool((num_tokens < 0).any()) or bool((num_tokens > self.lengths).any()):
            raise ShapeError(f"cannot rewind {num_tokens.tolist()} tokens from rows of length "
                             f"{self.lengths.tolist()}.")
        self.lengths = self.lengths - num_tokens


class _FixtureLM:
    """A table of logits indexed by the last ``order`` tokens: table [V, ..., V, V]."""

    def __init__(self, table: torch.Tensor, order: int) -> None:
        expected_dims = order + 1
        if table.dim() != expected_dims or len(set(table.shape)) != 1:
            raise ShapeError(f"an order-{order} fixture needs a table of shape [V]*{expected_dims}"
                             f"; got {tuple(table.shape)}.")
        self.table = table.to(torch.float32)
        self.order = order
        self.vocab_size = table.shape[-1]
        self.device = torch.device("cpu")
        self.max_positions: int | None = None  # a table has no window

    def new_session(self) -> _HistorySession:
        return _HistorySession(self)

    def next_logits(self, context: Sequence[int]) -> torch.Tensor:
        """Logits [V] after the full token sequence ``context`` (for exact-law enumeration)."""
        padded = [BOS_STATE] * self.order + list(context)
        return self.table[tuple(padded[-self.order:])]


class FixedDistributionLM(_FixtureLM):
    """The same next-token logits [V] after any context (-inf marks impossible tokens)."""

    def __init__(self, logits: torch.Tensor) -> None:
        logits = torch.as_tensor(logits, dtype=torch.float32)
        if logits.dim() != 1:
            raise ShapeError(f"logits must be [V]; got {tuple(logits.shape)}.")
        vocab_size = logits.shape[0]
        super().__init__(logits.expand(vocab_size, vocab_size).clone(), order=1)

    @classmethod
    def from_probs(cls, probs: torch.Tensor) -> FixedDistributionLM:
        return cls(torch.log(torch.as_tensor(probs, dtype=torch.float32)))


class MarkovLM(_FixtureLM):
    """Next-token logits from the last ``order`` tokens: table [V]*order + [V]."""

    def __init__(self, table: torch.Tensor, order: int = 1) -> None:
        if order not in (1, 2):
            raise ShapeError(f"order={order} is not supported; expected 1 or 2.")
        super().__init__(torch.as_tensor(table, dtype=torch.float32), order)

    @classmethod
    def random(cls, vocab_size: int, generator: torch.Generator, order: int = 1,
               sharpness: float = 2.0, zero_fraction: float = 0.0) -> MarkovLM:
        """A random chain; ``zero_fraction`` of entries get -inf (never the whole row)."""
        shape = (vocab_size,) * (order + 1)
        table = torch.randn(shape, generator=generator) * sharpness
        if zero_fraction > 0:
            mask = torch.rand(shape, generator=generator) < zero_fraction
            keep = table.argmax(dim=-1, keepdim=True)
            mask.scatter_(-1, keep, False)  # every context keeps at least one token
            table = table.masked_fill(mask, float("-inf"))
        return cls(table, order)
