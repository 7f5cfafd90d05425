"""policy/costs.py: the measured cost curve, and the goodput policy priced from it.

Synthetic curves only: what a policy does with given costs is arithmetic, checked exactly; no
test here times anything (the curve's measurement on a real model: tests/models/
test_llama_cpp_costs.py).
"""

from __future__ import annotations

import math

import pytest

from verispec import BatchOptions, GoodputPolicyConfig
from verispec.errors import ConfigError
from verispec.policy import default_num_draft_tokens
from verispec.policy.base import RoundStats
from verispec.policy.costs import (
    CostCurve,
    expected_tokens,
    priced_rounds,
    target_calls,
)
from verispec.policy.scheduler import Scheduler

PLAIN = GoodputPolicyConfig(min_num_draft_tokens=0)  # the server's goodput-plain
PRIOR = GoodputPolicyConfig.prior_acceptance
# ms -> s: a target whose pass grows with every token (row-by-row kernels) and a draft at half
# its cost; a target whose pass over 9 tokens costs what one token's does, and a cheap draft
LINEAR = CostCurve(tuple(0.010 * n for n in range(1, 10)), draft_step=0.005)
FLAT = CostCurve((0.010,) * 9, draft_step=0.0005)
# an uneven curve of repacked kernels: a pass over 4 tokens costs less than over 2 or 3
UNEVEN = CostCurve((0.0685, 0.0933, 0.1077, 0.0881, 0.1159, 0.130, 0.140, 0.1568, 0.165),
                   draft_step=0.0383)


def _best_by_hand(curve: CostCurve, acceptance: float, max_k: int) -> int:
    """argmax over k of (1 + a + ... + a^k) / (k d + T(k)), written out apart from the code."""
    def goodput(k: int) -> float:
        tokens = sum(acceptance ** i for i in range(k + 1))
        return tokens / (k * curve.draft_step + curve.target_call(k))
    return max(range(1, max_k + 1), key=goodput)


def test_the_curve_checks_its_costs_and_extrapolates_by_its_slope():
    for target_pass, draft_step in [((), None), ((0.01, 0.0), None), ((0.01, math.inf), None),
                                    ((0.01,), -1.0), ((0.01, True), None)]:
        with pytest.raises(ConfigError, match="CostCurve"):
            CostCurve(target_pass, draft_step)
    curve = CostCurve((1.0, 2.0, 4.0))
    assert curve.max_depth == 2 and curve.cost_ratio is None
    assert [curve.target_call(k) for k in range(5)] == [1.0, 2.0, 4.0, 5.5, 7.0]
    assert CostCurve((2.0, 1.0)).target_call(3) == 1.0  # a falling curve extrapolates flat
    assert curve.round_cost(2) == 4.0  # no draft model: lookups cost nothing
    assert LINEAR.cost_ratio == pytest.approx(0.5) and LINEAR.round_cost(2) == pytest.approx(0.04)
    assert expected_tokens(0, 0.5) == 1.0 and expected_tokens(2, 0.5) == 1.75


def test_the_best_depth_is_the_most_tokens_per_second():
    for curve in (LINEAR, FLAT, UNEVEN):
        for acceptance in (0.3, PRIOR, 0.87, 1.0):
            assert curve.best_depth(acceptance) == _best_by_hand(curve, acceptance, 8)
    assert LINEAR.best_depth(PRIOR) == 1 and FLAT.best_depth(PRIOR) == 4
    # the uneven curve: at the acceptance of a same-family draft only k = 3 pays, by about 10%
    assert UNEVEN.best_depth(0.87) == 3
    assert UNEVEN.goodput(3, 0.87) / UNEVEN.goodput(0, 0.87) == pytest.approx(1.108, abs=0.005)
    assert max(UNEVEN.goodput(k, 0.87) for k in (1, 2)) < UNEVEN.goodput(0, 0.87)


def test_the_curve_says_itself_in_one_line():
    assert CostCurve((0.0701, 0.093), 0.0383).describe() == (
        "target pass ms n=1..2: 70.1 93.0; draft step 38.3 ms (c = 0.55)")
    assert CostCurve((0.001,)).describe() == "target pass ms n=1..1: 1.0"


def test_rounds_set_the_level_and_replace_the_curve_where_they_measured():
    # the docstring's example, then a measured draft step and plain round
    assert target_calls(CostCurve((1.0, 2.0, 2.0)), [(0, 2.0)], 2) == ([2.0, 4.0, 4.0], 2.0)
    assert target_calls(CostCurve((1.0, 2.0)), [], 3) == ([1.0, 2.0, 3.0, 4.0], 1.0)
    costs, plain = priced_rounds(CostCurve((1.0, 2.0, 2.0), 0.5), [(1, 3.0)], None, None, 0.1, 2)
    assert costs == pytest.approx([0.1 + 0.75 + 3.0, 0.1 + 2 * 0.75 + 3.0]) and plain == 1.6
    costs, plain = priced_rounds(CostCurve((1.0, 2.0, 2.0), 0.5), [], 0.9, 0.2, 0.0, 2)
    assert costs == pytest.approx([2.2, 2.4]) and plain == 0.9


