"""N-gram lookup first, the draft model where the history has no match: one proposer.

Legend: B batch, K draft tokens, V vocabulary.

What it is: each round, every row's history is looked up as in :mod:`.ngram`; when every row
finds a continuation, the round proposes it (deterministic, ``draft_probs`` None, verified
as a point mass, no draft step at all); otherwise the draft model drafts k tokens (with the
exact distributions they were sampled from, verified with the p/q test). Either way the round
is exact: each round's proposal is verified by the rule of the proposer that made it.

Why: an n-gram proposal costs ~nothing (c ~ 0) but only exists where text repeats; a draft
model always proposes but costs k draft steps. Repetitive stretches (code, quoting, loops) go at
the n-gram's price, the rest at the draft model's acceptance. In a batch, one row without a
match is enough for a draft-model round (one verification rule per round); finished rows keep
their history and take part like the others.

Bookkeeping: both sub-sessions see every committed token. The draft model's cache simply lags
through n-gram rounds (its ``unfed`` tokens grow) and catches up in one forward pass the next
time it drafts; the n-gram index is appended the tokens a draft-model round committed.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..models.base import as_ints
from .base import DraftPlan, Proposal, RoundConstraint
from .draft_model import DraftModelProposer, DraftModelSession
from .ngram import NgramDraft, NgramSession


# A suffix of 2-3 tokens, not 1: a lone repeated token is a weak hint where a draft model is
# at hand, accepted less often than the draft model's tokens, which costs most when sampling
# (dev/LOG.md: HYBRID_LOOKUP).
HYBRID_LOOKUP = NgramDraft(min_ngram=2, max_ngram=3)


class HybridProposer:
    """Proposes by n-gram lookup where every row has a match, else by the draft model."""

    def __init__(self, draft: DraftModelProposer, config: NgramDraft = HYBRID_LOOKUP) -> None:
        self.draft = draft
        self.config = config
        self.vocab_size = draft.vocab_size
        self.device = draft.device
        self.max_positions = draft.max_positions

    @property
    def num_captured(self) -> int:
        """The draft model's captured steps (models.base.CapturesSteps)."""
        return self.draft.num_captured

    def start(self, prompts: Sequence[Sequence[int]]) -> HybridSession:
        return HybridSession(self.draft.start(prompts), NgramSession(prompts, self.config))


class HybridSession:
    """One generation: a draft-model session and an n-gram session kept on the same tokens."""

    def __init__(self, draft: DraftModelSession, ngram: NgramSession) -> None:
        self.draft = draft
        self.ngram = ngram
        self._proposal: list[list[int]] | None = None  # this round's [B][K] host rows
        self._by_ngram = False
        self.num_ngram_rounds = 0  # rounds proposed by lookup / by the draft model
        self.num_draft_rounds = 0

    def add_rows(self, prompts: Sequence[Sequence[int]], defer: bool = False) -> None:
        self.draft.add_rows(prompts, defer)
        self.ngram.add_rows(prompts)

    def keep_rows(self, rows: Sequence[int]) -> None:
        self.draft.keep_rows(rows)
        self.ngram.keep_rows(rows)

    def catch_up(self) -> None:
        self.draft.catch_up()
        self.ngram.catch_up()

    def propose(self, plan: DraftPlan, constraint: RoundConstraint | None = None) -> Proposal:
        """n-gram tokens (draft_probs None) if every row that drafts this round has a match,
        else the draft model's."""
        found = self.ngram.lookup(plan.num_draft_tokens)
        self._by_ngram = all(match or not k for match, k in zip(found, plan.num_draft_tokens))
        if self._by_ngram:
            self.num_ngram_rounds += 1
            proposal = self.ngram.propose_found(found)
        else:
            self.num_draft_rounds += 1
            proposal = self.draft.propose(plan, constraint)
        self._proposal = proposal.draft_tokens.tolist()
        return proposal

    def commit(self, num_accepted: Sequence[int], next_tokens: Sequence[int]) -> None:
        num_accepted, next_tokens = as_ints(num_accepted), as_ints(next_tokens)
        proposal = self._proposal or [[] for _ in next_tokens]
        self._proposal = None
        committed = [drafted[:n] + [token]
                     for drafted, n, token in zip(proposal, num_accepted, next_tokens)]
        if self._by_ngram:  # the draft model did not see this round: it lags by these tokens
            self.ngram.commit(num_accepted, next_tokens)
            self.draft.append_committed(committed)
        else:
            self.draft.commit(num_accepted, next_tokens)
            self.ngram.append_committed(committed)
        self._by_ngram = False
