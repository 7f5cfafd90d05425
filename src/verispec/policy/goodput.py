"""The goodput depth policy: the k that maximises expected tokens per unit of measured cost.

It estimates the per-position acceptance rate a_i and the costs, and picks the k that maximises
expected tokens per unit of cost, E(k) = 1 + sum_{i<k} prod_{j<=i} a_j over the cost of a round
(Leviathan et al. 2023, section 3.4, with per-position rates instead of one i.i.d. a). With a
given cost ratio c the cost is k c + 1 target calls. Otherwise it is measured: k draft steps plus
the target call at depth k, T(k), because a pass over k + 1 tokens is not free on every device
(on a small CPU it grows with k), plus the round's fixed overhead (verification and
bookkeeping: it favours deeper rounds where it is large against T), plus the draft's prefill of
joining rows spread over the tokens they may emit (GoodputPolicy.join_cost; it weighs on every
drafting round in proportion to the tokens it emits); T is the measured mean at each depth used
recently, interpolated between them, flat below them and rising by a fitted slope above them
(GoodputPolicy.round_costs); a plain round ages only T(0), the one timing it measures (faded).
To see more than one depth, every ``probe_every`` rounds one round runs at a neighbour of the
best k. With ``min_num_draft_tokens=0`` a plain round (k = 0) is one of its choices, taken while
no depth beats it by ``plain_margin``. Given the pair's cost curve (costs.py), it prices T and the
draft step until rounds measure them, and starts at the depth it prices best at the prior
acceptance: plain rounds, probed rarely, where no depth could pay even at full acceptance.

What this is not: the policy interface and carry-over (base.py); the threshold policy
(threshold.py); the batch's per-bucket policies and the timings it hands them (scheduler.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from ..config import check_int, check_number
from .base import AdaptivePolicy, AdaptivePolicyConfig, RoundStats
from .costs import CostCurve, faded, piecewise, priced_rounds


@dataclass(frozen=True)
class GoodputPolicyConfig(AdaptivePolicyConfig):
    """Pick k maximising expected tokens per unit cost from running estimates.

    cost_ratio: c = draft step time / target step time, with a target call costing the same
        at every depth; None measures draft steps and target calls per depth as rounds go.
    decay: weight kept by old observations each round (exponential forgetting; a plain round
        ages only T(0), and drafting timings no lower than one round's weight, costs.faded).
    prior_acceptance, prior_weight: a Beta-style prior for positions with few observations.
    probe_every: with measured costs, one round in this many runs at a neighbouring k so that
        T(k) is measured at more than one depth; 0 never probes. While plain rounds stay the
        best, the interval doubles after each probe, up to plain_probe_backoff times this: a
        probe from plain rounds makes the draft catch up on every token since the last one,
        and the rows that joined since (their prompts' draft work is deferred, see
        engine.batch.Batch.add), so rare probes are what lets a loaded server run at the plain
        server's speed. Only drafting held for probe_every rounds starts the interval afresh:
        a probe's timing that tips the model to drafting for a round or two, and back, must
        not bring back frequent probes (each costs a catch-up that grows with the rows).
    min_num_draft_tokens may be 0: k = 0 is a plain decoding round, one token for one target
    call T(0), and the policy falls back to it while no depth's expected goodput beats it by
    plain_margin (a draft that rarely agrees, or a machine where the target's pass costs more
    after the draft's steps than back to back); probes keep measuring k = 1, and while it
    drafts every plain_reprobe-th probe is a plain round, so T(0) stays current.

    The tuned rules, each field's reason in its comment below and its measurements in
    dev/LOG.md under its constant's name:
    plain_margin: how much more goodput than plain rounds drafting must promise.
    plain_probe_backoff: the longest probe interval in plain rounds, in probe_every's.
    plain_reprobe: while drafting, every this many probes one is a plain round.
    thin_evidence, thin_probes: below this many tested positions, a policy in plain rounds
        probes at its first depth without backing off, this many times at most.
    first_use_weight: the weight of a first use's timings (RoundStats.timed False).
    outlier_cap: a timing counts at most this many times its kind's running mean.
    """

    LOWEST_MIN: ClassVar[int] = 0
    cost_ratio: float | None = None
    decay: float = 0.9
    prior_acceptance: float = 0.6
    prior_weight: float = 2.0
    probe_every: int = 16
    # how far the probe interval stretches while plain rounds stay the best, in probe_every's
    plain_probe_backoff: int = 16
    # while drafting, every this many probes one is a plain round, so that T(0) is measured
    # afresh: measured once, one slow plain round would price plain rounds for good, and a
    # server would draft through rounds that cost what plain ones do (dev/LOG.md, PLAIN_REPROBE)
    plain_reprobe: int = 3
    # how much more goodput than plain rounds drafting must promise to be chosen over them: a
    # round that drafts after plain ones first makes the draft catch up on their tokens, and
    # on the rows that joined meanwhile, outside the priced round, so a near tie is no reason
    # to draft: drafting whenever it comes out ahead loses to plain rounds (dev/LOG.md,
    # PLAIN_MARGIN)
    plain_margin: float = 1.1
    # a policy in plain rounds whose acceptance rests on fewer tested positions than this
    # (decayed sums) probes at its first depth every probe_every rounds, without backing off,
    # up to thin_probes times: a cold first round must not leave it learning too slowly to
    # draft where drafting pays, and a draft never accepted must not be probed at that rate for
    # good (dev/LOG.md, THIN_EVIDENCE)
    thin_evidence: float = 16.0
    thin_probes: int = 4
    # probes from plain rounds take at most this share of the plain rounds' time: each makes
    # the draft catch up on every row's tokens since it last ran, the prompts of rows that
    # joined meanwhile included (RoundStats.catch_up_time), which for a draft that costs half
    # the target per token is several plain rounds (dev/LOG.md, PROBE_SHARE)
    probe_share: float = 0.02
    # the weight of a first use's timings (RoundStats.timed False): one-off costs must not
    # price the depth, yet a fresh policy needs some price (dev/LOG.md, FIRST_USE_WEIGHT)
    first_use_weight: float = 0.01
    # a round's timing counts at most this many times its kind's running mean (once that mean
    # rests on a round's weight): one preempted round must not move T(0) by more than
    # plain_margin; a real change of cost still passes, by up to 2.5% a round at decay 0.9
    # (dev/LOG.md, OUTLIER_CAP)
    outlier_cap: float = 1.25

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cost_ratio is not None:
            check_number("cost_ratio", self.cost_ratio, 0, math.inf, low_open=True,
                         note=", or None to measure it")
        check_number("decay", self.decay, 0, 1, low_open=True)
        check_number("prior_acceptance", self.prior_acceptance, 0, 1)
        check_number("prior_weight", self.prior_weight, 0, math.inf)
        check_int("probe_every", self.probe_every, 0, note=" (0 never probes)")
        for name in ("plain_probe_backoff", "plain_reprobe", "thin_probes"):
            check_int(name, getattr(self, name), 1)
        check_number("probe_share", self.probe_share, 0, 1, low_open=True)
        for name, low in (("plain_margin", 1.0), ("thin_evidence", 0.0),
                          ("first_use_weight", 0.0), ("outlier_cap", 1.0)):
            check_number(name, getattr(self, name), low)

    def build(self, initial_num_draft_tokens: int, previous: AdaptivePolicy | None = None,
              costs: CostCurve | None = None) -> AdaptivePolicy:
        if previous is not None:
            return self._resume(previous)
        return GoodputPolicy(self, self.clamp(initial_num_draft_tokens), costs)


class GoodputPolicy(AdaptivePolicy):
    def __init__(self, config: GoodputPolicyConfig, initial_num_draft_tokens: int,
                 costs: CostCurve | None = None) -> None:
        self.config = config
        self.costs = None if config.cost_ratio is not None else costs  # a given c prices alone
        self.num_draft_tokens = initial_num_draft_tokens
        self._first_k = max(1, initial_num_draft_tokens)  # the depth of probes on thin evidence
        self._thin_probes_left = config.thin_probes  # and how many such probes it may still make
        size = config.max_num_draft_tokens
        self._reached = [0.0] * size
        self._accepted = [0.0] * size
        self._draft_step_time = 0.0  # decayed sums: seconds and step counts
        self._draft_steps = 0.0
        self._target_time = [0.0] * (size + 1)  # decayed seconds of target calls at depth k
        self._target_calls = [0.0] * (size + 1)
        self._other_time = 0.0  # decayed seconds per round outside drafting and scoring
        self._other_rounds = 0.0
        self._probe_up = True  # the side of the next probe
        self._since_probe = 0  # rounds since the last probe
        # a policy that may choose plain rounds probes one after its first round (_maybe_probe)
        self._plain_probe_due = config.min_num_draft_tokens == 0
        self._probe_interval = config.probe_every  # doubling while k = 0 stays the best
        self._num_drafting = 0  # consecutive rounds the model chose to draft
        # T(0), a plain round's target call, kept apart: decayed only by plain rounds, so that
        # a drafting stretch does not forget it (see _measured_costs); while drafting, plain
        # probes keep it current (plain_reprobe)
        self._plain_time = 0.0
        self._plain_rounds = 0.0
        self._join_time = 0.0  # decayed per join: the draft's prefill seconds, and the tokens
        self._join_tokens = 0.0  # the joined rows may emit (their max_new_tokens)
        self._num_rows = 1  # rows in the latest round
        self._num_drafting_probes = 0  # probes while drafting; every plain_reprobe-th is plain
        self._catch_up_time = 0.0  # decayed per catch-up: the draft's seconds catching up
        self._catch_ups = 0.0  # after plain rounds, and how many catch-ups they weigh
        if self.costs is not None:
            self._start_from_curve()

    def _start_from_curve(self) -> None:
        """Start at the depth the curve prices best at the prior acceptance. Where no depth
        could pay even at full acceptance, plain rounds probed at the longest interval from the
        start: only a change in the costs rounds measure can make drafting pay."""
        self.num_draft_tokens, self._first_k = self._choose(self.acceptance_estimates())
        size = self.config.max_num_draft_tokens
        if self.num_draft_tokens == 0 and self._choose([1.0] * size)[0] == 0:
            self._probe_interval = self.config.plain_probe_backoff * self.config.probe_every

    def acceptance_estimates(self) -> list[float]:
        """Per-position acceptance estimates, shrunk towards the pooled rate."""
        cfg = self.config
        total_reached = sum(self._reached) + cfg.prior_weight
        pooled = cfg.prior_acceptance if total_reached <= 0 else (
            sum(self._accepted) + cfg.prior_acceptance * cfg.prior_weight) / total_reached
        return [pooled if reached + cfg.prior_weight <= 0 else
                (acc + pooled * cfg.prior_weight) / (reached + cfg.prior_weight)
                for acc, reached in zip(self._accepted, self._reached)]

    def cost_ratio(self) -> float:
        """c = draft step / target call (pooled over depths): given, measured, the curve's, 0.1."""
        if self.config.cost_ratio is not None:
            return self.config.cost_ratio
        calls, seconds = sum(self._target_calls), sum(self._target_time)
        if self._draft_steps == 0 or calls == 0 or seconds <= 0:
            curve_ratio = None if self.costs is None else self.costs.cost_ratio
            return 0.1 if curve_ratio is None else curve_ratio  # a typical small-draft ratio
        return (self._draft_step_time / self._draft_steps) / (seconds / calls)

    def join_cost(self) -> float:
        """Seconds of the draft's prefill per token a joined row may emit (0 until a join's
        draft prefill is timed): the per-request cost of drafting, spread over the row's
        tokens. Small a token, it is still of the order of the gap between drafting and plain
        rounds' cost a token, so it takes part in choosing between them."""
        return self._join_time / self._join_tokens if self._join_tokens > 0 else 0.0

    def round_costs(self) -> list[float] | None:
        """Measured cost of a round at k = 1 .. max, in seconds; None until anything is timed.

        k draft steps plus T(k), the target call at depth k: the mean of its recent timings
        where it ran recently, else interpolated between the nearest such depths; below the
        lowest one T is flat (never below a measured call: a slow outlier at a deeper k must
        not make shallow depths look free), above the highest it grows by the least-squares
        slope of all timings (>= 0). One measured depth gives a flat T, the formula's model.
        """
        return self._measured_costs()[0]

    def plain_cost(self) -> float | None:
        """Measured seconds of a plain round (k = 0): T(0) as plain rounds last measured it (kept
        through drafting stretches), else flat below the lowest measured depth (as in
        :meth:`round_costs`); None until anything is timed."""
        return self._measured_costs()[1]

    def _measured_costs(self) -> tuple[list[float] | None, float | None]:
        """(round_costs, plain_cost) from one fit of the target-call timings, or the curve."""
        if self.costs is not None:
            return self._curve_costs(self.costs)
        model = self._target_call_model()
        if model is None:
            return None, None
        recent, slope = model
        overhead = self._overhead()
        # a plain round as plain rounds measured it: priced flat from the lowest drafting depth
        # instead, plain rounds look as dear as a drafting round's target call, and a policy
        # that starts drafting never stops
        plain = overhead + (self._plain_time / self._plain_rounds if self._plain_rounds > 1e-9
                            else piecewise(recent, 0, slope))
        if self._draft_steps <= 1e-9:
            return None, plain
        draft_step = self._draft_step_time / self._draft_steps
        return [overhead + k * draft_step + piecewise(recent, k, slope)
                for k in range(1, self.config.max_num_draft_tokens + 1)], plain

    def _curve_costs(self, curve: CostCurve) -> tuple[list[float], float]:
        """(round_costs, plain_cost) by the curve at the level of the rounds' timings, which
        replace it where they weigh half a round or more (costs.priced_rounds)."""
        means = [_mean(seconds, calls) for seconds, calls in
                 zip(self._target_time, self._target_calls)]
        return priced_rounds(curve, [(k, t) for k, t in enumerate(means) if t is not None],
                             _mean(self._plain_time, self._plain_rounds),
                             _mean(self._draft_step_time, self._draft_steps), self._overhead(),
                             self.config.max_num_draft_tokens)

    def _overhead(self) -> float:
        """Seconds a round pays outside drafting and scoring (decayed mean; 0 until timed)."""
        return self._other_time / self._other_rounds if self._other_rounds > 1e-9 else 0.0

    def _target_call_model(self) -> tuple[list[tuple[int, float]], float] | None:
        """(recent (depth, mean T) points, least-squares slope of T over depth), from the
        decayed timings; None with a given cost ratio or nothing timed yet."""
        if self.config.cost_ratio is not None:
            return None
        seen = [(k, seconds / calls, calls) for k, (seconds, calls) in
                enumerate(zip(self._target_time, self._target_calls)) if calls > 1e-9]
        if not seen or any(t <= 0 for _, t, _ in seen):
            return None
        recent = [(k, t) for k, t, w in seen if w >= 0.5] or [max(seen, key=lambda s: s[2])[:2]]
        weight = sum(w for _, _, w in seen)
        mean_k = sum(k * w for k, _, w in seen) / weight
        mean_t = sum(t * w for _, t, w in seen) / weight
        spread = sum(w * (k - mean_k) ** 2 for k, _, w in seen)
        slope = 0.0 if spread <= 0 else max(0.0, sum(
            w * (k - mean_k) * (t - mean_t) for k, t, w in seen) / spread)
        return recent, slope

    def next_num_draft_tokens(self, stats: RoundStats) -> int:
        self._observe(stats)
        self.num_draft_tokens = self._choose(self.acceptance_estimates())[0]
        return self._maybe_probe(self.num_draft_tokens)

    def _choose(self, rates: list[float]) -> tuple[int, int]:
        """(the depth to run, the best drafting depth) at per-position acceptance ``rates``:
        the k >= 1 maximising expected tokens per cost, or 0 where plain rounds may be chosen
        and no depth beats them by plain_margin."""
        costs, plain_cost = self._measured_costs()
        # the draft's prefill of the rows that join, by the tokens a drafting round emits
        join_cost = self._num_rows * self.join_cost()
        if costs is None or plain_cost is None:  # in target calls: k draft steps + one call
            c = self.cost_ratio()
            costs = [k * c + 1.0 for k in range(1, self.config.max_num_draft_tokens + 1)]
            plain_cost, join_cost = 1.0, 0.0
        drafting_k, drafting_goodput, expected, prefix = 1, -1.0, 1.0, 1.0
        for k in range(1, self.config.max_num_draft_tokens + 1):
            prefix *= rates[k - 1]
            expected += prefix
            goodput = expected / (costs[k - 1] + expected * join_cost)
            if k >= self.config.min_num_draft_tokens and goodput > drafting_goodput:
                drafting_k, drafting_goodput = k, goodput
        # a plain round: one token per T(0), and drafting must beat it by plain_margin (what
        # leaving plain rounds costs unpriced)
        plain = self.config.min_num_draft_tokens == 0 and (
            self.config.plain_margin / plain_cost >= drafting_goodput)
        return 0 if plain else drafting_k, drafting_k

    def measuring(self, k: int) -> bool:
        return k > 0 and self.num_draft_tokens == 0

    def _observe(self, stats: RoundStats) -> None:
        decay = self.config.decay
        if stats.num_draft_tokens > 0:  # a plain round tests nothing: the rates stand as they
            # are (forgetting them there would draw them to the prior, which can hold k at 0)
            self._reached = [r * decay for r in self._reached]
            self._accepted = [a * decay for a in self._accepted]
        for i, (reached, accepted) in enumerate(zip(stats.num_reached, stats.num_accepted_at)):
            if i < len(self._reached):
                self._reached[i] += reached
                self._accepted[i] += accepted
        # a first use's timings weigh first_use_weight: alone they price the round (better
        # than no price), and the first timed round of its depth outweighs them
        weight = 1.0 if stats.timed else self.config.first_use_weight
        k = stats.num_draft_tokens
        if k == 0:  # a plain round measures no drafting: their timings fade, never out
            self._draft_step_time, self._draft_steps = faded(
                self._draft_step_time, self._draft_steps, decay)
        elif stats.draft_timed:  # else the old estimate stands (both sums decay alike)
            draft_time = self._capped(stats.draft_time, self._draft_step_time * k,
                                      self._draft_steps)
            self._draft_step_time = self._draft_step_time * decay + weight * draft_time
            self._draft_steps = self._draft_steps * decay + weight * k
        # T(0) ages with every round, the drafting depths with drafting rounds (plain ones only
        # fade them, costs.faded)
        for depth, (seconds, calls) in enumerate(zip(self._target_time, self._target_calls)):
            self._target_time[depth], self._target_calls[depth] = (
                (seconds * decay, calls * decay) if depth == 0 or k > 0
                else faded(seconds, calls, decay))
        self._other_time = self._other_time * decay + weight * stats.other_time
        self._other_rounds = self._other_rounds * decay + weight
        self._num_rows = stats.num_rows
        if stats.catch_up_time > 0:
            self._catch_up_time = self._catch_up_time * decay + stats.catch_up_time
            self._catch_ups = self._catch_ups * decay + 1.0
        if stats.join_tokens > 0:
            self._join_time = self._join_time * decay + stats.join_time
            self._join_tokens = self._join_tokens * decay + stats.join_tokens
        if k < len(self._target_time):
            target_time = self._capped(stats.target_time, self._target_time[k],
                                       self._target_calls[k])
            self._target_time[k] += weight * target_time
            self._target_calls[k] += weight
        if k == 0:
            plain_time = self._capped(stats.target_time, self._plain_time, self._plain_rounds)
            self._plain_time = self._plain_time * decay + weight * plain_time
            self._plain_rounds = self._plain_rounds * decay + weight

    def _capped(self, seconds: float, total: float, count: float) -> float:
        """A round's timing, at most ``outlier_cap`` times the running mean ``total / count``
        of its kind once that mean rests on a round's weight or more."""
        if count >= 1.0 and total > 0:
            return min(seconds, self.config.outlier_cap * total / count)
        return seconds

    def _priced_plain_interval(self) -> int:
        """The fewest plain rounds between probes for which the draft's catch-ups (their
        decayed mean) stay within probe_share of those rounds' time; 0 before any catch-up."""
        plain_cost = self._measured_costs()[1]
        if self._catch_ups <= 0 or not plain_cost:
            return 0
        catch_up = self._catch_up_time / self._catch_ups
        return math.ceil(catch_up / (self.config.probe_share * plain_cost))

    def _maybe_probe(self, best_k: int) -> int:
        """Every probe_every rounds (measured costs only), one round at best_k +- 1 (a policy
        that may choose plain rounds times one at its second round, and its first probe is
        one too until it has: k = 0); while best_k is 0, at intervals doubling up to
        plain_probe_backoff * probe_every and never below what keeps the draft's catch-ups
        within probe_share of the plain rounds' time, except while the draft's acceptance rests
        on fewer than thin_evidence tested positions: then every probe_every rounds
        (thin_probes times at most), at the policy's first depth, so that each probe tests
        several positions (the model's own best depth is shallow then, as its acceptance
        estimate is)."""
        every = self.config.probe_every
        if self.config.cost_ratio is not None or every == 0:
            return best_k
        if self._plain_probe_due:
            # a policy that may choose plain rounds times one second (unless its first was
            # one): a fresh bucket that drafts at its starting depth until its first probe
            # breaks a server's rows into cohorts that finish in different rounds and join in
            # small groups, for as long as the load lasts
            self._plain_probe_due = False
            if self._plain_rounds == 0 and best_k > 0:
                self._since_probe = 0
                return 0
        self._since_probe += 1
        self._num_drafting = self._num_drafting + 1 if best_k > 0 else 0
        if self._num_drafting >= every:  # drafting held: plain rounds are probed afresh
            self._probe_interval = every
        if self._since_probe < self._probe_interval:
            return best_k
        thin = (best_k == 0 and sum(self._reached) < self.config.thin_evidence
                and self._thin_probes_left > 0)
        # the catch-up's price is read only once a probe is otherwise due: not every round
        if best_k == 0 and not thin and self._since_probe < self._priced_plain_interval():
            return best_k
        self._since_probe = 0
        if thin:
            self._thin_probes_left -= 1
            return self._first_k
        if best_k == 0:
            self._probe_interval = min(2 * self._probe_interval,
                                       self.config.plain_probe_backoff * every)
        elif self.config.min_num_draft_tokens == 0:
            self._num_drafting_probes += 1
            if self._plain_rounds == 0 or self._num_drafting_probes >= self.config.plain_reprobe:
                self._num_drafting_probes = 0
                return 0  # the first probe measures a plain round, and every few a fresh one
        return self._neighbour_probe(best_k)

    def _neighbour_probe(self, best_k: int) -> int:
        """best_k + 1 and best_k - 1 in turn (the other where one is out of range)."""
        self._probe_up = not self._probe_up
        for step in ((1, -1) if self._probe_up else (-1, 1)):
            probe = self.config.clamp(best_k + step)
            if probe != best_k:
                return probe
        return best_k


def _mean(total: float, weight: float) -> float | None:
    """A decayed mean where it rests on half a round's weight or more, else None."""
    return total / weight if weight >= 0.5 and total > 0 else None
