"""The depth scheduler: how deep each row of a round drafts, and what a round tells the policy.

Legend: B rows.

The batch (engine/batch.py) asks it for a :class:`RoundPlan` before each round and hands it a
:class:`RoundReport` after. In between it keeps the depth policy's bookkeeping, so the round
itself stays the five steps of the algorithm:
  * one policy per batch-size bucket (1, 2, 3-4, 5-8, ...), since a verification pass's cost
    depends on how many rows it carries; built on first use, or from the previous batch's
    policy of the same config and bucket (carry-over, Engine.carried_policies);
    the bucket of one row is priced from the pair's cost curve where one was measured (the
    curve times one row's passes; larger buckets measure their own);
  * each row's depth: the policy's k, or the batch's fixed k where there is no policy (or the
    batch has fewer rows than its min_rows), under the row's own cap and the room left in the
    shortest window;
  * first uses: the first round at a (bucket, depth), a round whose target pass also prefilled
    joining rows, and a round in which a model captured a CUDA graph reach the policy untimed;
  * joins: the draft's prefill of joining rows, priced as a cost of drafting, or deferred while
    the batch runs plain rounds;
  * draft lag: after plain rounds the proposer owes their tokens, and catches up before the
    next drafting round's clock starts.

What it is not: a policy (threshold.py, goodput.py decide k from the stats) and never a part of
the output law: any plan gives exact samples, and a seeded row the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..config import BatchOptions
from .base import AdaptivePolicy, AdaptivePolicyConfig, RoundStats
from .costs import CostCurve


class ScheduledRow(Protocol):
    """What the scheduler reads of a row (engine.rows.Row)."""

    prompt: list[int]

    @property
    def num_generated(self) -> int: ...

    def num_draft_tokens(self, batch_k: int) -> int: ...


@dataclass(frozen=True)
class RoundPlan:
    """What the next round does. num_draft_tokens [B]: the depth each row is asked to draft
    (its proposer may find fewer); catch_up: the proposer owes the tokens of plain rounds and
    takes them before the round's clock starts; measuring: the round only measures drafting
    for the policy, and each row keeps its first token alone (Scheduler._measuring)."""

    num_draft_tokens: list[int]
    catch_up: bool
    measuring: bool


@dataclass(frozen=True)
class RoundTimes:
    """The seconds of one round (engine.clock.RoundClock), or their sums over rounds.

    draft_time   step 1, proposing, until the device finished the draft tokens;
    target_time  step 2, the target's pass and its processed distributions;
    verify_time  steps 3-5, verification, commit and emit;
    wall_time    the whole round, from the start of step 1 (a draft's catch-up comes before).
    """

    draft_time: float = 0.0
    target_time: float = 0.0
    verify_time: float = 0.0
    wall_time: float = 0.0

    @property
    def other_time(self) -> float:
        """The round's seconds outside drafting and the target's pass: paid once a round."""
        return self.wall_time - self.draft_time - self.target_time

    def __add__(self, other: RoundTimes) -> RoundTimes:
        return RoundTimes(self.draft_time + other.draft_time,
                          self.target_time + other.target_time,
                          self.verify_time + other.verify_time,
                          self.wall_time + other.wall_time)


@dataclass(frozen=True)
class RoundReport:
    """What a round did. width: K, the widest draft fed; asked [B]: RoundPlan.num_draft_tokens;
    num_draft [B]: the tokens each row's proposer found; num_accepted [B]: what verification
    accepted (before a measuring round drops it); times: its seconds by step; captured: a
    model captured a step graph during it."""

    width: int
    asked: list[int]
    num_draft: list[int]
    num_accepted: list[int]
    times: RoundTimes
    captured: bool


class Scheduler:
    """The batch's depth bookkeeping; see the module docstring.

    ``options``: the batch's (its depth policy ``adaptive``, None for a fixed k, and its k
    ``num_draft_tokens``, where a policy starts); ``carried``: where policies with carry_over
    are kept between batches; ``speculative``: a proposer drafts (else every round is plain);
    ``max_positions``: the longest sequence every model takes (None: no limit), so k is capped
    by the room of the row nearest its end; ``costs``: the pair's measured cost curve (None:
    not measured).
    """

    def __init__(self, options: BatchOptions,
                 carried: dict[tuple[object, ...], AdaptivePolicy] | None, speculative: bool,
                 max_positions: int | None, costs: CostCurve | None = None) -> None:
        self.options = options
        self.speculative = speculative
        self.costs = costs
        self.adaptive: AdaptivePolicyConfig | None = options.adaptive if speculative else None
        self.carried = carried
        self.policies: dict[int, AdaptivePolicy] = {}  # batch-size bucket -> its policy
        self._policy_k: dict[int, int] = {}  # bucket -> the k its policy returned for next round
        self.last_policy: AdaptivePolicy | None = None  # the policy of the latest round planned
        self.last_num_draft_tokens = 0  # the width of the latest round (0: plain)
        self.max_positions = max_positions
        self._draft_lags = False  # the last round was plain: the draft has tokens to catch up
        # the target's next pass also prefills rows that joined since the last round (their
        # prompts ride it: TargetScorer.add_rows), so its timing is not a round's alone
        self._joins_ride = False
        self._join_time = 0.0  # the draft's prefill of rows joining since the last round
        self._join_tokens = 0  # and those rows' max_new_tokens (RoundStats.join_time)
        self._catch_up_time = 0.0  # the draft's catch-up before this round (RoundStats)
        # (batch-size bucket, depth) of the rounds run: the first round of each reaches the
        # policy with timed=False, and its timings weigh first_use_weight: a first round pays
        # one-off costs that, priced in full, hold a policy in plain rounds where drafting pays.
        # Keyed by bucket rather than exact row counts, and weighed rather than skipped, because
        # rows come and go: otherwise most first rounds go unpriced and the policy drafts deep
        # on its defaults
        self._depths_run: set[tuple[int, int]] = set()

    # --- rows joining -----------------------------------------------------------------------

    def target_joined(self, riding: bool) -> None:
        """Rows joined the target; ``riding``: their prefill rides the next round's pass."""
        self._joins_ride |= riding

    def defers_draft(self) -> bool:
        """Whether joining rows leave their draft work for the next proposal: in a batch that
        runs plain rounds (proposers.base.ProposerSession.add_rows)."""
        return self._draft_lags

    def draft_joined(self, seconds: float, num_tokens: int) -> None:
        """The draft prefilled joining rows in ``seconds``, rows that may emit ``num_tokens``
        (their max_new_tokens): the policy prices it as a cost of drafting."""
        self._join_time += seconds
        self._join_tokens += num_tokens

    def draft_caught_up(self, seconds: float) -> None:
        """The draft fed plain rounds' tokens and deferred prompts in ``seconds`` before the
        round now planned (RoundPlan.catch_up): the policy prices its probes from plain rounds
        by it."""
        self._catch_up_time += seconds

    # --- rounds -----------------------------------------------------------------------------

    def plan(self, rows: Sequence[ScheduledRow]) -> RoundPlan:
        """The next round over ``rows``."""
        policy = self.last_policy = self._policy(rows)
        # the k the policy returned last (a probe of a neighbouring depth included), else its own
        policy_k = None if policy is None else self._policy_k.get(_bucket(len(rows)),
                                                                  policy.num_draft_tokens)
        batch_k = self.options.num_draft_tokens if policy_k is None else policy_k
        wanted = [row.num_draft_tokens(batch_k) if self.speculative else 0 for row in rows]
        if self.max_positions is not None and max(wanted) > 0:
            room = min(self.max_positions - len(row.prompt) - row.num_generated for row in rows)
            wanted = [min(k, max(room, 0)) for k in wanted]
        # the work plain rounds left the proposer is done before the clock starts, so that this
        # round's draft time prices its steps: a round timed with it goes unpriced
        # (RoundStats.draft_timed), and a draft step priced high by a cold start would then stay
        # so and hold k at 0 for good
        catch_up = self._draft_lags and max(wanted) > 0
        if catch_up:
            self._draft_lags = False
        return RoundPlan(wanted, catch_up, self._measuring(policy, policy_k, len(rows)))

    def report(self, report: RoundReport, num_rows: int) -> None:
        """A round over ``num_rows`` rows ran: give the policy of its bucket its stats."""
        policy = self.last_policy
        self.last_num_draft_tokens = report.width
        draft_timed = not self._draft_lags  # this round's draft fed only its own k steps
        self._draft_lags = report.width == 0 and self.speculative
        depth, reached, accepted_at = policy_evidence(report.asked, report.num_draft,
                                                      report.num_accepted)
        bucket = _bucket(num_rows)
        bucket_depth = (bucket, depth)  # per bucket: rows come and go within one
        # a round whose target pass also prefilled joining rows weighs like a first use: a join
        # charged to its depth drives a many-row policy to deep drafts
        timed = bucket_depth in self._depths_run and not self._joins_ride and not report.captured
        self._depths_run.add(bucket_depth)
        self._joins_ride = False
        if policy is not None:  # k = 0 rounds too: a policy may choose plain rounds
            times = report.times
            stats = RoundStats(depth, tuple(reached), tuple(accepted_at), times.draft_time,
                               times.target_time, times.other_time, draft_timed, num_rows,
                               self._join_time, self._join_tokens, timed, self._catch_up_time)
            self._policy_k[bucket] = policy.next_num_draft_tokens(stats)
            if self.adaptive is not None and self.adaptive.carry_over and self.carried is not None:
                self.carried[self._carry_key(bucket)] = policy
        self._join_time, self._join_tokens, self._catch_up_time = 0.0, 0, 0.0

    def _measuring(self, policy: AdaptivePolicy | None, policy_k: int | None,
                   num_rows: int) -> bool:
        """Whether this round only measures drafting for the policy (AdaptivePolicy.measuring:
        a probe while its choice is plain rounds) over more than one row.
        Such a round commits one token a row: its accepted draft tokens are dropped (exact: a
        round's first token alone has the target's law, and at temperature 0 it is the
        target's argmax), so that rows which advanced together still do. Kept, a probe's
        accepted tokens would move most rows one token ahead of the others; the rows would then
        finish in different rounds and rejoin in small groups, each a prefill pass of its own."""
        return (policy is not None and policy_k is not None and num_rows > 1
                and policy.measuring(policy_k))

    def _policy(self, rows: Sequence[ScheduledRow]) -> AdaptivePolicy | None:
        """The policy of the current batch size's bucket, built on first use; None below the
        config's min_rows (the batch's fixed k then)."""
        if self.adaptive is None or len(rows) < self.adaptive.min_rows:
            return None
        bucket = _bucket(len(rows))
        if bucket not in self.policies:
            previous = None if not self.adaptive.carry_over or self.carried is None else (
                self.carried.get(self._carry_key(bucket)))
            self.policies[bucket] = self.adaptive.build(
                self.options.num_draft_tokens, previous, self.costs if bucket == 1 else None)
        return self.policies[bucket]

    def _carry_key(self, bucket: int) -> tuple[object, ...]:
        return (self.adaptive, bucket)


