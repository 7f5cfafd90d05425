"""A lookup first, the draft model where it finds too little: one proposer.

Legend: B batch, K draft tokens, V vocabulary.

What it is: each round, every row's history is looked up, by prompt lookup (:mod:`.ngram`,
the default: the last 2-3 tokens) or by the suffix drafter (:mod:`.suffix`). Then, by
``chain``:

  * off (the default): when every row that drafts finds a continuation, the round proposes
    the lookups (deterministic, ``draft_probs`` None, verified as point masses, no draft step
    at all); otherwise the draft model drafts k_b tokens for every row (with the exact
    distributions they were sampled from, verified with the p/q test). In a batch, one row
    without a match is enough for a draft-model round.
  * on: each row proposes its lookup, then, where the lookup found fewer than its k_b tokens
    (none, or a match that ends or stops being frequent enough), the draft model's tokens
    after it, up to k_b in all, in one round (DraftModelSession.propose_after: the first
    step feeds the lookup's tokens). A round where every row's lookup fills its k_b is a
    lookup round as above. Not under a grammar, whose rows advance together: a round with a
    constraint chooses as with chain off.

Either way the round is exact: a lookup's tokens are verified as point masses (one-hot rows of
draft_probs where the round mixes them with the model's), the model's with the distributions
they were drawn from; each is a function of the context and the draft tokens before it.

Why: a lookup costs ~nothing (c ~ 0) but only exists where text repeats; a draft model always
proposes but costs k draft steps. Repetitive stretches (code, quoting, loops, edits that copy
the prompt) go at the lookup's price, the rest at the draft model's acceptance; chained, a
copy that ends mid-round is continued by the model instead of ending the draft.

Bookkeeping: both sub-sessions see every committed token. The draft model's cache simply lags
through lookup rounds (its ``unfed`` tokens grow) and catches up in one forward pass the next
time it drafts; the lookup's index is appended the tokens a draft-model round committed (a
suffix drafter also learns how the lookup part of a chained round fared).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config import HYBRID_LOOKUPS
from ..errors import ConfigError
from ..models.base import as_ints
from .base import DraftPlan, LookupSession, Proposal, RoundConstraint
from .draft_model import DraftModelProposer, DraftModelSession
from .ngram import NgramDraft, NgramSession
from .suffix import SuffixDraft, SuffixProposer

# A suffix of 2-3 tokens, not 1: a lone repeated token is a weak hint where a draft model is
# at hand, accepted less often than the draft model's tokens, which costs most when sampling
# (dev/LOG.md: HYBRID_LOOKUP).
HYBRID_LOOKUP = NgramDraft(min_ngram=2, max_ngram=3)

LOOKUP, DRAFT, CHAINED = "lookup", "draft", "chained"  # the kinds of round


def lookup_named(name: str) -> NgramDraft | SuffixDraft:
    """The lookup settings ``--hybrid-lookup NAME`` (config.HYBRID_LOOKUPS) stands for: ngram,
    HYBRID_LOOKUP; suffix, the suffix drafter's defaults."""
    if name not in HYBRID_LOOKUPS:
        raise ConfigError(f"hybrid_lookup={name!r} is invalid: expected "
                          f"{' or '.join(HYBRID_LOOKUPS)}.")
    return HYBRID_LOOKUP if name == "ngram" else SuffixDraft()


class HybridProposer:
    """Proposes by lookup where it finds enough, else by the draft model (module docstring).
    ``config``: the lookup's settings, NgramDraft (prompt lookup) or SuffixDraft (the suffix
    drafter, whose pool of finished sequences its sessions share); ``chain``: a row's lookup
    may be continued by the draft model in the same round (``--hybrid-chain``)."""

    def __init__(self, draft: DraftModelProposer,
                 config: NgramDraft | SuffixDraft = HYBRID_LOOKUP, chain: bool = False) -> None:
        self.draft = draft
        self.config = config
        self.chain = chain
        self.vocab_size = draft.vocab_size
        self.device = draft.device
        self.max_positions = draft.max_positions
        self._suffix = (SuffixProposer(draft.vocab_size, config)
                        if isinstance(config, SuffixDraft) else None)

    @property
    def num_captured(self) -> int:
        """The draft model's captured steps (models.base.CapturesSteps)."""
        return self.draft.num_captured

    def start(self, prompts: Sequence[Sequence[int]]) -> HybridSession:
        lookup = (NgramSession(prompts, self.config) if self._suffix is None
                  else self._suffix.start(prompts))
        return HybridSession(self.draft.start(prompts), lookup, self.chain)


