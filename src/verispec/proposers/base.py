"""The proposer protocol: draft k tokens, then learn which were kept.

Legend: B batch, K draft tokens, V vocabulary.

Contract of a :class:`Proposal`: ``draft_probs`` are exactly the fp32 distributions the draft
tokens were drawn from, after the same temperature / top-k / top-p processing the target gets
(verispec.sample.sampling.to_probs); ``None`` means the proposal is deterministic (greedy, n-gram)
and is verified as a point mass. A deterministic position within a drawn proposal (a lookup's
token before a draft model's, proposers/hybrid.py) carries its point mass, a one-hot row. A
proposer that reports any other distribution silently breaks the exactness of speculative
sampling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from ..config import SamplingConfig
from ..models.base import as_ints
from ..sample.seeded import RaceClocks


@dataclass(frozen=True)
class Proposal:
    """draft_tokens [B, K] int64; draft_probs [B, K, V] fp32 or None (deterministic).
    num_proposed: the tokens row b really proposes (its first num_proposed[b]; the rest is
    padding the engine does not verify), B host ints <= K; None: K for every row.
    faults: the rows whose drafting failed on a fault of their own (non-finite draft logits,
    their processor's error), each with its error: they propose 0 tokens and the engine fails
    them; their batch mates drew what they would have (run_isolated)."""

    draft_tokens: torch.Tensor
    draft_probs: torch.Tensor | None
    num_proposed: list[int] | None = None
    faults: dict[int, Exception] = field(default_factory=dict)


@dataclass(frozen=True)
class DraftPlan:
    """What each row drafts in one round: k_b tokens, sampled under its own settings with its
    own generator. Rows may share a generator (one generation's batch under one seed); each
    group of rows sharing one draws its random numbers together
    (sample.sampling.draw_step_uniforms), so a row with a generator of its own draws the same
numbers whatever else is in the batch.

    num_draft_tokens: B ints >= 0, at least one >= 1 (a row past its k_b drafts padding that
    is not verified, and draws nothing); samplings, generators: one per row.
    keyed: per row, None or its position-keyed clocks (a seeded sampled row, sample/seeded.py): a
    sampling draft then draws each of the row's tokens by a race on the clocks of its position
    instead of from the generator (the row is verified by comparison with the target's race
    winner, so the draft's probs are not used for it). None: no keyed rows.
    processors: per row, None or what reshapes its logits by penalties, logit bias and
    min_new_tokens' stop-token ban (a LogitProcessor: the engine's row): a draft model processes
    each step's logits as the target's position there will be, so that it proposes what the
    processed target would and reports the distribution it drew from. None: no row has one.
    """

    num_draft_tokens: list[int]
    samplings: list[SamplingConfig]
    generators: list[torch.Generator]
    keyed: list[KeyedClocks | None] | None = None
    processors: list[LogitProcessor | None] | None = None

    @classmethod
    def uniform(cls, num_rows: int, num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator) -> DraftPlan:
        """Every row drafts the same k under the same settings from one generator."""
        return cls([num_draft_tokens] * num_rows, [sampling] * num_rows, [generator] * num_rows)

    @property
    def num_steps(self) -> int:
        return max(self.num_draft_tokens)


R = TypeVar("R")


def run_isolated(rows: Sequence[int], run: Callable[[list[int]], R],
                 on_fault: Callable[[int, Exception], None]) -> list[tuple[list[int], R]]:
    """``run`` over a batch's ``rows`` in one call or, where that call raises, over each row
    alone: [(rows, run(rows))] for the parts that ran; a row that raises alone goes to
    ``on_fault`` with its own error and is left out. What keeps one row's fault (non-finite
    logits, a rule's arithmetic) from failing its batch mates, at no cost while nothing
    fails: a row's result does not depend on the rows computed with it, so each row alone
    gets what the whole call would have given it. Only for work that draws no random numbers
    (running a row again would draw them again). Example: rows [0, 1, 2] where row 1's logits
    are NaN -> the call raises; [([0], run([0])), ([2], run([2]))], on_fault(1, its error)."""
    rows = list(rows)
    if not rows:
        return []
    try:
        return [(rows, run(rows))]
    except Exception as exc:  # some row's fault: each row alone finds which
        if len(rows) == 1:
            on_fault(rows[0], exc)
            return []
    parts = []
    for row in rows:
        try:
            parts.append(([row], run([row])))
        except Exception as exc:  # this row's own fault: it alone fails
            on_fault(row, exc)
    return parts


class KeyedClocks(Protocol):
    """A seeded row's clocks by round step (engine.rows.Row): step j is its new token
    num_generated + j."""

    def clocks(self, step: int, vocab_size: int) -> RaceClocks:
        """The clocks of the row's position ``step`` of this round."""


class LogitProcessor(Protocol):
    """A row's penalties, logit bias and stop-token ban (engine.rows.Row.process_draft)."""

    def process_draft(self, logits: torch.Tensor, drafted: Sequence[int]) -> torch.Tensor:
        """One draft step's logits [V] after this round's draft tokens ``drafted`` -> the
        processed logits [V] fp32 (the target's at position len(drafted), sample/penalties.py)."""


class RoundConstraint(Protocol):
    """A grammar's view of one round (engine.constraints.ConstraintSet): the allowed tokens at the
    current draft depth, and the draft tokens that extend it."""

    def allowed(self) -> torch.Tensor:
        """[B, V] bool: the tokens the next draft token may be."""

    def advance(self, tokens: Sequence[int]) -> None:
        """One drawn draft token per row (host ints)."""


class ProposerSession(Protocol):
    """A batch's proposer state, synchronised with each row's committed sequence; rows join
    (``add_rows``) and leave (``keep_rows``) between rounds, as the target's session's do."""

    def propose(self, plan: DraftPlan, constraint: RoundConstraint | None = None) -> Proposal:
        """Draft up to ``plan.num_draft_tokens[b]`` tokens for each row b after its committed
        sequence: a [B, K] proposal with K <= plan.num_steps (a draft model gives all of them
        unless its confidence floor ends a row's draft sooner; a lookup may find fewer; K = 0
        makes the round a plain decoding step).
        A sampling proposer given a ``constraint`` draws each token under
        ``constraint.allowed()`` and reports it with ``advance``; a deterministic one may
        ignore it (the engine checks and cuts its tokens)."""

    def add_rows(self, prompts: Sequence[Sequence[int]], defer: bool = False) -> None:
        """New rows at the end of the batch, each with its committed sequence (>= 1 token).
        ``defer``: the batch is decoding plain rounds and may not propose for a while, so a
        proposer with per-row state may postpone the prompts' work to its next propose (a
        draft model then feeds them there, with the tokens of the plain rounds)."""

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only these rows, in this order; between rounds only."""

    def catch_up(self) -> None:
        """Before a proposal that follows plain rounds: do the work those rounds left (a draft
        model feeds their tokens, and deferred prompts), so that the proposal itself costs
        what its k steps cost. The batch calls it outside the round's draft timing, which the
        depth policy prices per step (engine.batch.Batch.step)."""

    def commit(self, num_accepted: Sequence[int], next_tokens: Sequence[int]) -> None:
        """num_accepted [B] of the last proposal were kept, then next_tokens [B] was appended;
        host ints, one per row. Called every round, also rounds where propose was not called
        (num_accepted is then 0)."""


class Proposer(Protocol):
    """Opens a :class:`ProposerSession` per generation. ``vocab_size`` must equal the target's;
    ``device``, where draft_probs live, must be the target's (None: a proposer with no model,
    whose proposals carry no probs; it may leave the attribute out). ``max_positions``: the
    longest sequence its model takes (None: no limit, or no model); a round drafts no deeper
    than every row's room in it and the target's."""

    vocab_size: int
    device: torch.device | None
    max_positions: int | None

    def start(self, prompts: Sequence[Sequence[int]]) -> ProposerSession:
        """A session over these rows' committed sequences (each >= 1 token; [] for none yet)."""


class HostRow(Protocol):
    """A model-free proposer's row: its committed host tokens, and the call that indexes one."""

    tokens: list[int]

    def append(self, token: int) -> None:
        """Index one committed token."""


class LookupSession:
    """What model-free (deterministic) proposer sessions share: host rows, proposals made of
    host ids padded to the longest (num_proposed says how many each row found) and commits
    that index the kept tokens. A subclass sets ``self.rows`` and finds each row's draft."""

    rows: list[HostRow]
    _proposal: list[list[int]] | None = None  # this round's [B][K] host rows

    def propose_found(self, found: list[list[int]]) -> Proposal:
        """The proposal made of ``found`` (each row's draft, [] for none), short rows padded
        with their last token (the padding is not verified)."""
        width = max(map(len, found))
        self._proposal = [draft + [row.tokens[-1]] * (width - len(draft))
                          for draft, row in zip(found, self.rows)]
        draft_tokens = torch.tensor(self._proposal, dtype=torch.int64).reshape(len(found), width)
        return Proposal(draft_tokens, None, [len(draft) for draft in found])  # [B, K]

    def commit(self, num_accepted: Sequence[int], next_tokens: Sequence[int]) -> None:
        num_accepted, next_tokens = as_ints(num_accepted), as_ints(next_tokens)
        proposal = self._proposal or [[] for _ in self.rows]
        self._proposal = None
        self.append_committed([drafted[:n] + [token] for drafted, n, token
                               in zip(proposal, num_accepted, next_tokens)])

    def commit_chained(self, num_found: Sequence[int], num_accepted: Sequence[int],
                       committed: Sequence[Sequence[int]]) -> None:
        """Index the tokens committed ([B][*] host ids) after a round whose proposal began
        with num_found[b] of this session's tokens for row b and went on with another
        proposer's (proposers/hybrid.py, chained); num_accepted [B] of the whole proposal were
        kept. A session that learns from its drafts' fate overrides it."""
        self.append_committed(committed)

    def append_committed(self, committed: Sequence[Sequence[int]]) -> None:
        """Index tokens committed without a proposal of this session's: [B][*] host ids."""
        for row, tokens in zip(self.rows, committed):
            for token in tokens:
                row.append(token)