def _bucket(num_rows: int) -> int:
    return 1 << (num_rows - 1).bit_length()  # 1, 2, 4, 8, ...


def policy_evidence(asked: list[int], num_draft: list[int], num_accepted: list[int]
                    ) -> tuple[int, list[int], list[int]]:
    """(depth, reached [depth], accepted_at [depth]): what a round tells the depth policy,
    priced at the depth it asked for. A row asked for k_b tokens whose proposer found fewer
    (a lookup without a long enough match) counts its first missing position as tested and
    rejected: it yields no token there. So the rates are tokens gained per position asked, and
    T(k) the mean cost of rounds run at depth k, whatever the proposer found. Counted over the
    positions drafted only, a batch where one row of eight drafts, nearly always kept, would
    look as if every row did, and the policy would draft deep for a fraction of the gain it
    prices.

    Example: asked [4, 4], found [2, 0], accepted [2, 0] -> depth 4, reached [2, 1, 1, 0],
    accepted_at [1, 1, 0, 0]."""
    depth = max(asked, default=0)
    reached, accepted_at = [0] * depth, [0] * depth
    for k, found, n in zip(asked, num_draft, num_accepted):
        assert n <= found <= k
        for j in range(k):
            reached[j] += n >= j
            accepted_at[j] += n > j
    return depth, reached, accepted_at
