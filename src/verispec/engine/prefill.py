"""A long prompt's prefill spread over several rounds (chunked prefill), so that a batch's
running rows do not wait for all of it at once.

Between two rounds a batch prefills at most a budget of prompt tokens
(BatchOptions.prefill_budget, ``--prefill-budget``; text/admission.py decides what joins). A
prompt longer than that must not be prefilled whole in one gap: that stalls every running row for
the whole prompt's pass (on a large model, for seconds). A :class:`ChunkedPrefill` feeds the
prompt into a cache of its own, a budget's worth of tokens per gap (:meth:`advance`), while the
batch goes on running rounds; once all of it is in, the row joins (``Batch.add(prefilled=...)``)
and the batch's target session copies that cache into a free slot (``AdoptsRows.adopt_rows``), a
copy rather than a pass. The draft, when there is one, prefills the prompt at the join as for any
row (it is the small model, and a batch running plain rounds defers even that).

What it is not: a way to start decoding before the prompt is in, or a split of the prompt's
attention. Feeding a prompt in pieces leaves exactly the cache one pass would have (the
backends' ``feed`` contract, up to the summation order of the matmuls: the tests check greedy
text against the prompt joining whole).

Backends that cannot adopt a row (llama.cpp, whose model holds one live session, and the test
fixtures) get None from ``Batch.start_prefill``: their long prompts are prefilled whole, in one
gap.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..models.base import LanguageModel


class ChunkedPrefill:
    """One prompt's target prefill, fed ``advance(n)`` tokens at a time into a one-row session
    of its own. The cache ends holding the prompt but its last token, which the row's first
    round feeds (engine.scorer.TargetScorer's invariant)."""

    def __init__(self, target: LanguageModel, prompt_ids: Sequence[int]) -> None:
        self.prompt_ids = list(prompt_ids)
        self.session = target.new_session()
        self.session.start([[]])
        self._to_feed = self.prompt_ids[:-1]  # the cache's share of the prompt
        self._fed = 0

    @property
    def num_remaining(self) -> int:
        return len(self._to_feed) - self._fed

    @property
    def done(self) -> bool:
        return self.num_remaining == 0

    def advance(self, max_tokens: int) -> int:
        """Feed up to ``max_tokens`` more of the prompt; returns how many were fed."""
        chunk = self._to_feed[self._fed : self._fed + max(0, max_tokens)]
        if chunk:
            self.session.feed([chunk])
            self._fed += len(chunk)
        return len(chunk)
