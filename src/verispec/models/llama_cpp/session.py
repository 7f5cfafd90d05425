"""A batch's rows on llama.cpp: each row one llama.cpp sequence of a shared context.

Legend: B batch (llama.cpp sequences), n tokens fed per row in one call, V vocabulary.

What it is: the LMSession protocol (models/base.py) over a llama_context
(model.py): ``extend`` decodes every row's new tokens as one llama_batch with logits
at every fed position, ``feed`` and prefills decode packed (sequence, token, position) triples
without logits, ``rewind`` removes each row's dropped positions, and joins and leaves take and
free sequence ids. Rows joining with ``ride`` (``add_rows``) ride the next ``extend``: their
prompts go into its llama_batch without logits, before the rows' own tokens, so a join costs
no pass of its own in which every other row would wait (on a CPU a short prompt costs about
what several decoding rounds do; dev/LOG.md). ``start_through`` and
``add_rows_through`` (models.base.PrefillsThroughLastToken) take whole prompts and let all but
each last token ride, so that the next ``extend``, which begins with the last, decodes the
prompt in one batch as llama-server does (llama.cpp's quantized kernels round by batch shape);
a round's draft tokens then go in a pass of their own (``_extend_rows``).

Uniform passes (LlamaCppConfig.uniform_passes, a target's option): llama.cpp's CPU kernels pick
their arithmetic by a pass's shape, so a position's logits differ in their last bits between a
one-token pass and a (k + 1)-token pass, and greedy speculative decoding drifts from plain
decoding at near ties. In this mode every token after a prompt is decoded in a pass of exactly
UNIFORM_PASS_WIDTH tokens of one row: the row's next tokens, padded with copies of the last one
at the following positions (causal attention keeps them out of the real rows), logits taken at
all of them (llama.cpp's last layer runs only on the rows whose logits are taken, so those
count too), the padding's KV entries removed after the pass. A row's prompt goes in a pass of
its own, with its first token, as plain decoding's first step does. Every layer then sees the
same shape for every token, plain or verified, wherever it sits in the pass; which shapes share
bits, per weight type and kernel: docs/exactness.md and benchmarks/pass_width_bits.py.

What it is not: loading, the context's lifetime or the llama.cpp bindings
(model.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ...errors import ConfigError, ContextLengthExceeded, ShapeError
from ..base import as_ints, feed_rows, logits_columns
from .protocol import Context, LlamaCpp

MAX_ROWS = 256  # llama.cpp's LLAMA_MAX_SEQ: sequences one context holds
# Tokens per pass in uniform mode. Four is the row group of llama.cpp's repacked GEMM, so a
# padded pass runs every row through it; under eight, the tiled K-quant kernel (unrepacked
# Q4_K/Q6_K) stays off; at two or more, flash attention never splits a long cache across
# threads (which it does for one query): every kernel sees one shape (dev/LOG.md, 2026-11-28).
UNIFORM_PASS_WIDTH = 4


class LlamaCppSession:
    """Rows of one batch as llama.cpp sequences; see the module docstring.

    Row b is sequence ``seq_ids[b]`` of the context; rows joining take free sequence ids, rows
    leaving have their sequence cleared and its id freed, so joins and leaves touch only those
    rows. The context has room for a fixed number of sequences: a join beyond it allocates one
    twice as large and prefills the rows already there again from their token histories (kept
    on the host for that; it happens log2(batch size) times at most).
    """

    def __init__(self, lm: LlamaCpp) -> None:
        self.lm = lm
        self.lengths: list[int] = []  # tokens fed per row (positions 0 .. length - 1)
        self.seq_ids: list[int] = []  # each row's sequence id in the context
        self._histories: list[list[int]] = []  # each row's fed tokens, to re-prefill on growth
        # per row, whether its tokens (a joining prompt) ride the next extend, not yet decoded
        self._riding: list[bool] = []
        # per row, the tokens of its prompt's pass (uniform passes replay it on re-prefill)
        self._prompt_lengths: list[int] = []
        self._context: Context | None = None

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        self._reset()
        self.add_rows(prompts)

    def start_through(self, prompts: Sequence[Sequence[int]]) -> None:
        """Reset with rows over whole prompts (>= 1 token each), all but each last token
        riding the next extend (the module docstring)."""
        self._reset()
        self.add_rows_through(prompts)

    def _reset(self) -> None:
        self.lm.check_live(self)
        self._context, self.lengths, self.seq_ids, self._histories = None, [], [], []
        self._riding, self._prompt_lengths = [], []

    def add_rows(self, prompts: Sequence[Sequence[int]], ride: bool = False) -> bool:
        """Rows joining at the end, each with its prompt under a free sequence id, prefilled
        now, or with ``ride`` in the next extend's batch (a feed or a rewind prefills them
        first). Returns whether the prompts ride."""
        self.lm.check_live(self)
        self._check_room(max((len(p) for p in prompts), default=0))
        needed = len(self.seq_ids) + len(prompts)
        if needed and (self._context is None or self._context.num_rows < needed):
            size = min(MAX_ROWS, max(needed, 2 * len(self.seq_ids)))
            self._context = self.lm.context(self, size)  # emptied: the rows here re-prefill
            self.seq_ids = list(range(len(self.seq_ids)))
            self._refill()
        free = sorted(set(range(self._context.num_rows if self._context else 0))
                      - set(self.seq_ids))
        joining = free[: len(prompts)]
        if not ride:
            self._prefill(joining, [list(p) for p in prompts], [len(p) for p in prompts])
        self.seq_ids += joining
        self._histories += [list(p) for p in prompts]
        self.lengths += [len(p) for p in prompts]
        self._riding += [ride and bool(p) for p in prompts]
        # a riding prompt's pass takes the row's first token too
        self._prompt_lengths += [len(p) + (ride and bool(p)) for p in prompts]
        return ride and any(prompts)

    def _refill(self) -> None:
        """The rows already here, in a new context: their tokens prefilled again, riding
        prompts with them; with uniform passes each row as it was decoded (``_prefill``) and
        riding prompts left to ride, so that a prompt's pass still takes its first token."""
        rows = [row for row, riding in enumerate(self._riding)
                if not (riding and self.lm.uniform_passes)]
        self._prefill([self.seq_ids[row] for row in rows],
                      [self._histories[row] for row in rows],
                      [self._prompt_lengths[row] for row in rows])
        for row in rows:
            if self._riding[row]:  # its first token now comes after its prompt's pass
                self._riding[row] = False
                self._prompt_lengths[row] = len(self._histories[row])

    def add_rows_through(self, prompts: Sequence[Sequence[int]]) -> bool:
        """Rows joining with whole prompts (>= 1 token each): all but each last token ride
        the next extend, which begins with the last, so the prompt is decoded in one batch
        (the module docstring). Returns True."""
        if not all(prompts):
            raise ShapeError("add_rows_through needs prompts of at least one token each.")
        self.add_rows([list(p[:-1]) for p in prompts], ride=True)
        return bool(prompts)

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only these rows, in this order; the others' sequences are cleared."""
        self.lm.check_live(self)
        rows = [int(row) for row in rows]
        if len(set(rows)) != len(rows) or not all(0 <= r < len(self.seq_ids) for r in rows):
            raise ShapeError(f"keep_rows expects distinct rows in [0, {len(self.seq_ids)}); "
                             f"got {rows}.")
        for row in sorted(set(range(len(self.seq_ids))) - set(rows)):
            self._context.remove(self.seq_ids[row], 0)
        self.seq_ids = [self.seq_ids[r] for r in rows]
        self.lengths = [self.lengths[r] for r in rows]
        self._histories = [self._histories[r] for r in rows]
        self._riding = [self._riding[r] for r in rows]
        self._prompt_lengths = [self._prompt_lengths[r] for r in rows]

    def _prefill(self, seq_ids: list[int], token_lists: list[list[int]],
                 prompt_lengths: list[int]) -> None:
        """Feed each sequence its tokens from position 0, without logits: packed, in chunks;
        with uniform passes, each sequence as it was decoded (its first prompt_lengths[i]
        tokens in one pass, the rest in uniform passes), so its cache is the same bits."""
        if not self.lm.uniform_passes:
            self._decode_packed(seq_ids, token_lists, [0] * len(seq_ids))
            return
        for seq_id, tokens, prompt_length in zip(seq_ids, token_lists, prompt_lengths):
            self._decode_packed([seq_id], [tokens[:prompt_length]], [0])
            self._decode_uniform(seq_id, tokens[prompt_length:], prompt_length)

    def _decode_packed(self, seq_ids: list[int], token_lists: list[list[int]],
                       starts: list[int]) -> None:
        """Feed sequence seq_ids[i] token_lists[i] from position starts[i], without logits:
        packed (sequence id, token, position) triples, in chunks of a batch."""
        if any(token_lists):
            rows, tokens, positions = _packed(seq_ids, token_lists, starts)
            self._decode(rows, tokens, positions, np.zeros(len(tokens), dtype=bool))

    def _decode(self, rows: np.ndarray, tokens: np.ndarray, positions: np.ndarray,
                wants: np.ndarray) -> torch.Tensor | None:
        """Decode (sequence id, token, position) triples [N] in chunks of a batch -> the
        logits [M, num_logits] at the M positions ``wants`` [N] marks, in order (None: M = 0)."""
        capacity = self._context.capacity
        pieces = [self._context.decode(rows[b:b + capacity], tokens[b:b + capacity],
                                       positions[b:b + capacity], logits=wants[b:b + capacity])
                  for b in range(0, len(tokens), capacity)]
        pieces = [piece for piece in pieces if piece is not None]
        return None if not pieces else pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _prefill_riding(self) -> None:
        """The riding prompts go in now, in one packed pass (before a feed or a rewind)."""
        rows = [row for row, riding in enumerate(self._riding) if riding]
        self._prefill([self.seq_ids[row] for row in rows], [self._histories[row] for row in rows],
                      [len(self._histories[row]) for row in rows])
        for row in rows:  # the first token now comes after the prompt's pass
            self._prompt_lengths[row] = len(self._histories[row])
        self._riding = [False] * len(self._riding)

    def extend(self, tokens: torch.Tensor, logits_at: Sequence[int] | None = None
               ) -> torch.Tensor:
        """tokens [B, n] int64 -> logits [B, n, V] fp32 (every fed position; [B, V] at
        logits_at's columns: LMSession.extend). Riding prompts go first in the same batch."""
        self.lm.check_live(self)
        num_rows, width = tokens.shape
        assert num_rows == len(self.lengths)
        if width == 0 or num_rows == 0:
            return logits_columns(torch.empty((num_rows, width, self.lm.vocab_size)), logits_at)
        logits = self._extend_rows(tokens.tolist())  # [B*n, V]
        return logits_columns(logits.view(num_rows, width, -1), logits_at)

    def extend_ragged(self, tokens: torch.Tensor, num_tokens: Sequence[int]) -> torch.Tensor:
        """Feed row b the first num_tokens[b] of tokens [B, n], packed -> logits [B, n, V],
        columns past a row's own repeating its last (models.base.ExtendsRagged)."""
        self.lm.check_live(self)
        num_rows, width = tokens.shape
        counts = as_ints(num_tokens)
        if len(counts) != num_rows or num_rows != len(self.lengths) or not all(
                1 <= count <= width for count in counts):
            raise ShapeError(f"extend_ragged expects one count in [1, {width}] for each of the "
                             f"{len(self.lengths)} rows; got {counts}.")
        logits = self._extend_rows([row[:count] for row, count in
                                    zip(tokens.tolist(), counts)])  # [sum(counts), V]
        # row b, column j -> packed position start_b + min(j, count_b - 1)
        starts = torch.tensor([0] + counts[:-1], dtype=torch.int64).cumsum(0)  # [B]
        columns = torch.minimum(torch.arange(width)[None, :],
                                torch.tensor(counts)[:, None] - 1)  # [B, n]
        return logits[starts[:, None] + columns]

    def _extend_rows(self, rows_tokens: list[list[int]]) -> torch.Tensor:
        """Feed row b rows_tokens[b] (>= 1 token each) after the riding prompts -> the logits
        at every fed position, packed row after row [sum of lengths, V] fp32.

        With prompts riding, each row's first token goes in their batch and the rest (a
        round's draft tokens) in a second pass: the prompt's pass then computes its last
        token's logits exactly as plain decoding's first pass does, and the draft tokens are
        verified in a pass shaped as every later round's, never inside a prompt-sized batch
        (whose quantized kernels round differently; docs/exactness.md). Worked example, rows
        A (riding, tokens a0 a1 a2) and B (tokens b0 b1): pass 1 = A's prompt, a0, b0; pass 2
        = a1 a2 b1; the result is [a0, a1, a2, b0, b1]."""
        self._check_room(max(length + len(row) for length, row in
                             zip(self.lengths, rows_tokens)))
        if self.lm.uniform_passes:
            return self._extend_uniform(rows_tokens)
        riding = [row for row, flag in enumerate(self._riding) if flag]
        if not riding or all(len(row) == 1 for row in rows_tokens):
            return self._decode_rows(riding, rows_tokens)
        heads = self._decode_rows(riding, [row[:1] for row in rows_tokens])  # [B, V]
        tails = self._decode_rows([], [row[1:] for row in rows_tokens])  # [sum(n_b - 1), V]
        pieces, start = [], 0
        for row_index, row in enumerate(rows_tokens):
            pieces += [heads[row_index:row_index + 1], tails[start:start + len(row) - 1]]
            start += len(row) - 1
        return torch.cat(pieces)

    def _decode_rows(self, riding: list[int], rows_tokens: list[list[int]]) -> torch.Tensor:
        """One batch: the ``riding`` rows' prompts without logits, then row b's
        rows_tokens[b] (possibly none) with logits -> [sum of lengths, V] fp32."""
        # [riding prompts, no logits | every row's tokens, logits]
        rows, flat_tokens, positions = _packed(
            [self.seq_ids[row] for row in riding] + self.seq_ids,
            [self._histories[row] for row in riding] + rows_tokens,
            [0] * len(riding) + self.lengths)
        num_fed = sum(len(row) for row in rows_tokens)
        wants = np.ones(len(flat_tokens), dtype=bool)
        wants[: len(flat_tokens) - num_fed] = False
        for row in riding:
            self._riding[row] = False
        logits = self._decode(rows, flat_tokens, positions, wants)  # [num_fed, num_logits]
        self.lengths = [length + len(row) for length, row in zip(self.lengths, rows_tokens)]
        for history, row in zip(self._histories, rows_tokens):
            history.extend(row)
        if logits is None:
            return torch.empty((0, self.lm.vocab_size))
        return logits[:, : self.lm.vocab_size]

    def _extend_uniform(self, rows_tokens: list[list[int]]) -> torch.Tensor:
        """_extend_rows with uniform passes, row by row: a riding row's prompt and first token
        in one pass, then every other token in uniform passes (the module docstring)."""
        pieces = []
        for row, tokens in enumerate(rows_tokens):
            if self._riding[row]:
                self._riding[row] = False
                head = self._histories[row] + tokens[:1]  # the prompt's pass
                wants = np.zeros(len(head), dtype=bool)
                wants[-1] = True
                pieces.append(self._decode(np.full(len(head), self.seq_ids[row]),
                                           np.array(head, dtype=np.int32),
                                           np.arange(len(head), dtype=np.int32), wants))
                self._append(row, tokens[:1])
                tokens = tokens[1:]
            pieces.append(self._decode_uniform(self.seq_ids[row], tokens, self.lengths[row]))
            self._append(row, tokens)
        return torch.cat(pieces)[:, : self.lm.vocab_size]

    def _decode_uniform(self, seq_id: int, tokens: list[int], start: int) -> torch.Tensor:
        """Sequence seq_id's tokens from position ``start`` in passes of exactly
        UNIFORM_PASS_WIDTH tokens, the last padded with copies of its last token whose cache
        entries are then removed -> the logits [len(tokens), num_logits] of the real ones."""
        width = UNIFORM_PASS_WIDTH
        pieces = [torch.empty((0, self._context.num_logits))]
        for offset in range(0, len(tokens), width):
            real = tokens[offset:offset + width]
            position = start + offset
            logits = self._context.decode(
                np.full(width, seq_id, dtype=np.int64),
                np.array(real + real[-1:] * (width - len(real)), dtype=np.int32),
                np.arange(position, position + width, dtype=np.int32),
                np.ones(width, dtype=bool))  # [width, num_logits]
            if len(real) < width:
                self._context.remove(seq_id, position + len(real))
            pieces.append(logits[: len(real)])
        return torch.cat(pieces)

    def _append(self, row: int, tokens: list[int]) -> None:
        """Row ``row`` now holds ``tokens`` after its earlier ones."""
        self.lengths[row] += len(tokens)
        self._histories[row].extend(tokens)

    def feed(self, rows: Sequence[Sequence[int]]) -> None:
        """Append rows[b] to row b with no logits (LMSession.feed): llama.cpp batches take
        ragged sequences, so the tokens go packed, no padding."""
        self.lm.check_live(self)
        rows = feed_rows(rows, len(self.lengths))
        if not any(rows):
            return
        if any(self._riding):
            self._prefill_riding()
        self._check_room(max(length + len(row) for length, row in zip(self.lengths, rows)))
        if self.lm.uniform_passes:
            for row, tokens in enumerate(rows):
                self._decode_uniform(self.seq_ids[row], list(tokens), self.lengths[row])
                self._append(row, list(tokens))
            return
        self._decode_packed(self.seq_ids, rows, self.lengths)
        for history, row in zip(self._histories, rows):
            history.extend(row)
        self.lengths = [length + len(row) for length, row in zip(self.lengths, rows)]

    def rewind(self, num_tokens: torch.Tensor | Sequence[int]) -> None:
        self.lm.check_live(self)
        if any(self._riding):
            self._prefill_riding()
        for row, count in enumerate(as_ints(num_tokens)):
            if count < 0 or count > self.lengths[row]:
                raise ConfigError(f"rewind of {count} tokens on row {row} is invalid: it holds "
                                  f"{self.lengths[row]}.")
            if count:
                self.lengths[row] -= count
                del self._histories[row][self.lengths[row]:]
                self._context.remove(self.seq_ids[row], self.lengths[row])

    def _check_room(self, length: int) -> None:
        if length > self.lm.max_positions:
            raise ContextLengthExceeded(
                f"a row would hold {length} tokens, more than the llama.cpp context of "
                f"{self.lm.max_positions} tokens per sequence; raise context_size "
                "(LlamaCppConfig, --context-size) or shorten the request.")


def _packed(seq_ids: Sequence[int], token_lists: Sequence[Sequence[int]],
            starts: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token lists as packed llama_batch triples: sequence ids [N] int64, tokens [N] and
    positions [N] int32, list i at seq_ids[i] from position starts[i]."""
    rows = np.array([s for s, p in zip(seq_ids, token_lists) for _ in p], dtype=np.int64)
    tokens = np.array([t for p in token_lists for t in p], dtype=np.int32)
    positions = np.array([start + i for start, p in zip(starts, token_lists)
                          for i in range(len(p))], dtype=np.int32)
    return rows, tokens, positions