class HybridSession:
    """One generation: a draft-model session and a lookup session kept on the same tokens."""

    def __init__(self, draft: DraftModelSession, lookup: LookupSession,
                 chain: bool = False) -> None:
        self.draft = draft
        self.lookup = lookup
        self.chain = chain
        self._proposal: list[list[int]] | None = None  # this round's [B][K] host rows
        self._kind: str | None = None  # this round's kind (None: no proposal)
        self._found: list[int] = []  # this round's lookup tokens per row
        self.num_ngram_rounds = 0  # rounds proposed by lookup alone / by the draft model alone
        self.num_draft_rounds = 0
        self.num_chained_rounds = 0  # rounds where some row's lookup the model continued

    def add_rows(self, prompts: Sequence[Sequence[int]], defer: bool = False) -> None:
        self.draft.add_rows(prompts, defer)
        self.lookup.add_rows(prompts)

    def keep_rows(self, rows: Sequence[int]) -> None:
        self.draft.keep_rows(rows)
        self.lookup.keep_rows(rows)

    def catch_up(self) -> None:
        self.draft.catch_up()
        self.lookup.catch_up()

    def propose(self, plan: DraftPlan, constraint: RoundConstraint | None = None) -> Proposal:
        """The lookups (draft_probs None) where they fill the round, else the draft model's
        tokens: after each row's lookup (chained), or instead of them."""
        found = self.lookup.lookup(plan.num_draft_tokens)
        self._found = [len(tokens) for tokens in found]
        self._kind = self._round_kind(found, plan.num_draft_tokens, constraint)
        if self._kind == LOOKUP:
            self.num_ngram_rounds += 1
            proposal = self.lookup.propose_found(found)
        elif self._kind == CHAINED:
            self.num_chained_rounds += 1
            proposal = self.draft.propose_after(plan, found)
        else:
            self.num_draft_rounds += 1
            proposal = self.draft.propose(plan, constraint)
        self._proposal = proposal.draft_tokens.tolist()
        return proposal

    def _round_kind(self, found: list[list[int]], num_draft_tokens: Sequence[int],
                    constraint: RoundConstraint | None) -> str:
        """LOOKUP where every row that drafts has a lookup (chained: one that fills its k_b),
        CHAINED where some row has a lookup the model must continue, else DRAFT."""
        if not (self.chain and constraint is None):
            return LOOKUP if all(tokens or not k for tokens, k in zip(found, num_draft_tokens)
                                 ) else DRAFT
        if all(len(tokens) >= k for tokens, k in zip(found, num_draft_tokens)):
            return LOOKUP
        return CHAINED if any(found) else DRAFT

    def commit(self, num_accepted: Sequence[int], next_tokens: Sequence[int]) -> None:
        num_accepted, next_tokens = as_ints(num_accepted), as_ints(next_tokens)
        proposal = self._proposal or [[] for _ in next_tokens]
        kind, self._proposal, self._kind = self._kind, None, None
        committed = [drafted[:n] + [token]
                     for drafted, n, token in zip(proposal, num_accepted, next_tokens)]
        if kind == LOOKUP:  # the draft model did not see this round: it lags by these tokens
            self.lookup.commit(num_accepted, next_tokens)
            self.draft.append_committed(committed)
            return
        self.draft.commit(num_accepted, next_tokens)
        if kind == CHAINED:
            self.lookup.commit_chained(self._found, num_accepted, committed)
        else:
            self.lookup.append_committed(committed)
