"""The target side of a round: TargetScorer over a model's LMSession (models/base.py).

Legend: B batch, K draft tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..models.base import AdoptsRows, ExtendsRagged, LMSession, PrefillsThroughLastToken, as_ints


class TargetScorer:
    """The target side of speculative decoding over an :class:`LMSession`.

    Invariant between rounds: the cache holds every committed token but the last, which is
    ``pending`` (a session that decodes prompts through their last token defers the prompt
    itself to the first score: PrefillsThroughLastToken). Scoring feeds [pending, d_1 .. d_k]
    in ONE call and returns k+1 next-token logits (for d_1 .. d_k and the bonus). Committing n
    accepted tokens rewinds the k - n rejected ones and makes the recovered/bonus token the new
    ``pending``. Rows with fewer draft tokens than the widest (k_b < K) feed only their own
    k_b where the session takes ragged rows (ExtendsRagged), else they are padded to K.

    Worked example (prompt "a b c", k = 3, draft "x y z", 1 accepted, recovered "w"):
      start:  cache [a b]        pending c
      score:  feed  [c x y z]    -> logits after c, x, y, z      cache [a b c x y z]
      commit: rewind 2 (y z)     -> cache [a b c x]              pending w
    """

    def __init__(self, session: LMSession, prompts: Sequence[Sequence[int]]) -> None:
        self.session = session
        # a session that decodes each prompt with its last token (the pending one) gets the
        # whole prompts; others get all but the last now
        self._through = isinstance(session, PrefillsThroughLastToken)
        if self._through:
            session.start_through([list(p) for p in prompts])
        else:
            session.start([list(p[:-1]) for p in prompts])
        self.pending = _pending(prompts)  # [B, 1]
        self._num_scored: list[int] = []  # draft tokens each row fed in the last score() call
        self._ragged = session if isinstance(session, ExtendsRagged) else None
        self._adopts = session if isinstance(session, AdoptsRows) else None

    @property
    def adopts_rows(self) -> bool:
        """Whether rows prefilled apart can join (:meth:`adopt_rows`; AdoptsRows)."""
        return self._adopts is not None

    def add_rows(self, prompts: Sequence[Sequence[int]]) -> bool:
        """Rows joining between rounds, each with its prompt (>= 1 token). Returns whether
        their prefill rides the next score's pass (a backend that can: FastLlamaSession,
        LlamaCppSession), which then costs what it does plus that prefill."""
        riding = (self.session.add_rows_through([list(p) for p in prompts]) if self._through
                  else self.session.add_rows([list(p[:-1]) for p in prompts], ride=True))
        self.pending = torch.cat([self.pending, _pending(prompts)])
        return riding

    def adopt_rows(self, sessions: Sequence[LMSession], prompts: Sequence[Sequence[int]]
                   ) -> None:
        """Rows joining whose prompts, but their last tokens, are already in one-row sessions of
        their own (prefill.ChunkedPrefill): the session copies their caches in
        (a backend that can: :attr:`adopts_rows`)."""
        assert self._adopts is not None, "the target's session cannot adopt rows"
        self._adopts.adopt_rows(sessions)
        self.pending = torch.cat([self.pending, _pending(prompts)])

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only these rows, in this order (between rounds)."""
        self.session.keep_rows(rows)
        self.pending = self.pending[torch.tensor(list(rows), dtype=torch.int64)]

    def score(self, draft_tokens: torch.Tensor, num_draft: Sequence[int] | None = None
              ) -> torch.Tensor:
        """Draft tokens [B, K] (K may be 0), of which row b holds num_draft[b] <= K (default:
        all K) -> target logits [B, K+1, V]; row b's columns past num_draft[b] are not
        predictions of its draft and must not be read as such."""
        num_rows, width = draft_tokens.shape
        counts = [width] * num_rows if num_draft is None else as_ints(num_draft)
        assert len(counts) == num_rows and all(0 <= k <= width for k in counts)
        tokens = torch.cat([self.pending.to(draft_tokens.device), draft_tokens], dim=1)
        if self._ragged is not None and any(k < width for k in counts):
            self._num_scored = counts
            return self._ragged.extend_ragged(tokens, [k + 1 for k in counts])
        self._num_scored = [width] * num_rows
        return self.session.extend(tokens)

    def commit(self, num_accepted: Sequence[int], next_tokens: Sequence[int]) -> None:
        """Keep the accepted prefix of the last scored draft; next_tokens [B] becomes pending.
        Both are host ints, one per row (a list or a 1-D tensor)."""
        num_accepted, next_tokens = as_ints(num_accepted), as_ints(next_tokens)
        assert all(n <= k for n, k in zip(num_accepted, self._num_scored))
        self.session.rewind([k - n for k, n in zip(self._num_scored, num_accepted)])
        self.pending = torch.tensor(next_tokens, dtype=torch.int64)[:, None]  # [B, 1]


def _pending(prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Each prompt's last token: [B, 1] int64 (B may be 0)."""
    return torch.tensor([p[-1] for p in prompts], dtype=torch.int64).reshape(len(prompts), 1)
