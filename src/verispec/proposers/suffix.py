"""A suffix-decoding proposer: draft the most frequent continuation of the longest suffix of the
sequence that occurred before, in the row's own history or in earlier sequences. No model, no
random numbers.

Legend: B batch, K draft tokens, m the length of the matched suffix.

Reference: Oliaro et al. 2024, "SuffixDecoding: A Model-Free Approach to Speeding Up Large
Language Model Inference". Per row and round:

  1. match: the longest suffix of the row's sequence (m <= ``max_match`` tokens) that occurred
     earlier followed by at least one token, in the row's own prompt + output or in the pool of
     sequences that left earlier; the row's own history wins at equal length. m below the
     length the row needs (``min_match``, doubled after each draft rejected at its first
     token, and times the number of rows in the round: a draft widens the pass every row of
     the batch waits for): no draft.
  2. draft: walk the continuation token by token, each time taking the token that most of the
     matched context's occurrences still on the path continue with (ties: the most recent),
     up to min(k_b, ``max_depth``, the row's budget, floor(m * ``factor``)) tokens (the
     paper's adaptive length alpha * p: a longer match earns a deeper draft; the budget starts
     at ``first_depth`` and doubles while whole drafts are kept), and stop before a token that
     fewer than ``min_confidence`` of the context's occurrences continue with (the paper's path
     score: the product of the continuation frequencies along it).

What it is not: a literal suffix tree. Each source (a row, the pool) keeps, for a few suffix
lengths L (min_match, 2 min_match, 4 min_match, ... and max_match), the latest end position of
every L-gram followed by a token, and per position the previous end of the same L-gram: a chain
of occurrences, newest first. A match takes one dict lookup per indexed length, longest first,
then compares the latest occurrences of the longest L-gram found token by token to find m and
the occurrences of the m-token context; a committed token costs one dict update per indexed
length. Frequencies are counted among the latest MAX_OCCURRENCES occurrences, not all of them.

Nor a distribution: a proposal is deterministic, so ``draft_probs`` is None and verification
treats it as a point mass, exact at any temperature (as :mod:`.ngram`).

Pool: the sequences of the rows that left any session of one :class:`SuffixProposer` (a row
dropped by ``keep_rows``, or every row at ``close``), its prompt and its output, bounded by
``pool_tokens`` and evicted oldest first. Sessions of one proposer may run in different threads:
the pool is read and written under a lock.

Ragged rows: as :mod:`.ngram`, a shorter proposal is padded with the row's last committed token
and num_proposed says how many tokens each row found; K = 0 when no row drafts.
"""

from __future__ import annotations

import math
import threading
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from ..config import MAX_NUM_DRAFT_TOKENS, check_int, check_number, is_int, require
from ..errors import ConfigError
from ..models.base import as_ints
from .base import DraftPlan, LookupSession, Proposal, RoundConstraint

# Frequencies come from the matched context's latest occurrences only: where a short context
# recurs thousands of times, a round then costs the same as where it occurred twice.
MAX_OCCURRENCES = 32

# Ends each pooled sequence (and opens the pool): no token id equals it, so no match or
# continuation crosses from one sequence into the next.
_SEPARATOR = -1


@dataclass(frozen=True)
class SuffixDraft:
    """Settings of the suffix proposer.

    max_depth: the most tokens a row drafts in one round (the round's k_b caps it further).
    first_depth: the most tokens a row's first draft may have; a draft kept whole doubles the
    next one's limit, up to max_depth, a draft rejected at its first token sets it back here
    and doubles the match length the next draft needs, up to max_match.
    factor: a match of m tokens drafts at most floor(m * factor) tokens.
    min_match: no draft where the longest suffix that occurred before is shorter.
    max_match: the longest suffix compared.
    min_confidence: stop the draft before a token that fewer than this share of the matched
    context's occurrences continue with (a context that occurred once drafts while it goes on).
    pool_tokens: the most tokens of finished sequences kept for all sessions (0: no pool).
    """

    max_depth: int = 32
    first_depth: int = 8
    factor: float = 1.0
    # Shorter matches were right about half the time on chat answers, and where a pass over a
    # few more tokens costs nearly a token each (quantized llama.cpp on a CPU) a draft right
    # half the time loses; see dev/LOG.md (2026-11-27, the suffix drafter)
    min_match: int = 4
    max_match: int = 32
    min_confidence: float = 0.5
    pool_tokens: int = 1 << 16

    def __post_init__(self) -> None:
        check_int("max_depth", self.max_depth, 1, MAX_NUM_DRAFT_TOKENS, note=", e.g. 32")
        require(is_int(self.first_depth) and 1 <= self.first_depth <= self.max_depth,
                "first_depth", self.first_depth,
                f"an integer from 1 to max_depth ({self.max_depth}), e.g. 8")
        check_number("factor", self.factor, 0, math.inf, low_open=True, note=", e.g. 1.0")
        lo, hi = self.min_match, self.max_match
        if not (is_int(lo) and is_int(hi) and 1 <= lo <= hi <= 64):
            raise ConfigError(f"min_match={lo!r}, max_match={hi!r} are invalid: expected integers "
                              "with 1 <= min_match <= max_match <= 64, e.g. 4 and 32.")
        check_number("min_confidence", self.min_confidence, 0, 1, note=", e.g. 0.5")
        check_int("pool_tokens", self.pool_tokens, 0, note=" (0 disables the pool), e.g. 65536")

    def indexed_lengths(self) -> tuple[int, ...]:
        """The suffix lengths indexed, longest first: max_match, then min_match doubled down."""
        lengths, length = {self.max_match}, self.min_match
        while length < self.max_match:
            lengths.add(length)
            length *= 2
        return tuple(sorted(lengths, reverse=True))


