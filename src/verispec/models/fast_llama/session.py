"""The fast path's session: one generation's rows over a :class:`FastLlamaLM` and its KV cache.

Legend: B batch, n fed tokens.

What it is: the LMSession protocol (models/base.py) for the flat Llama forward, with the same
per-row cache semantics as hf.adapter.TransformersSession: rows of different lengths
(host-side lengths choose the forward's uniform or ragged path), joins into free cache slots
(prefilled in one packed pass, or riding the next pass), copies of rows prefilled apart
(chunked prefill), rows kept or dropped between rounds, and rewinds that only move a length.
What it is not: the forward pass itself (model.py), the cache's storage
(kv_cache.py) or the packed layout of feeds (packed.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...errors import ShapeError
from ..attention import attention_kernels, segments_by_length
from ..base import as_ints, check_logits_at, feed_rows
from .kv_cache import KVCache
from .packed import feed_packed, pack_rows
from .protocol import FastLlama


class FastLlamaSession:
    """Same protocol and cache semantics as hf.adapter.TransformersSession.

    Row lengths are kept on the host: every row holding the same number of tokens (always at
    batch 1) selects the uniform path of :meth:`FastLlamaLM.forward` without a device sync.
    ``eager``: never replay captured steps (a one-off scoring pass, FastLlamaLM.scoring_session).
    """

    def __init__(self, lm: FastLlama, cache: KVCache | None = None, eager: bool = False) -> None:
        self.lm = lm
        self.eager = eager
        self.cache = cache if cache is not None else KVCache(lm, 0, 0)
        self.lengths: list[int] = []  # tokens held per row (a riding join's: its prompt's)
        self.num_rows = self.cache.num_rows
        # rows that joined with ride=True, their prompts not in the cache yet: row -> prompt,
        # prefilled by the next pass (add_rows)
        self._joining: dict[int, list[int]] = {}

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        longest = max((len(p) for p in prompts), default=0)
        self.cache = KVCache(self.lm, len(prompts), self._room(longest))
        self._joining = {}
        self._prefill(prompts)

    def _prefill(self, prompts: Sequence[Sequence[int]]) -> None:
        """Fill this session's (empty, large enough) cache with ``prompts``, packed
        (:meth:`feed`)."""
        self.num_rows = len(prompts)
        self.lengths = [0] * self.num_rows
        self.feed(prompts)

    def add_rows(self, prompts: Sequence[Sequence[int]], ride: bool = False) -> bool:
        """New rows at the end holding these prompts, in the cache's free slots (the other
        rows' caches are neither read nor copied). Prefilled now in one packed pass
        (:meth:`feed` on empty rows), or with ``ride`` by the next pass: an ``extend`` lays
        them beside the rows' own tokens (packed.py), so the join pays no pass of its
        own (in which every weight is read once more); a ``feed``
        puts each before its row's tokens, a ``rewind`` prefills them first, and a row that
        leaves before then is never prefilled. Returns whether the prompts ride."""
        if not prompts:
            return False
        first = self._open_slots(max(len(p) for p in prompts), len(prompts))
        if ride:
            self._joining.update((first + i, list(p)) for i, p in enumerate(prompts) if p)
        else:
            joining = FastLlamaSession(self.lm, self.cache.slots(first, len(prompts)))
            joining.lengths = [0] * len(prompts)
            joining.feed(prompts)
        self._fill_slots([len(p) for p in prompts])
        return ride and any(prompts)

    def adopt_rows(self, sessions: Sequence[FastLlamaSession]) -> None:
        """New rows at the end whose caches are copies of these one-row sessions of the same
        model (a long prompt prefilled apart, over several rounds: engine/prefill.py); the
        other rows' caches are neither read nor copied."""
        sessions = list(sessions)
        if not all(isinstance(s, FastLlamaSession) and s.lm is self.lm and s.num_rows == 1
                   and not s._joining for s in sessions):
            raise ShapeError("adopt_rows expects one-row sessions of this model with nothing "
                             "riding")
        if not sessions:
            return
        lengths = [s.lengths[0] for s in sessions]
        first = self._open_slots(max(lengths), len(sessions))
        for i, (session, length) in enumerate(zip(sessions, lengths)):
            self.cache.copy_row(first + i, session.cache, length)
        self._fill_slots(lengths)

    def _open_slots(self, longest: int, count: int) -> int:
        """Room in the cache for ``count`` more rows, the longest holding ``longest`` tokens;
        returns the first of their slots (free until :meth:`_fill_slots`)."""
        self.cache.ensure(self._room(longest))
        self.cache.ensure_rows(self.num_rows + count)
        return self.num_rows

    def _fill_slots(self, lengths: list[int]) -> None:
        """The next len(lengths) slots become live rows holding these many tokens."""
        self.lengths += lengths
        self.cache.add_rows(len(lengths))
        self.num_rows += len(lengths)

    def _room(self, longest: int) -> int:
        """Positions to hold for rows whose longest holds ``longest`` tokens: room to generate
        as much again, but no more than the model's context (every slot gets that capacity,
        and fresh memory is paid for when first touched, so growing every slot to a long
        prompt's room is a pause the rows feel; dev/LOG.md: fast path sessions)."""
        room = max(128, 2 * longest)
        return room if self.lm.max_positions is None else max(
            longest, min(room, self.lm.max_positions))

    def _take_joining(self) -> tuple[list[int], list[list[int]]]:
        """The riding prompts as a packed feed's starts and rows (empty for the other rows),
        now owned by the caller's pass. Worked example: lengths [7, 3], row 1 joining with
        [a b c] -> starts [7, 0], rows [[], [a b c]]."""
        starts, rows = list(self.lengths), [[] for _ in range(self.num_rows)]
        for row, prompt in self._joining.items():
            starts[row], rows[row] = 0, prompt
        self._joining = {}
        return starts, rows

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only these rows, in this order (a riding join that leaves is never
        prefilled; one that stays keeps riding, from its new slot)."""
        rows = _checked_rows(rows, self.num_rows)
        held = [0 if row in self._joining else length for row, length in enumerate(self.lengths)]
        self.cache.keep_rows(rows, held)
        self.lengths = [self.lengths[row] for row in rows]
        self._joining = {slot: self._joining[row] for slot, row in enumerate(rows)
                         if row in self._joining}
        self.num_rows = len(rows)

    def extend(self, tokens: torch.Tensor, logits_at: Sequence[int] | None = None
               ) -> torch.Tensor:
        """tokens [B, n] -> logits [B, n, V]; with logits_at [B], [B, V] at those columns only
        (LMSession.extend), the output layer run at B positions instead of B n."""
        if tokens.dim() != 2 or tokens.shape[0] != self.num_rows:
            raise ShapeError(f"extend expects tokens [B={self.num_rows}, n]; got "
                             f"{tuple(tokens.shape)}.")
        columns = None
        if logits_at is not None:  # one column for all rows is a slice, no index tensor
            columns = check_logits_at(logits_at, self.num_rows, tokens.shape[1])
            columns = columns[0] if len(set(columns)) == 1 else torch.tensor(
                columns, device=self.lm.device)
        logits = self._forward(tokens.to(self.lm.device), columns)
        self.lengths = [length + tokens.shape[1] for length in self.lengths]
        return logits if columns is None else logits[:, 0]

    def feed(self, rows: Sequence[Sequence[int]]) -> None:
        """Append rows[b] to row b with no logits (a draft catching up, LMSession.feed; joining
        prompts, :meth:`add_rows`), every row's tokens packed end to end in one pass
        (packed.py): the projections see only real tokens, attention runs row by row.
        Rows with nothing to feed take no part. Packed, it is faster than right-padded passes
        in groups of near widths, for a target and for its draft (dev/LOG.md: fast path
        sessions).
        """
        rows = feed_rows(rows, self.num_rows)
        widths = [len(row) for row in rows]
        starts, prompts = self._take_joining()  # a riding join's prompt goes before its tokens
        fed = [prompt + row for prompt, row in zip(prompts, rows)]
        if not any(fed):
            return
        self.cache.ensure(max(start + len(row) for start, row in zip(starts, fed)))
        feed_packed(self.lm, self.cache, starts, fed)
        self.lengths = [length + width for length, width in zip(self.lengths, widths)]

    def rewind(self, num_tokens: torch.Tensor | Sequence[int]) -> None:
        dropped = as_ints(num_tokens.reshape(-1) if isinstance(num_tokens, torch.Tensor)
                          else num_tokens)
        if len(dropped) != self.num_rows or not all(
                0 <= n <= length for n, length in zip(dropped, self.lengths)):
            raise ShapeError(f"rewind expects [B={self.num_rows}] counts from 0 to each row's "
                             f"length {self.lengths}; got {dropped}.")
        if self._joining:  # riding prompts go in before anything is dropped
            self.feed([[] for _ in range(self.num_rows)])
        self.lengths = [length - n for length, n in zip(self.lengths, dropped)]

    def _forward(self, tokens: torch.Tensor, logits_at: int | torch.Tensor | None = None
                 ) -> torch.Tensor:
        num_new = tokens.shape[1]
        if not self.lengths:  # no rows: nothing to compute
            return torch.empty((0, num_new if logits_at is None else 1, self.lm.vocab_size),
                               dtype=self.lm.dtype, device=self.lm.device)
        graphs = self.lm.step_graphs
        if graphs is not None and not (self.eager or self._joining or self.cache.is_slice):
            logits = graphs.forward(tokens, self.lengths, self.cache)  # [B, n, V]
            if logits_at is None:
                return logits
            if isinstance(logits_at, int):
                return logits[:, logits_at : logits_at + 1]
            return logits[torch.arange(len(self.lengths), device=logits.device), logits_at][
                :, None]
        start = self.lengths[0]
        used = max(self.lengths) + num_new
        positions = segments = None  # uniform rows
        if any(length != start for length in self.lengths):
            lengths = torch.tensor(self.lengths, dtype=torch.int64, device=tokens.device)
            positions = lengths[:, None] + torch.arange(num_new, device=tokens.device)  # [B, n]
            if self.lm.device.type == "cpu":  # measured there (models/attention.py)
                segments = segments_by_length([length + num_new for length in self.lengths],
                                              self.lm.segment_call_rows)
                segments = segments if len(segments) > 1 else None
        self.cache.ensure(used)
        packed = pack_rows(self.lm, *self._take_joining()) if self._joining else None
        with torch.inference_mode(), attention_kernels(self.lm.device):
            return self.lm.forward(tokens, positions, start, self.cache, used, logits_at,
                                   segments=segments, packed=packed)


def _checked_rows(rows: Sequence[int], num_rows: int) -> list[int]:
    """keep_rows' argument: distinct row indices in [0, num_rows), as ints."""
    rows = [int(row) for row in rows]
    if len(set(rows)) != len(rows) or not all(0 <= row < num_rows for row in rows):
        raise ShapeError(f"keep_rows expects distinct rows in [0, {num_rows}); got {rows}.")
    return rows
