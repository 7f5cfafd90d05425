"""policy/: the depth policies (threshold, goodput) on their own, through the engine and through
a batch, and their carry-over between generations. A policy changes only speed, never the output.

The fixtures are the small Markov chains of tests/helpers/markov_chains.py; the checks are exact.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
import torch

from verispec import (
    BatchOptions,
    Engine,
    GenerationConfig,
    GoodputPolicyConfig,
    MarkovLM,
    SamplingConfig,
    ThresholdPolicyConfig,
    optimal_num_draft_tokens,
)
from verispec.errors import ConfigError
from verispec.policy.base import RoundStats
from verispec.sample.sampling import make_generator

from markov_chains import (
    GREEDY,
    PROMPTS,
    _decoder,
    _noisy_draft,
    _plain_greedy,
    _target,
)

pytestmark = pytest.mark.usefixtures("single_thread_torch")

DEFAULTS = GoodputPolicyConfig()  # the tuned rules' defaults


# --- adaptive speculation depth --------------------------------------------------------------


def _stats(k: int, num_rows: int, rate: float) -> RoundStats:
    """Stats of a round where each tested position is accepted at ``rate``."""
    reached, accepted, rows = [], [], float(num_rows)
    for _ in range(k):
        reached.append(round(rows))
        rows *= rate
        accepted.append(round(rows))
    return RoundStats(k, tuple(reached), tuple(accepted), draft_time=0.01, target_time=0.1)


def test_threshold_policy_grows_and_shrinks_within_bounds():
    config = ThresholdPolicyConfig(min_num_draft_tokens=2, max_num_draft_tokens=6, window=1)
    policy = config.build(4)
    assert [policy.next_num_draft_tokens(_stats(4, 10, 1.0)) for _ in range(4)] == [5, 6, 6, 6]
    policy = config.build(4)
    assert [policy.next_num_draft_tokens(_stats(4, 10, 0.0)) for _ in range(4)] == [3, 2, 2, 2]
    policy = config.build(4)
    assert policy.next_num_draft_tokens(_stats(4, 100, 0.6)) == 4  # between the thresholds
    assert config.build(9).num_draft_tokens == 6  # the initial k is clamped


def test_threshold_policy_pools_over_its_window():
    # a large round at rate 0.5, then a tiny round at rate 0: pooled over a window of 3 the rate
    # is 93 / 189 = 0.49 (keep k); judged on the last round alone it is 0 (shrink)
    pooled = ThresholdPolicyConfig(window=3).build(4)
    last_only = ThresholdPolicyConfig(window=1).build(4)
    for policy in (pooled, last_only):
        assert policy.next_num_draft_tokens(_stats(4, 100, 0.5)) == 4
    assert pooled.next_num_draft_tokens(_stats(4, 2, 0.0)) == 4
    assert last_only.next_num_draft_tokens(_stats(4, 2, 0.0)) == 3


def _greedy_engine_run(draft_table: torch.Tensor, target: MarkovLM, adaptive):
    decoder = Engine.from_draft_model(target, MarkovLM(draft_table, target.order))
    config = GenerationConfig(max_new_tokens=60, sampling=GREEDY, seed=0)
    run = decoder.stream(PROMPTS, config, options=BatchOptions(adaptive=adaptive,
                                                               num_draft_tokens=4))
    for _ in run:
        pass
    return run


def test_threshold_policy_through_the_engine():
    target = _target(order=2, seed=8)
    plain = [_plain_greedy(target, p, 60) for p in PROMPTS]
    adaptive = ThresholdPolicyConfig(min_num_draft_tokens=1, max_num_draft_tokens=12, window=1)
    # draft == target: acceptance 1 -> k grows
    run = _greedy_engine_run(target.table.clone(), target, adaptive)
    assert run.result().token_ids == plain
    assert run.num_draft_tokens > 4 and run.metrics.acceptance_rate == 1.0
    assert run.metrics.mean_num_draft_tokens > 4
    # draft's argmax is the target's argmin: every draft token rejected -> k shrinks to 1
    run = _greedy_engine_run(-target.table.nan_to_num(neginf=-1e4), target, adaptive)
    assert run.result().token_ids == plain
    assert run.metrics.acceptance_rate == 0.0 and run.num_draft_tokens == 1


def test_goodput_policy_picks_large_k_for_good_cheap_drafts_and_min_for_bad_costly_ones():
    good = GoodputPolicyConfig(cost_ratio=0.02, max_num_draft_tokens=16).build(4)
    for _ in range(10):
        k_good = good.next_num_draft_tokens(_stats(4, 200, 0.95))
    assert k_good >= 8
    bad = GoodputPolicyConfig(cost_ratio=1.0, max_num_draft_tokens=16).build(4)
    for _ in range(10):
        k_bad = bad.next_num_draft_tokens(_stats(4, 200, 0.1))
    assert k_bad == 1
    bad_with_floor = GoodputPolicyConfig(cost_ratio=1.0, min_num_draft_tokens=3).build(4)
    assert bad_with_floor.next_num_draft_tokens(_stats(4, 200, 0.1)) == 3


@pytest.mark.parametrize("rate, cost_ratio", [(0.75, 0.05), (0.9, 0.1), (0.5, 0.02),
                                              (0.6, 0.5)])
def test_goodput_policy_with_exact_estimates_matches_optimal_num_draft_tokens(rate, cost_ratio):
    # prior_acceptance = rate and observed rate = rate exactly: every estimate equals rate, so
    # the policy's argmax is the closed-form one
    policy = GoodputPolicyConfig(cost_ratio=cost_ratio, max_num_draft_tokens=16,
                                 prior_acceptance=rate).build(4)
    stats = RoundStats(16, (1000,) * 16, (round(1000 * rate),) * 16, 0.01, 0.1)
    assert policy.acceptance_estimates() == pytest.approx([rate] * 16)
    k = policy.next_num_draft_tokens(stats)
    assert policy.acceptance_estimates() == pytest.approx([rate] * 16)
    assert k == optimal_num_draft_tokens(rate, cost_ratio, 16)[0]


def _timed_stats(k: int, rate: float, draft_step: float, target_call) -> RoundStats:
    """A round of 1000 rows accepting each tested position at ``rate``, with given timings."""
    stats = _stats(k, 1000, rate)
    return replace(stats, draft_time=k * draft_step, target_time=target_call(k))


def _true_best_k(rate: float, draft_step: float, target_call, max_k: int) -> int:
    goodput = {k: sum(rate ** i for i in range(k + 1)) / (k * draft_step + target_call(k))
               for k in range(1, max_k + 1)}
    return max(goodput, key=goodput.get)


@pytest.mark.parametrize("name, target_call", [
    ("flat", lambda k: 1.0),  # a GPU-like pass: verifying k + 1 tokens costs one step
    ("steep", lambda k: 1.0 + 0.5 * k),  # a CPU-like pass: each extra token costs half a step
    ("mild", lambda k: 1.0 + 0.1 * k),
])
def test_goodput_policy_with_measured_costs_finds_the_true_best_k(name, target_call):
    # The policy only sees the timings of the depths it runs (plus its probes). It must end at
    # the k maximising E(k) / (k d + T(k)) for the true T; the old cost model (k c + 1, c at
    # the current depth) drifts to k = 5 in the steep case, where the best is 1.
    rate, draft_step, max_k = 0.73, 0.25, 8
    expected = _true_best_k(rate, draft_step, target_call, max_k)
    policy = GoodputPolicyConfig(max_num_draft_tokens=max_k, prior_acceptance=rate,
                                 probe_every=8).build(4)
    k, used = 4, []
    for _ in range(200):
        k = policy.next_num_draft_tokens(_timed_stats(k, rate, draft_step, target_call))
        used.append(k)
    assert policy.num_draft_tokens == expected, (name, expected, used[-20:])
    assert used[-20:].count(expected) >= 16  # probes aside, it runs at the best k
    if name == "steep":
        assert expected == 1
    costs = policy.round_costs()
    for depth in (expected, min(expected + 1, max_k)):  # measured where it runs and probes
        assert costs[depth - 1] == pytest.approx(depth * draft_step + target_call(depth))


def test_goodput_policy_never_prices_a_depth_below_a_measured_call():
    # Review finding: a least-squares line through two nearby depths, one slowed by an outlier,
    # went negative at shallow depths and the policy jumped there. Shallow depths now cost at
    # least the cheapest recently measured call; zero timings fall back to the fixed model.
    policy = GoodputPolicyConfig(max_num_draft_tokens=8, probe_every=0,
                                 prior_acceptance=0.7).build(4)
    for k, target_time in ((4, 0.010), (4, 0.010), (4, 0.010), (5, 0.020)):
        stats = replace(_stats(k, 100, 0.7), draft_time=k * 0.001, target_time=target_time)
        policy.next_num_draft_tokens(stats)
    costs = policy.round_costs()
    assert all(later > earlier for earlier, later in zip(costs, costs[1:]))  # rising with k
    assert costs[0] >= 0.001 + 0.010 - 1e-12  # one draft step + at least T(4)
    zero = GoodputPolicyConfig().build(4)
    assert 1 <= zero.next_num_draft_tokens(RoundStats(4, (1, 1, 1, 1), (1, 1, 1, 0), 0.0,
                                                      0.0)) <= 16


def test_engine_starts_an_adaptive_run_within_the_policys_bounds():
    decoder, _ = _decoder()
    config = GenerationConfig(max_new_tokens=30, seed=0, sampling=GREEDY)
    run = decoder.stream(PROMPTS, config, options=BatchOptions(
        adaptive=GoodputPolicyConfig(max_num_draft_tokens=6), num_draft_tokens=24))
    next(run)  # the first round
    assert run.metrics.num_drafted <= 6 * len(PROMPTS)
    assert len(run.metrics.per_position_acceptance) <= 6


def test_goodput_policy_probes_neighbours_only_with_measured_costs():
    measured = GoodputPolicyConfig(max_num_draft_tokens=8, probe_every=4).build(3)
    given = GoodputPolicyConfig(max_num_draft_tokens=8, probe_every=4, cost_ratio=0.2).build(3)
    never = GoodputPolicyConfig(max_num_draft_tokens=8, probe_every=0).build(3)
    outputs = {name: [policy.next_num_draft_tokens(_stats(3, 100, 0.7)) for _ in range(16)]
               for name, policy in (("measured", measured), ("given", given), ("never", never))}
    assert len(set(outputs["measured"])) > 1  # every 4th round a neighbour
    assert len(set(outputs["given"][2:])) == 1 and len(set(outputs["never"][2:])) == 1


def test_goodput_policy_probes_ever_more_rarely_while_plain_rounds_stay_best():
    # a loaded batch: each extra token of a pass costs a whole step, drafting is dear and few
    # drafts are accepted, so k = 0 wins; its probes at k = 1 come at doubling intervals, up
    # to plain_probe_backoff * probe_every, and back at probe_every once drafting pays again
    def costly(k: int) -> RoundStats:
        return _timed_stats(k, 0.3, 0.5, lambda k: 1.0 + k)

    policy = GoodputPolicyConfig(min_num_draft_tokens=0, max_num_draft_tokens=4,
                                 prior_acceptance=0.3, probe_every=4).build(0)
    k, probes = 0, []
    for round_index in range(700):
        k = policy.next_num_draft_tokens(costly(k))
        if k:
            probes.append(round_index)
    assert probes[:2] == [0, 3]  # a first guess (no draft step timed yet), the first probe
    gaps = [later - earlier for earlier, later in zip(probes[1:], probes[2:])]
    assert gaps[:5] == [8, 16, 32, 64, 64]  # doubling from 4 rounds, capped at 16 * 4
    assert DEFAULTS.plain_probe_backoff * 4 == 64 and set(gaps[3:]) == {64}
    # drafting turns cheap: the probes' costly timings (kept through the plain stretch at one
    # round's weight) are outweighed after two cheap rounds, and probes come every 4 rounds
    cheap = [policy.next_num_draft_tokens(_timed_stats(k, 0.95, 0.01, lambda k: 1.0))
             for k in [1] * 14]
    assert cheap[:2] == [0, 0] and all(k > 0 for k in cheap[2:13])
    assert cheap[7:10] == [4, 4, 3]  # drafting at 4, a probe at 3
    assert cheap[-1] == 0  # the third probe while drafting is a plain round (plain_reprobe)


def test_a_short_drafting_excursion_keeps_the_plain_probe_backoff():
    # a server under load: plain rounds win, probes have backed off to 64 rounds; one probe's
    # timing tips the model to drafting for a few rounds (each of which made the draft catch up
    # on every row after a plain stretch, 5-37 ms over 16 rows), then plain rounds win again.
    # The next probe still waits the backed-off interval; only drafting held for probe_every
    # rounds brings probes back to every probe_every rounds
    def probes_after(excursion: int) -> list[int]:
        policy = GoodputPolicyConfig(min_num_draft_tokens=0, max_num_draft_tokens=4,
                                     probe_every=4).build(0)
        policy._observe(_stats(4, 16, 0.5))  # evidence enough to back off (thin_evidence)
        for _ in range(200):  # backs off: 8, 16, 32, 64
            policy._maybe_probe(0)
        choices = [policy._maybe_probe(1) for _ in range(excursion)]
        choices += [policy._maybe_probe(0) for _ in range(200)]
        return [i for i, k in enumerate(choices) if k > 0 and i >= excursion]

    def gaps(probes: list[int]) -> list[int]:
        return [later - earlier for earlier, later in zip(probes, probes[1:])]

    assert gaps(probes_after(3))[:2] == [64, 64]
    assert gaps(probes_after(4))[:3] == [8, 16, 32]  # drafting held: backing off afresh


def test_goodput_policy_prices_the_rounds_fixed_overhead():
    # T(k) = 1 + 0.5 k, draft steps 0.25, acceptance 0.73: k = 1 is best on compute alone, but
    # a round that also pays 3 s outside drafting and scoring (streaming, bookkeeping) is
    # cheaper per token when it carries more tokens, so a deeper k must win
    def best(other_time: float) -> int:
        policy = GoodputPolicyConfig(max_num_draft_tokens=8, prior_acceptance=0.73,
                                     probe_every=8).build(4)
        k = 4
        for _ in range(200):
            stats = replace(_timed_stats(k, 0.73, 0.25, lambda k: 1.0 + 0.5 * k),
                            other_time=other_time)
            k = policy.next_num_draft_tokens(stats)
        return policy.num_draft_tokens

    assert best(0.0) == 1
    assert best(3.0) > 1


def test_goodput_policy_ignores_a_draft_catching_up_after_plain_rounds():
    # the first round after plain ones feeds the draft their tokens too: its draft_time says
    # nothing about a step's cost and must not make drafting look dearer (and keep k at 0)
    policy = GoodputPolicyConfig(max_num_draft_tokens=8, probe_every=0).build(2)
    for _ in range(5):
        policy.next_num_draft_tokens(replace(_stats(2, 10, 0.8), draft_time=0.02))
    costs = policy.round_costs()
    policy.next_num_draft_tokens(replace(_stats(1, 10, 0.8), draft_time=0.5,
                                         draft_timed=False))
    assert policy.round_costs()[1] - policy.round_costs()[0] == pytest.approx(
        costs[1] - costs[0])  # the draft step is still 0.01 s
    policy.next_num_draft_tokens(replace(_stats(1, 10, 0.8), draft_time=0.5))
    # a timed round counts, capped at outlier_cap times the running mean
    assert policy.round_costs()[1] - policy.round_costs()[0] > costs[1] - costs[0]


@pytest.mark.parametrize("cap", [GoodputPolicyConfig().outlier_cap, math.inf])
def test_one_slow_plain_round_does_not_send_a_loaded_policy_drafting(cap):
    # a 16-row bucket in a loaded server, timings as logged: plain rounds ~7.5 ms, k = 1
    # rounds 11 ms of target and 3 of draft, acceptance 0.88: plain rounds win by less than
    # plain_margin's 10%. One plain round preempted by the event loop (17 ms) moved T(0) by
    # ~13% at decay 0.9 and tipped the policy into drafting; capped at outlier_cap times the
    # running mean it moves T(0) by ~2.5%. Control: uncapped, the same round tips it
    policy = GoodputPolicyConfig(min_num_draft_tokens=0, max_num_draft_tokens=4,
                                 probe_every=0, outlier_cap=cap).build(1)
    for _ in range(10):
        policy.next_num_draft_tokens(replace(_stats(1, 16, 0.88), draft_time=0.003,
                                             target_time=0.011))
    for _ in range(20):
        k = policy.next_num_draft_tokens(RoundStats(0, (), (), 0.0, 0.0075))
    assert k == 0
    k = policy.next_num_draft_tokens(RoundStats(0, (), (), 0.0, 0.017))
    assert (k == 0) == (cap < math.inf)


def test_goodput_policy_measures_a_plain_round_first_and_keeps_its_cost_while_drafting():
    # a policy that may choose plain rounds and starts drafting: its second round is a plain
    # one, and that round's T(0) prices plain rounds through the drafting stretch after it.
    # Priced flat from the lowest drafting depth instead, a plain round looked as dear as a
    # 4-token verification pass (at 16 rows on 2 cores: 14.9 ms against 7.3) and a policy that
    # started drafting never stopped
    policy = GoodputPolicyConfig(min_num_draft_tokens=0, max_num_draft_tokens=8,
                                 probe_every=4).build(4)
    assert policy.plain_cost() is None
    k = policy.next_num_draft_tokens(replace(_stats(4, 16, 0.5), draft_time=0.008,
                                             target_time=0.02))
    assert k == 0 and policy.plain_cost() > 0.015  # flat from the lowest depth: unmeasured
    k = policy.next_num_draft_tokens(RoundStats(0, (), (), 0.0, 0.004))
    for _ in range(30):  # drafting rounds (forced): T(0) is not forgotten
        policy.next_num_draft_tokens(replace(_stats(3, 16, 0.5), draft_time=0.006,
                                             target_time=0.018))
    assert policy.plain_cost() == pytest.approx(0.004, abs=0.001)
    assert policy.next_num_draft_tokens(replace(_stats(3, 16, 0.5), draft_time=0.006,
                                                target_time=0.018)) == 0
    assert k == 0


def test_goodput_policy_measures_plain_rounds_afresh_while_drafting():
    # a loaded server: the first plain probe came out slow (9 ms; the plain server's rounds took
    # 7.2-7.3), so drafting (~6.7 ms a token a row here) looked better than plain rounds by more
    # than plain_margin. Every plain_reprobe-th probe while drafting is a plain round; the
    # fresh 7 ms ones outweigh the stale 9 ms and the policy goes back to plain rounds. Measured
    # once and kept, the stale T(0) held it drafting for good (the server ran at 0.88x plain)
    policy = GoodputPolicyConfig(min_num_draft_tokens=0, max_num_draft_tokens=4,
                                 probe_every=4).build(3)
    k, plain_rounds = 3, []
    for round_index in range(120):
        if k == 0:
            stats = RoundStats(0, (), (), 0.0, 0.009 if not plain_rounds else 0.007)
            plain_rounds.append(round_index)
        else:
            stats = replace(_stats(k, 16, 0.9), draft_time=0.002 * k,
                            target_time=0.008 + 0.003 * k)
        k = policy.next_num_draft_tokens(stats)
    reprobe = 4 * DEFAULTS.plain_reprobe  # rounds between plain probes while drafting
    # the first at the policy's second round, then every plain_reprobe-th probe
    assert plain_rounds[:5] == [1, 1 + reprobe, 1 + 2 * reprobe, 1 + 3 * reprobe, 1 + 4 * reprobe]
    assert len(plain_rounds[4:]) >= 0.9 * (120 - plain_rounds[4])  # plain, probes of k = 1 aside
    assert policy.plain_cost() == pytest.approx(0.007, abs=2e-4)
    assert policy.num_draft_tokens == 0


def test_goodput_policy_prices_the_drafts_prefill_of_joining_rows():
    # 16 rows: a drafting round at k = 2 (2.6 tokens a row) costs 17.2 ms, a plain round 7.4:
    # 0.41 against 0.46 ms a token a row, so drafting wins by more than plain_margin. Each
    # request also costs the draft a prefill when it joins, 2.5 ms for 48 tokens (0.05 ms a
    # token), which a plain batch defers: priced per token a round emits, it makes plain rounds
    # the better choice. The same rounds without joins keep drafting
    def run(join_time: float) -> tuple[int, float]:
        policy = GoodputPolicyConfig(min_num_draft_tokens=0, max_num_draft_tokens=2,
                                     prior_acceptance=0.85, probe_every=0).build(2)
        policy.next_num_draft_tokens(RoundStats(0, (), (), 0.0, 0.0074, num_rows=16))
        for _ in range(40):
            stats = replace(_stats(2, 16, 0.85), draft_time=0.0042, target_time=0.0130,
                            num_rows=16, join_time=join_time, join_tokens=48)
            policy.next_num_draft_tokens(stats)
        return policy.num_draft_tokens, policy.join_cost()

    assert run(0.0) == (2, 0.0)
    k, join_cost = run(0.0025)
    assert join_cost == pytest.approx(0.0025 / 48) and k == 0


def test_a_long_plain_stretch_keeps_the_drafting_timings_that_made_it_plain():
    # a 16-row bucket on 2 cores, timings as logged: plain rounds 7.2 ms, a k-token
    # verification pass 7.2 + 3.3 k ms, draft steps 2.3 ms, acceptance 0.9. Drafting promises
    # ~1.07x plain rounds, inside plain_margin, so the policy runs plain rounds and probes k = 1
    # at backed-off intervals (up to 256 rounds). Plain rounds measure no drafting depth: aged
    # by them, the timings of the last probe fell below any weight ~200 rounds later, the model
    # priced every depth at T(0) and drafted k = 4-5 rounds (30 ms each, and a catch-up)
    policy = GoodputPolicyConfig(min_num_draft_tokens=0, max_num_draft_tokens=8).build(1)
    k, chosen = 1, []
    for _ in range(1200):
        if k == 0:
            stats = RoundStats(0, (), (), 0.0, 0.0072, num_rows=16)
        else:
            stats = replace(_stats(k, 16, 0.9), draft_time=0.0023 * k,
                            target_time=0.0072 + 0.0033 * k, num_rows=16)
        k = policy.next_num_draft_tokens(stats)
        chosen.append((k, policy.num_draft_tokens))
    assert all(model_k == 0 for _, model_k in chosen[100:])  # the model's own choice
    probes = [k for k, _ in chosen[100:] if k > 0]
    assert probes and set(probes) == {1} and len(probes) <= 8  # k = 1, backed off
    assert policy.round_costs()[0] == pytest.approx(0.0072 + 0.0033 + 0.0023, rel=0.05)


def test_a_first_use_alone_fades_out_of_a_plain_stretch():
    # an 8-row bucket's first round, cold (63 ms of target and 13 of draft at k = 4 against 7
    # ms plain rounds; RoundStats.timed False), is its only drafting timing: it prices drafting
    # as dear, and the bucket runs plain rounds. Such a first use weighs first_use_weight and
    # must fade out of a plain stretch (it would otherwise set the T(k) slope for good), after
    # which the policy drafts again to measure; a measured round's timings stay (test above)
    policy = GoodputPolicyConfig(min_num_draft_tokens=0, max_num_draft_tokens=8,
                                 probe_every=0).build(4)
    policy.next_num_draft_tokens(replace(_stats(4, 8, 0.9), draft_time=0.013,
                                         target_time=0.063, timed=False, num_rows=8))
    plain = RoundStats(0, (), (), 0.0, 0.007, num_rows=8)
    assert [policy.next_num_draft_tokens(plain) for _ in range(20)] == [0] * 20
    assert any(policy.next_num_draft_tokens(plain) > 0 for _ in range(300))


def test_goodput_policy_keeps_its_acceptance_estimates_through_plain_rounds():
    # plain rounds (k = 0) test no position, so they must not forget what was measured: decayed
    # towards the prior (0.6 here), a 0.95 rate would drift down and could keep k at 0 for good
    policy = GoodputPolicyConfig(min_num_draft_tokens=0, max_num_draft_tokens=8, probe_every=0,
                                 cost_ratio=0.1).build(3)
    for _ in range(30):
        policy.next_num_draft_tokens(_stats(3, 100, 0.95))
    before = policy.acceptance_estimates()
    for _ in range(50):
        policy.next_num_draft_tokens(RoundStats(0, (), (), 0.0, 0.01))
    assert policy.acceptance_estimates() == pytest.approx(before)
    assert before[0] > 0.9


def test_goodput_policy_barely_weighs_the_timings_of_a_first_use():
    # a server's first drafting round on an H200: 35.5 ms of draft steps and 8.7 ms of target
    # against 4.8 and 2.0 warm. Untimed (RoundStats.timed), it prices k = 4 until the next
    # round at that depth, which then sets the price nearly alone (first_use_weight); timed,
    # the cold round held the price at ~3x the warm one
    cold = replace(_stats(4, 1, 1.0), draft_time=0.0355, target_time=0.0087)
    warm = replace(_stats(4, 1, 1.0), draft_time=0.0048, target_time=0.0020)
    untimed = GoodputPolicyConfig(min_num_draft_tokens=0, probe_every=0).build(4)
    untimed.next_num_draft_tokens(replace(cold, timed=False))
    assert untimed.round_costs()[3] == pytest.approx(0.0442, rel=0.01)  # alone, it prices
    untimed.next_num_draft_tokens(warm)
    assert untimed.round_costs()[3] == pytest.approx(0.0068, rel=0.06)
    timed = GoodputPolicyConfig(min_num_draft_tokens=0, probe_every=0).build(4)
    timed.next_num_draft_tokens(cold)
    timed.next_num_draft_tokens(warm)
    assert timed.round_costs()[3] > 0.02


def _h200_server_rounds(num_rounds: int) -> list[int]:
    """The k a goodput-plain policy runs at one row under an H200 server's timings (measured
    per round, 2026-11-26): warm, a draft step 1.2 ms, a verification pass 2.0 ms, a plain round
    2.05 ms; the first round of each depth cold, as logged (the first at k = 4: 35.5 ms of draft
    steps). Nothing is accepted in the first two rounds; after, position j of round r is
    accepted unless (r + j) % 10 == 9 (90%)."""
    first_use = {4: (0.0355, 0.0087), 0: (0.0004, 0.0031), 1: (0.0012, 0.0041),
                 2: (0.0040, 0.0036), 3: (0.0036, 0.0020)}
    policy = GoodputPolicyConfig(min_num_draft_tokens=0).build(4)  # goodput-plain's settings
    k, run, ks, lags = 4, set(), [], False
    for round_index in range(num_rounds):
        reached, accepted = [0] * k, [0] * k
        for j in range(k):
            reached[j] = 1
            if round_index < 2 or (round_index + j) % 10 == 9:
                break
            accepted[j] = 1
        draft_time, target_time = first_use[k] if k not in run and k in first_use else (
            0.0012 * k, 0.0020 if k else 0.00205)
        stats = RoundStats(k, tuple(reached), tuple(accepted), draft_time, target_time,
                           other_time=0.00008, draft_timed=not (lags and k == 0),
                           timed=k in run)
        run.add(k)
        lags = k == 0
        ks.append(k)
        k = policy.next_num_draft_tokens(stats)
    return ks


def test_a_plain_goodput_policy_on_thin_evidence_probes_at_its_first_depth_until_it_drafts():
    # on an H200 the demo pair's drafting at one row pays ~1.3-1.6x, but a policy whose first
    # rounds (cold, nothing accepted) sent it to plain rounds learned one position per k = 1
    # probe between backed-off probes, and ran plain rounds through three load levels (0.87x
    # the plain server at one client). On thin evidence (thin_evidence tested positions) it now
    # probes at its first depth every probe_every rounds, and drafts within ~200 rounds here
    ks = _h200_server_rounds(600)
    assert ks[:2] == [4, 0]  # the first round's rejection sends it to plain rounds
    assert [i for i in range(1, 33) if ks[i] > 0] == [16, 32] and ks[16] == ks[32] == 4
    assert sum(k > 0 for k in ks[-300:]) > 0.8 * 300
    assert sum(ks[-300:]) / 300 >= 1.5


def test_a_batch_runs_the_depth_its_policy_returns():
    # a policy's return value is the next round's k (a goodput probe of a neighbouring depth
    # included), whatever depth it holds as its best
    class Alternating(GoodputPolicyConfig):
        def build(self, initial_num_draft_tokens, previous=None, costs=None):
            policy = super().build(initial_num_draft_tokens, previous)
            returned = iter([1, 3] * 50)
            policy.next_num_draft_tokens = lambda stats: next(returned)
            return policy

    decoder, _ = _decoder()
    config = GenerationConfig(max_new_tokens=40, sampling=GREEDY)
    batch = decoder.batch(options=BatchOptions(adaptive=Alternating(), num_draft_tokens=2))
    batch.add([PROMPTS[0]], [config], [make_generator(0)])
    widths = []
    while batch.rows and len(widths) < 6:
        before = batch.recorder.snapshot().num_drafted
        batch.step()
        widths.append(batch.recorder.snapshot().num_drafted - before)
    assert widths[:5] == [2, 1, 3, 1, 3]


def _recording_policy(seen: list[RoundStats], depths,
                      choice: int | None = None) -> GoodputPolicyConfig:
    """A goodput-plain config whose policies append each round's stats to ``seen`` and return
    the next of ``depths`` (an iterator of k) instead of choosing; with ``choice``, they hold
    it as their own depth (a returned k > 0 is then a probe when choice is 0)."""
    class Recording(GoodputPolicyConfig):
        def build(self, initial_num_draft_tokens, previous=None, costs=None):
            policy = super().build(initial_num_draft_tokens, previous)

            def next_depth(stats: RoundStats) -> int:
                seen.append(stats)
                if choice is not None:
                    policy.num_draft_tokens = choice
                return next(depths)
            policy.next_num_draft_tokens = next_depth
            return policy

    return Recording(min_num_draft_tokens=0)


def _probing_batch(target: MarkovLM, prompts: list[list[int]], choice: int):
    """(batch, rows, seen): ``prompts`` in a greedy batch whose draft is the target (all
    accepted), under a recording policy that returns k = 2 every round and holds ``choice``
    as its own depth (_recording_policy), 12 tokens a row."""
    decoder = Engine.from_draft_model(target, target)
    seen: list[RoundStats] = []
    config = GenerationConfig(max_new_tokens=12, sampling=GREEDY)
    batch = decoder.batch(options=BatchOptions(
        adaptive=_recording_policy(seen, itertools.repeat(2), choice), num_draft_tokens=2))
    rows = batch.add(prompts, [config] * len(prompts),
                     [make_generator(i) for i in range(len(prompts))])
    return batch, rows, seen


@pytest.mark.parametrize("choice", [0, 2])
def test_a_probe_from_plain_rounds_keeps_one_token_a_row_and_reports_what_it_verified(choice):
    # a policy whose choice is plain rounds probes k = 2 with a draft that is the target (all
    # accepted): the probe only measures, so each row keeps its first token and rows that
    # advanced together still do, while the policy still sees both positions accepted.
    # Control: the same rounds chosen by the policy (choice 2) keep all three tokens a row
    target = _target()
    batch, rows, seen = _probing_batch(target, PROMPTS, choice)
    tokens = {row.id: [] for row in rows}
    emitted = []
    while batch.rows:
        step = batch.step()
        emitted.append([len(new) for _, new in step])
        for row, new in step:
            tokens[row.id] += new
        if len(emitted) == 2:
            drafted = [row.metrics.num_drafted for row in rows]
    assert emitted[0] == [3, 3, 3]  # the first round: the policy's starting depth, all kept
    assert seen[1].num_draft_tokens == 2 and seen[1].num_accepted_at == (3, 3)
    if choice == 0:
        assert emitted[1:] == [[1, 1, 1]] * 9  # each probe keeps the rows' first tokens
        assert drafted == [2, 2, 2]  # a row's metrics count the probe as a plain round
    else:
        assert emitted[1:] == [[3, 3, 3]] * 3
        assert drafted == [4, 4, 4]
    for row, prompt in zip(rows, PROMPTS):
        assert tokens[row.id] == _plain_greedy(target, prompt, 12)


def test_a_probe_over_one_row_keeps_every_accepted_token():
    # one row has no rows to keep in step with: a probe's accepted tokens are kept
    batch, _, _ = _probing_batch(_target(), PROMPTS[:1], 0)
    batch.step()
    assert [len(new) for _, new in batch.step()] == [3]


def test_a_fresh_goodput_plain_policy_times_a_plain_round_second():
    # a fresh 9-16-row bucket drafting at its starting depth until its first probe broke a
    # server's rows into cohorts for the rest of a level; now its second round is plain
    policy = GoodputPolicyConfig(min_num_draft_tokens=0, probe_every=16).build(4)
    assert policy.next_num_draft_tokens(replace(_stats(4, 16, 0.9), draft_time=0.004,
                                                target_time=0.01)) == 0
    drafting_only = GoodputPolicyConfig(probe_every=16).build(4)  # plain rounds not allowed
    assert drafting_only.next_num_draft_tokens(replace(_stats(4, 16, 0.9), draft_time=0.004,
                                                       target_time=0.01)) > 0
    started_plain = GoodputPolicyConfig(min_num_draft_tokens=0, probe_every=16).build(0)
    started_plain.next_num_draft_tokens(RoundStats(0, (), (), 0.0, 0.01))
    assert started_plain._plain_probe_due is False  # its first round was plain already


def test_a_batch_hands_its_policy_the_drafts_prefill_of_joining_rows():
    # a join's draft prefill reaches the policy with the next round's stats (and only that
    # round's); a row joining after a plain round defers its draft work, and nothing is priced
    seen: list[RoundStats] = []
    decoder, _ = _decoder()
    config = GenerationConfig(max_new_tokens=20, sampling=GREEDY)
    batch = decoder.batch(options=BatchOptions(adaptive=_recording_policy(seen, iter([0] * 10)),
                                               num_draft_tokens=2))
    batch.add([PROMPTS[0]], [config], [make_generator(0)])
    batch.step()  # drafts at k = 2; the policy then returns 0
    batch.step()  # plain
    batch.add([PROMPTS[1]], [replace(config, max_new_tokens=30)], [make_generator(1)])
    batch.step()
    assert seen[0].num_draft_tokens == 2 and seen[0].join_time > 0
    assert seen[0].join_tokens == 20 and seen[0].num_rows == 1
    assert (seen[1].join_time, seen[1].join_tokens) == (0.0, 0)
    assert (seen[2].join_time, seen[2].join_tokens, seen[2].num_rows) == (0.0, 0, 2)  # deferred


def test_a_batch_marks_the_first_round_of_each_shape_untimed():
    # RoundStats.timed: the first round at a depth in a batch-size bucket pays one-off costs,
    # so the policy is told not to price it; later ones are timed
    seen: list[RoundStats] = []
    decoder, _ = _decoder()
    config = GenerationConfig(max_new_tokens=40, sampling=GREEDY)
    batch = decoder.batch(options=BatchOptions(
        adaptive=_recording_policy(seen, iter([2, 3, 3, 2, 0, 0, 2, 2, 2])), num_draft_tokens=2))
    batch.add([PROMPTS[0]], [config], [make_generator(0)])
    for _ in range(6):
        batch.step()
    batch.add([PROMPTS[1]], [config], [make_generator(1)])  # 2 rows: new shapes
    for _ in range(3):
        batch.step()
    # (the 2-row rounds follow the 2-row bucket's own policy, which starts at k = 2)
    assert [(s.num_rows, s.num_draft_tokens) for s in seen] == [
        (1, 2), (1, 2), (1, 3), (1, 3), (1, 2), (1, 0), (2, 2), (2, 2), (2, 2)]
    assert [s.timed for s in seen] == [False, True, False, True, True, False, False, True,
                                       True]


def test_goodput_policy_with_zero_prior_weight_handles_unreached_positions():
    # GoodputPolicyConfig accepts prior_weight=0 (its check is prior_weight >= 0), so the policy
    # must cope with positions no round has reached yet (reached = 0, nothing to shrink towards).
    # Regression: acceptance_estimates once divided 0 by 0 there (ZeroDivisionError).
    policy = GoodputPolicyConfig(cost_ratio=0.1, max_num_draft_tokens=8, prior_weight=0.0
                                 ).build(4)
    k = policy.next_num_draft_tokens(_stats(4, 10, 0.8))
    assert 1 <= k <= 8
    assert all(0.0 <= rate <= 1.0 for rate in policy.acceptance_estimates())
    # all-rejected round: every position past 0 unreached
    assert 1 <= policy.next_num_draft_tokens(_stats(4, 10, 0.0)) <= 8


def test_goodput_policy_through_the_engine_keeps_the_greedy_output():
    target = _target(order=2, seed=9)
    plain = [_plain_greedy(target, p, 60) for p in PROMPTS]
    adaptive = GoodputPolicyConfig(cost_ratio=0.05, max_num_draft_tokens=12)
    run = _greedy_engine_run(target.table.clone(), target, adaptive)
    assert run.result().token_ids == plain
    assert run.num_draft_tokens == 12  # perfect, cheap draft: the maximum
    run = _greedy_engine_run(_noisy_draft(target, scale=2.0).table, target,
                             GoodputPolicyConfig(cost_ratio=0.5, max_num_draft_tokens=12))
    assert run.result().token_ids == plain


def test_goodput_policy_with_min_zero_falls_back_to_plain_rounds():
    # min_num_draft_tokens=0: k = 0 (one token per target call) competes with every depth.
    # A hopeless, costly draft -> plain rounds; a good cheap one -> still deep drafts.
    bad = GoodputPolicyConfig(cost_ratio=1.0, min_num_draft_tokens=0).build(4)
    for _ in range(10):
        k_bad = bad.next_num_draft_tokens(_stats(4, 200, 0.1))
    assert k_bad == 0
    good = GoodputPolicyConfig(cost_ratio=0.02, min_num_draft_tokens=0).build(4)
    for _ in range(10):
        k_good = good.next_num_draft_tokens(_stats(4, 200, 0.95))
    assert k_good >= 8
    # with measured costs: plain rounds at T(0) = 0.1 s beat k = 1 at 0.05 s of draft + a
    # 0.2 s target call when the draft is never accepted; probes still revisit k = 1: every
    # probe_every rounds while its acceptance rests on few positions (thin_probes of them),
    # then at intervals that double while plain rounds stay the best
    measured = GoodputPolicyConfig(min_num_draft_tokens=0, probe_every=4).build(1)
    used = []
    for _ in range(48):
        k = measured.num_draft_tokens if not used else used[-1]
        stats = (RoundStats(0, (), (), 0.0, 0.1) if k == 0 else
                 RoundStats(k, (1,) + (0,) * (k - 1), (0,) * k, 0.05 * k, 0.2))
        used.append(measured.next_num_draft_tokens(stats))
    assert used[-4:].count(0) == 4
    assert [i for i, k in enumerate(used) if k == 1] == [3, 7, 11, 15, 19, 27, 43]


def test_goodput_policy_with_min_zero_through_the_engine():
    # every draft token rejected (the draft's argmax is the target's argmin) and a draft step
    # as costly as a target call: the run goes plain, and the output is still the target's
    target = _target(order=2, seed=8)
    plain = [_plain_greedy(target, p, 60) for p in PROMPTS]
    adaptive = GoodputPolicyConfig(cost_ratio=1.0, min_num_draft_tokens=0)
    run = _greedy_engine_run(-target.table.nan_to_num(neginf=-1e4), target, adaptive)
    assert run.result().token_ids == plain
    metrics = run.metrics
    assert run.num_draft_tokens == 0 and metrics.acceptance_rate == 0.0
    assert metrics.num_draft_steps < 0.2 * metrics.num_rounds  # nearly all rounds plain
    # and a perfect draft keeps drafting deep under the same policy
    run = _greedy_engine_run(target.table.clone(), target,
                             GoodputPolicyConfig(cost_ratio=0.05, min_num_draft_tokens=0))
    assert run.result().token_ids == plain and run.metrics.mean_num_draft_tokens > 4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_adaptive_runs_respect_max_new_tokens_and_metrics(temperature):
    decoder, _ = _decoder(order=2)
    for adaptive in (ThresholdPolicyConfig(max_num_draft_tokens=8), GoodputPolicyConfig()):
        config = GenerationConfig(max_new_tokens=33, seed=4,
                                  sampling=SamplingConfig(temperature=temperature))
        result = decoder.generate(PROMPTS, config, options=BatchOptions(adaptive=adaptive,
                                                                        num_draft_tokens=2))
        assert [len(row) for row in result.token_ids] == [33] * len(PROMPTS)
        assert len(result.metrics.per_position_acceptance) <= adaptive.max_num_draft_tokens
        assert result.metrics.num_emitted == 33 * len(PROMPTS)


# --- carry-over of adaptive state between generations ----------------------------------------


def test_policies_resume_from_a_copy_of_the_previous_generations_state():
    for config in (ThresholdPolicyConfig(max_num_draft_tokens=8, window=1, carry_over=True),
                   GoodputPolicyConfig(cost_ratio=0.02, max_num_draft_tokens=8,
                                       carry_over=True)):
        first = config.build(2)
        for _ in range(10):
            first.next_num_draft_tokens(_stats(first.num_draft_tokens, 200, 1.0))
        assert first.num_draft_tokens == 8
        resumed = config.build(2, previous=first)
        assert resumed is not first and resumed.num_draft_tokens == 8  # initial k not used
        resumed.next_num_draft_tokens(_stats(8, 200, 0.0))  # the copy learns alone
        assert first.num_draft_tokens == 8
        assert config.build(2).num_draft_tokens == 2  # without previous: fresh
    with pytest.raises(ConfigError, match="same config"):
        GoodputPolicyConfig(carry_over=True).build(2, previous=GoodputPolicyConfig().build(2))


def test_carry_over_through_the_engine_starts_where_the_last_generation_ended():
    # a perfect draft: goodput (fixed cost ratio) climbs from k = 1 to its maximum in the first
    # generation; with carry_over the second starts there, without it it starts again at 1
    target = _target(order=2, seed=9)
    decoder = Engine.from_draft_model(target, MarkovLM(target.table.clone(), 2))
    plain = [_plain_greedy(target, p, 40) for p in PROMPTS]

    def first_round_k(adaptive):
        config = GenerationConfig(max_new_tokens=40, sampling=GREEDY, seed=0)
        run = decoder.stream(PROMPTS, config, options=BatchOptions(adaptive=adaptive,
                                                                   num_draft_tokens=1))
        chunks = list(run)
        assert run.result().token_ids == plain  # any k: the target's greedy output
        return max(len(row) for row in chunks[0].token_ids), run.num_draft_tokens

    carried = GoodputPolicyConfig(cost_ratio=0.05, max_num_draft_tokens=12, carry_over=True)
    fresh = replace(carried, carry_over=False)
    assert first_round_k(carried) == (2, 12)  # k = 1 first: 1 accepted + the bonus
    assert first_round_k(carried) == (13, 12)  # resumed at k = 12: 12 accepted + the bonus
    assert first_round_k(fresh) == (2, 12)
    assert first_round_k(fresh) == (2, 12)
    # state is kept per policy config, sampling settings and batch size
    assert first_round_k(replace(carried, max_num_draft_tokens=11)) == (2, 11)
    assert len(decoder.carried_policies) == 2


@pytest.mark.parametrize("adaptive", [ThresholdPolicyConfig(), GoodputPolicyConfig(cost_ratio=0.1)])
def test_a_seed_fixes_sampled_output_under_policies_that_depend_on_the_request_alone(adaptive):
    # threshold and goodput with a given cost ratio choose k from acceptance counts only, so a
    # seeded sampled request is reproducible; with carry-over its k, and so the random numbers
    # it uses, depend on earlier requests (goodput with measured costs: on wall-clock timings)
    decoder, _ = _decoder(order=2)
    config = GenerationConfig(max_new_tokens=40, seed=11, sampling=SamplingConfig(temperature=1.0))
    options = BatchOptions(adaptive=adaptive, num_draft_tokens=2)
    first = decoder.generate(PROMPTS, config, options=options)
    assert decoder.generate(PROMPTS, config, options=options).token_ids == first.token_ids
    assert decoder.generate(PROMPTS, replace(config, seed=12),
                            options=options).token_ids != first.token_ids


def test_goodput_policy_leaves_plain_rounds_only_for_a_clear_gain():
    # with a cost ratio given, plain rounds yield 1 token per call and k = 1 yields 1 + a per
    # 1 + c calls: drafting is chosen once it promises plain_margin times plain's goodput, not
    # at the first percent ahead (leaving plain rounds costs a catch-up the model leaves out)
    def chosen(rate: float) -> int:
        policy = GoodputPolicyConfig(min_num_draft_tokens=0, max_num_draft_tokens=1,
                                     cost_ratio=0.5).build(0)
        for _ in range(40):
            k = policy.next_num_draft_tokens(_stats(1, 1000, rate))
        return k

    # goodput(1) / goodput(0) = (1 + rate) / 1.5
    assert chosen(0.55) == 0  # 1.03x: within the margin
    assert chosen(0.75) == 1  # 1.17x: clear
    assert DEFAULTS.plain_margin == pytest.approx(1.1)


@pytest.mark.parametrize("catch_up_time", [0.0, 0.9], ids=["no-catch-up", "catch-up"])
def test_probes_from_plain_rounds_are_priced_by_the_drafts_catch_up(catch_up_time):
    # plain rounds of 88 ms win against a draft that costs 0.6 of the target per token at
    # acceptance 0.5. Each probe from them makes the draft catch up on the rows' tokens since
    # it last ran; a new request's whole prompt with them, 0.9 s here. Those probes may take
    # probe_share (2%) of the plain rounds' time: one every 0.9 / (0.02 * 0.088) = 512 rounds
    # at least. Control: probes whose catch-up costs nothing keep the doubling interval, at
    # most plain_probe_backoff * probe_every = 256 rounds apart
    config = GoodputPolicyConfig(min_num_draft_tokens=0, max_num_draft_tokens=4,
                                 thin_probes=1)
    policy, k, probes = config.build(0), 0, []
    for round_index in range(2000):
        if k == 0:
            stats = RoundStats(0, (), (), 0.0, 0.088)
        else:
            probes.append(round_index)
            stats = replace(_stats(k, 1, 0.5), draft_time=0.05 * k, target_time=0.13,
                            catch_up_time=catch_up_time)
        k = policy.next_num_draft_tokens(stats)
    gaps = [later - earlier for earlier, later in zip(probes, probes[1:])]
    priced = math.ceil(0.9 / (config.probe_share * 0.088))
    if catch_up_time:
        assert len(probes) >= 3 and min(gaps[1:]) >= priced > 256
    else:
        assert max(gaps) <= config.plain_probe_backoff * config.probe_every < priced
    assert policy.num_draft_tokens == 0