def test_a_policy_on_a_linear_curve_starts_plain_and_probes_rarely():
    policy = PLAIN.build(4, costs=LINEAR)
    assert policy.num_draft_tokens == 0
    # no depth could pay even at full acceptance: no thin-evidence probes, the longest interval
    rounds = [policy.next_num_draft_tokens(_plain_round(0.010)) for _ in range(200)]
    assert rounds == [0] * 200
    # the control: the same policy without a curve starts at the k it was given and probes
    unpriced = PLAIN.build(4)
    assert unpriced.num_draft_tokens == 4
    assert any(unpriced.next_num_draft_tokens(_plain_round(0.010)) for _ in range(200))
    # a policy that may not choose plain rounds drafts as shallow as it may
    assert GoodputPolicyConfig().build(4, costs=LINEAR).num_draft_tokens == 1


def test_a_policy_on_an_uneven_curve_starts_plain_but_probes_to_learn_acceptance():
    # at the prior acceptance no depth pays, at a same-family draft's it could: the policy
    # starts plain and still probes at the curve's best drafting depth
    policy = PLAIN.build(2, costs=UNEVEN)
    assert policy.num_draft_tokens == 0
    rounds = [policy.next_num_draft_tokens(_plain_round(0.0685)) for _ in range(40)]
    assert set(rounds) == {0, UNEVEN.best_depth(PRIOR)}


def test_a_policy_on_a_flat_curve_starts_at_the_deepest_useful_depth():
    for config in (PLAIN, GoodputPolicyConfig(), GoodputPolicyConfig(max_num_draft_tokens=8)):
        policy = config.build(1, costs=FLAT)
        assert policy.num_draft_tokens == _best_by_hand(FLAT, PRIOR,
                                                        config.max_num_draft_tokens) == 4
        assert policy.round_costs()[3] == pytest.approx(4 * 0.0005 + 0.010)  # priced at once
    assert GoodputPolicyConfig().build(1).round_costs() is None  # the control: nothing priced


def test_a_given_cost_ratio_prices_alone():
    config = GoodputPolicyConfig(cost_ratio=0.05, min_num_draft_tokens=0)
    assert config.build(3, costs=LINEAR).num_draft_tokens == 3
    assert config.build(3, costs=LINEAR).costs is None


def test_measured_rounds_move_a_policy_off_its_curve():
    # the curve says linear, the rounds say flat (each pass costs what a plain step does) and
    # that every draft token is accepted: at its first (rare) probe the policy leaves plain
    # rounds for drafting, and goes deeper
    policy = GoodputPolicyConfig(min_num_draft_tokens=0, probe_every=4).build(1, costs=LINEAR)
    ks, k = [policy.num_draft_tokens], policy.num_draft_tokens
    for _ in range(120):
        reached = tuple([1] * k)
        stats = RoundStats(k, reached, reached, draft_time=0.0005 * k, target_time=0.010)
        k = policy.next_num_draft_tokens(stats)
        ks.append(k)
    first_probe = next(i for i, k in enumerate(ks) if k > 0)
    assert first_probe == 4 * GoodputPolicyConfig.plain_probe_backoff  # the longest interval
    assert ks[-10:].count(0) <= 1 and min(k for k in ks[-10:] if k) >= 3


def test_the_scheduler_prices_a_one_row_bucket_from_the_curve_only():
    options = BatchOptions(adaptive=PLAIN, num_draft_tokens=4)
    scheduler = Scheduler(options, None, True, None, costs=LINEAR)
    assert scheduler._policy([_Row()]).costs is LINEAR
    assert scheduler._policy([_Row(), _Row()]).costs is None  # two rows' passes: not measured
    assert Scheduler(options, None, True, None)._policy([_Row()]).costs is None


def test_the_default_depth_follows_a_measured_curve():
    assert default_num_draft_tokens("cpu", flat_verify=True, costs=LINEAR) == 1
    assert default_num_draft_tokens("cpu", flat_verify=False, costs=FLAT) == 4
    assert default_num_draft_tokens("cpu", flat_verify=True) == 4  # no curve: as before
    assert default_num_draft_tokens("cpu") == 2


def _plain_round(seconds: float) -> RoundStats:
    return RoundStats(0, (), (), draft_time=0.0, target_time=seconds)


class _Row:
    """What the scheduler reads of a row (scheduler.ScheduledRow)."""

    def __init__(self) -> None:
        self.prompt = [1, 2]
        self.num_generated = 0

    def num_draft_tokens(self, batch_k: int) -> int:
        return batch_k