class _SuffixIndex:
    """Tokens and, per indexed length L, each L-gram's latest end position e with a successor
    (t[e+1] exists) and, per position, the previous end of the same L-gram (-1: none)."""

    def __init__(self, lengths: tuple[int, ...]) -> None:
        self.lengths = lengths  # longest first
        self.tokens: list[int] = []
        # keyed by hash(tuple(L-gram)): a collision costs one wasted comparison (occurrences
        # are compared token by token), never a wrong match
        self.latest: list[dict[int, int]] = [{} for _ in lengths]
        self.previous = [array("q") for _ in lengths]  # [L][position]

    def index_end(self, end: int, first: int) -> None:
        """Index the L-grams ending at ``end`` that start at ``first`` or later; every
        position gets a chain entry, in order."""
        tokens = self.tokens
        for length, latest, previous in zip(self.lengths, self.latest, self.previous):
            if end - length + 1 >= first:
                key = hash(tuple(tokens[end - length + 1: end + 1]))
                previous.append(latest.get(key, -1))
                latest[key] = end
            else:
                previous.append(-1)

    def longest_match(self, query: list[int], max_match: int,
                      base: int = 0) -> tuple[int, list[int]]:
        """(m, ends): the longest suffix of ``query`` (the shortest indexed length <= m <=
        max_match) that occurs here followed by a token, and the end positions of its latest
        occurrences (newest first, at most MAX_OCCURRENCES); (0, []) if none. ``base``:
        positions below it are gone (the pool's evicted sequences)."""
        tokens, size = self.tokens, len(query)
        for length, latest, previous in zip(self.lengths, self.latest, self.previous):
            if length > size:
                continue
            suffix = query[size - length:]
            end, ends = latest.get(hash(tuple(suffix)), -1), []
            while end >= base and len(ends) < MAX_OCCURRENCES:
                if tokens[end - length + 1: end + 1] == suffix:
                    ends.append(end)
                end = previous[end]
            if ends:
                reach = [self._extend(end, length, query, max_match) for end in ends]
                best = max(reach)
                return best, [end for end, r in zip(ends, reach) if r == best]
        return 0, []

    def _extend(self, end: int, length: int, query: list[int], max_match: int) -> int:
        """How far the occurrence ending at ``end``, known to match ``length`` tokens, matches
        the end of ``query`` (at most max_match tokens)."""
        tokens, last = self.tokens, len(query) - 1
        limit = min(max_match, last + 1, end + 1)
        while length < limit and tokens[end - length] == query[last - length]:
            length += 1
        return length

    def continuation(self, ends: list[int], limit: int, min_confidence: float) -> list[int]:
        """Up to ``limit`` tokens along the most frequent continuation of the occurrences
        ending at ``ends`` (ties: the most recent), while at least ``min_confidence`` of them
        continue with the whole path. An occurrence that runs into the end of a row's history
        continues with the path drafted so far (a loop drafts on around itself)."""
        tokens, size = self.tokens, len(self.tokens)
        needed = min_confidence * len(ends)
        path: list[int] = []
        alive = ends  # the occurrences that continued with the whole path, newest first
        while len(path) < limit:
            step = len(path) + 1
            nexts = [tokens[e + step] if e + step < size else path[e + step - size]
                     for e in alive]
            counts: dict[int, int] = {}
            for token in nexts:  # newest first: max() keeps the most recent of a tie
                counts[token] = counts.get(token, 0) + 1
            counts.pop(_SEPARATOR, None)
            if not counts:
                break
            best = max(counts, key=counts.__getitem__)
            if counts[best] < needed:
                break
            path.append(best)
            alive = [e for e, token in zip(alive, nexts) if token == best]
        return path


