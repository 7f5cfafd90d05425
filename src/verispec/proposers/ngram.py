"""An n-gram (prompt lookup) proposer: draft the tokens that followed the latest earlier
occurrence of the sequence's last n tokens. No model, no random numbers.

Legend: B batch, K draft tokens.

What it is: the "prompt lookup decoding" idea (Saxena 2023; transformers'
``prompt_lookup_num_tokens``): text that repeats itself (code, edits, extraction, a small model
looping) often continues the way it did before. For each row it looks for the longest suffix of
``max_ngram`` down to ``min_ngram`` tokens that occurred earlier in the row's prompt + output,
takes the most recent such occurrence, and proposes the up to k tokens that followed it.

What it is not: a distribution. A proposal is deterministic, so ``draft_probs`` is None and
verification treats it as a point mass (accept token x with probability p_target(x); on a
rejection draw from the target with x removed): exact at any temperature, never a p/q ratio.

Cost: one dict lookup per n per row and round (an index of every n-gram's latest end position,
updated as tokens are committed), so its draft cost c is ~0 and the target's pass over the
proposal follows the previous pass with no draft steps in between.

Ragged rows: a row with a shorter match (or none) is padded to the batch's longest proposal with
its last committed token; the proposal says how many tokens each row found (num_proposed), and
only those are verified. A batch where no row matches proposes nothing: that round is a plain
decoding step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..config import is_int
from ..errors import ConfigError
from .base import DraftPlan, LookupSession, Proposal, RoundConstraint


@dataclass(frozen=True)
class NgramDraft:
    """Settings of the n-gram (prompt-lookup) proposer, NgramProposer: the lengths of the
    history's suffix looked up, longest first. ``load(draft=NgramDraft())`` drafts by lookup
    alone; ``load(hybrid=NgramDraft(...))`` sets a hybrid's lookup."""

    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        lo, hi = self.min_ngram, self.max_ngram
        if not (is_int(lo) and is_int(hi) and 1 <= lo <= hi <= 16):
            raise ConfigError(f"min_ngram={lo!r}, max_ngram={hi!r} are invalid: expected integers "
                              "with 1 <= min_ngram <= max_ngram <= 16.")


class NgramProposer:
    """Proposes continuations copied from earlier in each row's own token sequence."""

    def __init__(self, vocab_size: int, config: NgramDraft = NgramDraft()) -> None:
        self.vocab_size = vocab_size
        self.device = None  # no model: host tokens, no probs
        self.max_positions = None  # no model, no window
        self.config = config

    def start(self, prompts: Sequence[Sequence[int]]) -> NgramSession:
        return NgramSession(prompts, self.config)


class _RowIndex:
    """One row's tokens and, per n, each n-gram's latest end position that has a successor."""

    def __init__(self, tokens: Sequence[int], config: NgramDraft) -> None:
        self.config = config
        self.tokens: list[int] = []
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> end position e (t[e+1] exists)
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        # the n-grams ending at the current last position now have a successor: index them
        end = len(self.tokens) - 1
        for n in range(self.config.min_ngram, self.config.max_ngram + 1):
            if end - n + 1 >= 0:
                self.latest[tuple(self.tokens[end - n + 1: end + 1])] = end
        self.tokens.append(token)

    def lookup(self, num_tokens: int) -> list[int]:
        """Up to num_tokens that followed the latest earlier occurrence of the longest suffix."""
        length = len(self.tokens)
        for n in range(min(self.config.max_ngram, length), self.config.min_ngram - 1, -1):
            end = self.latest.get(tuple(self.tokens[length - n:]))
            if end is not None:
                return self.tokens[end + 1: end + 1 + num_tokens]
        return []


class NgramSession(LookupSession):
    """One generation's n-gram state: each row's committed tokens and their index."""

    def __init__(self, prompts: Sequence[Sequence[int]], config: NgramDraft) -> None:
        self.config = config
        self.rows = [_RowIndex(list(prompt), config) for prompt in prompts]

    def add_rows(self, prompts: Sequence[Sequence[int]], defer: bool = False) -> None:
        """Rows join (``defer`` changes nothing: indexing a prompt is cheap host work)."""
        self.rows += [_RowIndex(list(prompt), self.config) for prompt in prompts]

    def keep_rows(self, rows: Sequence[int]) -> None:
        self.rows = [self.rows[row] for row in rows]

    def catch_up(self) -> None:
        """Nothing to do: the lookup index takes each committed token as it comes."""

    def propose(self, plan: DraftPlan, constraint: RoundConstraint | None = None) -> Proposal:
        """Up to ``plan.num_draft_tokens[b]`` for row b (fewer, or none, where the history is
        short of a match); deterministic: draft_probs None. The plan's samplings and generators
        are not used, nor ``constraint``: the engine cuts a lookup where it leaves the grammar
        (ConstraintSet.cover)."""
        assert plan.num_steps >= 1
        return self.propose_found(self.lookup(plan.num_draft_tokens))

    def lookup(self, num_draft_tokens: Sequence[int]) -> list[list[int]]:
        """Each row's match: up to num_draft_tokens[b] host ids, [] where the history has none."""
        return [row.lookup(k) if k else [] for row, k in zip(self.rows, num_draft_tokens)]