class _Pool:
    """Finished sequences for every session of one proposer: one index over them all, each
    sequence followed by a separator, the oldest evicted past ``pool_tokens`` tokens."""

    def __init__(self, config: SuffixDraft) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.sequences: deque[list[int]] = deque()
        self.num_tokens = 0  # the live sequences' tokens, separators not counted
        self._reindex([])

    def add(self, sequence: Sequence[int]) -> None:
        sequence = list(sequence[-self.config.pool_tokens:])
        with self.lock:
            self.sequences.append(sequence)
            self.num_tokens += len(sequence)
            self._index_sequence(sequence)
            while self.num_tokens > self.config.pool_tokens:
                evicted = self.sequences.popleft()
                self.num_tokens -= len(evicted)
                self.base += len(evicted) + 1
            # Evicted entries only stop chains: rebuild once they are most of the index, so
            # eviction costs about one more indexing of each pooled token.
            if self.base > len(self.index.tokens) // 2:
                self._reindex(list(self.sequences))

    def match(self, query: list[int], limit: int, row_match: int) -> tuple[int, list[int]]:
        """(m, up to ``limit`` drafted tokens) from the pool where its match is longer than
        ``row_match`` (the row's own), else (0, [])."""
        config = self.config
        with self.lock:
            length, ends = self.index.longest_match(query, config.max_match, self.base)
            if length <= row_match:
                return 0, []
            return length, self.index.continuation(ends, min(limit, int(length * config.factor)),
                                                   config.min_confidence)

    def _reindex(self, sequences: list[list[int]]) -> None:
        self.index = _SuffixIndex(self.config.indexed_lengths())
        self.index.tokens.append(_SEPARATOR)
        self.index.index_end(0, 1)
        self.base = 1  # the first live position
        for sequence in sequences:
            self._index_sequence(sequence)

    def _index_sequence(self, sequence: list[int]) -> None:
        index = self.index
        first = len(index.tokens)
        index.tokens += sequence
        separator = len(index.tokens)
        index.tokens.append(_SEPARATOR)
        for end in range(first, separator + 1):
            # an L-gram is indexed where a token of its own sequence follows it (first past
            # end: none of its L-grams is)
            index.index_end(end, first if end + 1 < separator else end + 1)


class _RowHistory:
    """One row's committed tokens (prompt + output) and their index."""

    def __init__(self, tokens: Sequence[int], config: SuffixDraft) -> None:
        self.config = config
        self.index = _SuffixIndex(config.indexed_lengths())
        self.tokens = self.index.tokens
        for token in tokens:
            self.append(token)
        # How the row's drafts fared so far sets the next one (observe): the match a draft
        # needs, and the most tokens it may have, which starts at first_depth and doubles while
        # whole drafts are kept (the slow start of a copy), so a row whose text only seemed to
        # repeat (sampled text leaving an earlier answer) wastes short drafts, not long ones.
        self.needed = config.min_match
        self.budget = config.first_depth

    def append(self, token: int) -> None:
        # the L-grams ending at the current last position now have a successor: index them
        if self.tokens:
            self.index.index_end(len(self.tokens) - 1, 0)
        self.tokens.append(token)

    def draft(self, num_tokens: int, pool: _Pool | None, num_rows: int = 1) -> list[int]:
        """Up to num_tokens drafted from the longest match, the row's own at equal length.
        In a round of ``num_rows`` rows the match must be num_rows times as long (up to
        max_match): a draft's tokens widen the pass every row waits for, so in a batch only
        long repeats pay."""
        config = self.config
        needed = min(self.needed * num_rows, config.max_match)
        limit = min(num_tokens, config.max_depth, self.budget)
        length, ends = self.index.longest_match(self.tokens, config.max_match)
        if pool is not None and length < config.max_match:
            pool_length, path = pool.match(self.tokens, limit, length)
            if pool_length >= needed:
                return path
        if length < needed:
            return []
        return self.index.continuation(ends, min(limit, int(length * config.factor)),
                                       config.min_confidence)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """The row's last draft of ``num_drafted`` tokens kept ``num_accepted``: a whole draft
        kept doubles the budget (up to max_depth) and asks only min_match again; a draft
        rejected at its first token doubles the match the next one needs (up to max_match)
        and sets the budget back to first_depth; a partly kept one sets the budget to what it
        kept (at least half of first_depth)."""
        config = self.config
        if num_accepted >= num_drafted:
            self.budget = min(2 * self.budget, config.max_depth)
            self.needed = config.min_match
        elif num_accepted == 0:
            self.needed = min(2 * self.needed, config.max_match)
            self.budget = config.first_depth
        else:
            self.budget = min(max(num_accepted, config.first_depth // 2, 1), config.max_depth)


class SuffixProposer:
    """Proposes the most frequent continuation of the longest earlier suffix match; the pool
    of finished sequences is shared by every session it starts."""

    def __init__(self, vocab_size: int, config: SuffixDraft = SuffixDraft()) -> None:
        self.vocab_size = vocab_size
        self.device = None  # no model: host tokens, no probs
        self.max_positions = None  # no model, no window
        self.config = config
        self.pool = _Pool(config) if config.pool_tokens else None

    def start(self, prompts: Sequence[Sequence[int]]) -> SuffixSession:
        return SuffixSession(prompts, self.config, self.pool)


class SuffixSession(LookupSession):
    """One generation's suffix state: each row's committed tokens and their index, and the
    proposer's pool, which rows enter as they leave."""

    def __init__(self, prompts: Sequence[Sequence[int]], config: SuffixDraft,
                 pool: _Pool | None = None) -> None:
        self.config = config
        self.pool = pool
        self.rows = [_RowHistory(list(prompt), config) for prompt in prompts]
        self._found: list[int] | None = None  # this round's drafted lengths, per row

    def add_rows(self, prompts: Sequence[Sequence[int]], defer: bool = False) -> None:
        """Rows join (``defer`` changes nothing: indexing a prompt is cheap host work)."""
        self.rows += [_RowHistory(list(prompt), self.config) for prompt in prompts]

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep these rows in this order; the others leave, into the pool."""
        kept = set(rows)
        self._pool_rows([row for i, row in enumerate(self.rows) if i not in kept])
        self.rows = [self.rows[row] for row in rows]

    def close(self) -> None:
        """The session ends: every row still here enters the pool."""
        self._pool_rows(self.rows)
        self.rows = []

    def catch_up(self) -> None:
        """Nothing to do: the index takes each committed token as it comes."""

    def propose(self, plan: DraftPlan, constraint: RoundConstraint | None = None) -> Proposal:
        """Up to ``plan.num_draft_tokens[b]`` for row b (fewer, or none, where the sequence
        has no match long and frequent enough); deterministic: draft_probs None. The plan's
        samplings and generators are not used, nor ``constraint``: the engine cuts a draft
        where it leaves the grammar (ConstraintSet.cover)."""
        assert plan.num_steps >= 1
        return self.propose_found(self.lookup(plan.num_draft_tokens))

    def lookup(self, num_draft_tokens: Sequence[int]) -> list[list[int]]:
        """Each row's draft: up to num_draft_tokens[b] host ids, [] where it has none."""
        num_rows = len(self.rows)
        return [row.draft(k, self.pool, num_rows) if k else []
                for row, k in zip(self.rows, num_draft_tokens)]

    def propose_found(self, found: list[list[int]]) -> Proposal:
        self._found = [len(draft) for draft in found]
        return super().propose_found(found)

    def commit(self, num_accepted: Sequence[int], next_tokens: Sequence[int]) -> None:
        """Each row that drafted learns how its draft fared (_RowHistory.observe), then the
        kept tokens are indexed."""
        if self._found is not None:
            self._observe(self._found, as_ints(num_accepted))
            self._found = None
        super().commit(num_accepted, next_tokens)

    def commit_chained(self, num_found: Sequence[int], num_accepted: Sequence[int],
                       committed: Sequence[Sequence[int]]) -> None:
        """A chained round (proposers/hybrid.py): each row that drafted learns how its part
        fared (kept whole where the round kept more than it), then the tokens are indexed."""
        self._observe(num_found, as_ints(num_accepted))
        self.append_committed(committed)

    def _observe(self, num_found: Sequence[int], num_accepted: Sequence[int]) -> None:
        for row, drafted, kept in zip(self.rows, num_found, num_accepted):
            if drafted:
                row.observe(drafted, min(kept, drafted))

    def _pool_rows(self, rows: list[_RowHistory]) -> None:
        if self.pool is not None:
            for row in rows:
                self.pool.add(row.tokens)
