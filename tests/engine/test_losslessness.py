"""Statistical proof that speculative decoding is lossless, through the engine.

The claim (Leviathan et al. 2023, Theorem 1; Chen et al. 2023): whatever the draft, the tokens the
engine emits have exactly the target's law. The test: generate 20,000 rows from one prompt with
Engine.generate, and compare the empirical joint law of emitted token pairs with the
target's exact law, enumerated from the fixture (helpers_stats.first_two_law / pair_law), by a
G-test (helpers_stats.g_test: probability-0 cells must stay empty, cells with expected count < 5
pooled). A case passes at p > ALPHA.

The harness is shown to have teeth: the same engine, sample size and G-test with the acceptance
rule swapped (monkeypatched into verispec.engine.verification.verify_rows) for three classic
mistakes is rejected at p < 1e-6, while the same injected code with the correct rule passes.
The pairs and the law checks live in tests/helpers/law_checks.py, the injected rules in
tests/helpers/injected_rules.py.

Deep positions. The engine never drafts past max_new_tokens (k = min(k, remaining - 1)), so a run
with max_new_tokens = 2 would verify at most one draft token whatever k is. Each case therefore
generates max_new_tokens = k + 1 tokens, so the first round really drafts k, and tests two laws:
(x1, x2), and (x_k, x_{k+1}), the pair produced by the deepest draft positions.

Legend: N samples (rows), V vocabulary, k draft tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec import (
    Engine,
    GenerationConfig,
    MarkovLM,
    PenaltyConfig,
    SamplingConfig,
)
from verispec.config import VERIFICATION_RULES
from verispec.engine.metrics import GenerationMetrics
from verispec.sample.sampling import make_generator

from helpers_stats import first_two_law, g_test, pair_law
from injected_rules import (
    _accept_all,
    _exact_accept,
    _residual,
    _rule_verify,
    _target,
    _threshold_accept,
    inject_verify,
)
from law_checks import (
    EXTREME_CASES,
    NUM_SAMPLES,
    PAIR_NAMES,
    PROMPT,
    Pair,
    _assert_control_rejected,
    _assert_target_law,
    _check_law,
    _pair,
    extreme_case,
)

pytestmark = pytest.mark.usefixtures("single_thread_torch")

K_VALUES = (1, 2, 4, 8)


# Coverage: every pair x every k at temperature 1 (40 cases); at temperature 0.7 every pair runs
# at two k values, rotated so each k in K_VALUES is used by 5 pairs (20 cases). The full
# 80-case grid would add 20 runs of 20,000 rows (30-50 s on 2 busy cores) for little extra
# power: temperature only reshapes the distributions, which the 10 pairs already vary.
def _cases() -> list:
    cases = [(name, k, 1.0) for name in PAIR_NAMES for k in K_VALUES]
    for index, name in enumerate(PAIR_NAMES):
        for k in (K_VALUES[index % 4], K_VALUES[(index + 2) % 4]):
            cases.append((name, k, 0.7))
    # each case under one of the two rejection rules, alternately
    return [pytest.param(name, k, t, 30_000 + index, VERIFICATION_RULES[index % 2],
                         id=f"{name}-k{k}-T{t}-{VERIFICATION_RULES[index % 2]}")
            for index, (name, k, t) in enumerate(cases)]


def _generate(pair: Pair, k: int, temperature: float, seed: int,
              num_samples: int = NUM_SAMPLES, verification: str = "token"
              ) -> tuple[np.ndarray, GenerationMetrics]:
    """Emitted tokens [N, k+1] of N identical prompts in one batch, and the run's metrics.
    Unseeded rows (rejection sampling under ``verification``) drawing from one generator
    seeded by ``seed``; seeded rows race on keyed clocks instead (test_seed_invariance.py)."""
    decoder = Engine.from_draft_model(pair.target, pair.draft)
    config = GenerationConfig(max_new_tokens=k + 1, num_draft_tokens=k,
                              sampling=pair.sampling(temperature), verification=verification)
    result = decoder.generate([PROMPT] * num_samples, config, generator=make_generator(seed))
    assert set(result.finish_reasons) == {"length"}
    return np.array(result.token_ids, dtype=np.int64), result.metrics


# --- the harness itself ----------------------------------------------------------------------


@pytest.mark.parametrize("name", PAIR_NAMES)
def test_pair_law_after_two_steps_is_the_direct_enumeration(name):
    pair = _pair(name)
    for temperature in (1.0, 0.7):
        sampling = pair.sampling(temperature)
        direct = first_two_law(pair.target, PROMPT, sampling)
        np.testing.assert_allclose(pair_law(pair.target, PROMPT, sampling, 2), direct, atol=1e-7)
        assert direct.sum() == pytest.approx(1.0, abs=1e-6)
        for n in (3, 5, 9):
            assert pair_law(pair.target, PROMPT, sampling, n).sum() == pytest.approx(1.0, abs=1e-5)


def test_g_test_pools_rare_cells_and_fails_on_impossible_cells():
    probs = np.array([0.5, 0.3, 0.1999, 0.0001, 0.0])
    counts = np.array([500, 300, 200, 0, 0])
    assert g_test(counts, probs).p_value > 0.5
    assert g_test(counts, probs).dof == 2  # the 0.1 expected cell joined the smallest one
    assert g_test(np.array([500, 300, 199, 0, 1]), probs).p_value == 0.0
    assert g_test(np.array([600, 300, 100, 0, 0]), probs).p_value < 1e-6


# --- the losslessness cases ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("pair_name, k, temperature, seed, verification", _cases())
def test_engine_output_law_equals_target_law(pair_name, k, temperature, seed, verification):
    pair = _pair(pair_name)
    tokens, metrics = _generate(pair, k, temperature, seed, verification=verification)
    assert tokens.shape == (NUM_SAMPLES, k + 1)
    assert metrics.num_drafted >= NUM_SAMPLES * k  # the first round drafted k for every row
    if pair_name == "equal":
        assert metrics.acceptance_rate == 1.0
    if pair_name == "disjoint":
        assert metrics.acceptance_rate == 0.0
    _assert_target_law(f"real {pair_name} k={k} T={temperature}",
                       _check_law(pair.target, tokens, pair.sampling(temperature)))


# Batch 1 costs a full engine call per sample (~3-6 ms on 2 busy cores), so two cases with the
# fewest rounds; deep positions are covered by the batched cases above.
BATCH_ONE_CASES = [("markov2_zeros", 1, 1.0), ("top_p", 1, 0.7)]


@pytest.mark.slow
@pytest.mark.parametrize("pair_name, k, temperature", BATCH_ONE_CASES)
def test_batch_one_calls_have_the_target_law(pair_name, k, temperature):
    # One generate call per sample, batch 1. Each call gets its own generator seed, so the calls
    # draw from independent streams (a repeated seed would repeat the sample, not add one). The
    # decoder holds no per-request state, so one decoder serves every call.
    pair = _pair(pair_name)
    decoder = Engine.from_draft_model(pair.target, pair.draft)
    config = GenerationConfig(max_new_tokens=k + 1, num_draft_tokens=k,
                              sampling=pair.sampling(temperature))
    num_samples = 3_000
    tokens = np.array([decoder.generate([PROMPT], config,
                                        generator=make_generator(50_000 + i)).token_ids[0]
                       for i in range(num_samples)], dtype=np.int64)
    _assert_target_law(f"batch1 {pair_name} k={k} T={temperature}",
                       _check_law(pair.target, tokens, pair.sampling(temperature)))


# --- negative controls: the same harness must reject broken acceptance rules -----------------


CONTROL_PAIR = "reversed"
CONTROL_K = 2


def _controlled_results(monkeypatch, accept, recover, pair_name, seed):
    inject_verify(monkeypatch, _rule_verify(accept, recover))
    pair = _pair(pair_name)
    tokens, _ = _generate(pair, CONTROL_K, 1.0, seed)
    return _check_law(pair.target, tokens, pair.sampling(1.0))


@pytest.mark.slow
@pytest.mark.parametrize("pair_name", [CONTROL_PAIR])
def test_injected_exact_rule_passes(monkeypatch, pair_name):
    # The positive control for the negative controls: the injected code path with the correct
    # rule is accepted, so a rejection below is due to the rule, not to the injection.
    _assert_target_law(f"injected-exact {pair_name}", _controlled_results(
        monkeypatch, _exact_accept, _residual, pair_name, seed=777))


@pytest.mark.slow
@pytest.mark.parametrize("control, accept, recover", [
    ("fixed_ratio_threshold", _threshold_accept, _residual),
    ("accept_everything", _accept_all, _residual),
    ("resample_from_target", _exact_accept, _target),
])
@pytest.mark.parametrize("pair_name", [CONTROL_PAIR])
def test_negative_control_is_rejected(monkeypatch, control, accept, recover, pair_name):
    _assert_control_rejected(f"{control} {pair_name}", _controlled_results(
        monkeypatch, accept, recover, pair_name, seed=778))


# --- a low temperature and a logit_bias of +-100 ---------------------------------------------

# Near-certain draft and target rows (tails below 2^-53, fp32 subnormals and zeros) broke the
# block rule's arithmetic where the fixture pairs above never go. Each extreme case runs under
# both rules; the cold ones at k = 2 and 4 (the block rule needs k >= 2 to meet w = 1 with a
# residual mass near 0). 5,000 rows suffice for the cold laws' ~30 cells, 3,000 for the biased
# ones (each row's logits processed on the host: the costlier path).
EXTREME_ENGINE_CASES = [
    pytest.param(name, k, rule, 40_000 + index, id=f"{name}-k{k}-{rule}")
    for index, (name, k, rule) in enumerate([
        ("cold_T0.01", 4, "block"), ("cold_T0.01", 2, "token"),
        ("cold_T0.1", 2, "block"), ("cold_T0.1", 4, "token"),
        ("bias_plus100", 2, "block"), ("bias_plus100", 2, "token"),
        ("bias_minus100", 2, "block"), ("bias_minus100", 2, "token")])]
assert {param.values[0] for param in EXTREME_ENGINE_CASES} == set(EXTREME_CASES)


def _extreme_samples(name: str) -> int:
    return 5_000 if name.startswith("cold") else 3_000


def _generate_extreme(name: str, k: int, seed: int, verification: str = "token"
                      ) -> tuple[np.ndarray, GenerationMetrics]:
    """_generate for an extreme case: its temperature and its logit_bias (draft and target)."""
    case = extreme_case(name)
    decoder = Engine.from_draft_model(case.pair.target, case.pair.draft)
    config = GenerationConfig(max_new_tokens=k + 1, num_draft_tokens=k,
                              sampling=case.pair.sampling(case.temperature),
                              verification=verification, penalty=case.penalty)
    result = decoder.generate([PROMPT] * _extreme_samples(name), config,
                              generator=make_generator(seed))
    return np.array(result.token_ids, dtype=np.int64), result.metrics


@pytest.mark.slow
@pytest.mark.parametrize("name, k, verification, seed", EXTREME_ENGINE_CASES)
def test_engine_output_law_at_low_temperature_and_extreme_bias(name, k, verification, seed):
    case = extreme_case(name)
    tokens, metrics = _generate_extreme(name, k, seed, verification)
    assert metrics.num_drafted >= _extreme_samples(name) * k
    assert 0.0 < metrics.acceptance_rate < 1.0  # kept and rejected draft tokens both occur
    _assert_target_law(f"extreme {name} k={k} {verification}", _check_law(
        case.law_target, tokens, case.pair.sampling(case.temperature)))


@pytest.mark.slow
@pytest.mark.parametrize("name, control, accept, recover", [
    ("cold_T0.1", "accept_everything", _accept_all, _residual),
    ("cold_T0.1", "resample_from_target", _exact_accept, _target),
    ("bias_minus100", "resample_from_target", _exact_accept, _target),
])
def test_negative_control_is_rejected_at_extremes(monkeypatch, name, control, accept, recover):
    inject_verify(monkeypatch, _rule_verify(accept, recover))
    case = extreme_case(name)
    tokens, _ = _generate_extreme(name, CONTROL_K, seed=779)
    _assert_control_rejected(f"{control} {name}", _check_law(
        case.law_target, tokens, case.pair.sampling(case.temperature)))


# --- greedy: token-for-token equality with plain decoding ------------------------------------


def _greedy_reference(model, prompt: list[int], num_new: int) -> list[int]:
    """Plain greedy decoding straight from the fixture's table, no engine involved."""
    context = list(prompt)
    for _ in range(num_new):
        context.append(int(model.next_logits(context).argmax()))  # ties: lowest id
    return context[len(prompt):]


def _greedy_pair(order: int, draft_kind: str) -> tuple[MarkovLM, MarkovLM]:
    target = MarkovLM.random(12, make_generator(80 + order), order=order, zero_fraction=0.2)
    if draft_kind == "noisy":  # agrees with the target's argmax often, not always
        noise = torch.randn(target.table.shape, generator=make_generator(90 + order))
        draft = MarkovLM(target.table + 1.5 * noise, order=order)
    else:
        draft = MarkovLM.random(12, make_generator(95 + order), order=order, zero_fraction=0.2)
    return target, draft


GREEDY_PROMPTS = {1: [[3, 5]], 3: [[3, 5], [1], [7, 7, 2, 0, 11]]}


@pytest.mark.parametrize("k", K_VALUES)
@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("order", [1, 2])
@pytest.mark.parametrize("draft_kind", ["noisy", "independent"])
def test_greedy_equals_plain_decoding(k, batch_size, order, draft_kind):
    target, draft = _greedy_pair(order, draft_kind)
    decoder = Engine.from_draft_model(target, draft)
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=k,
                              sampling=SamplingConfig(temperature=0), seed=0)
    prompts = GREEDY_PROMPTS[batch_size]
    speculative = decoder.generate(prompts, config)
    plain = decoder.generate(prompts, config, speculative=False)
    reference = [_greedy_reference(target, p, 40) for p in prompts]
    assert plain.token_ids == reference
    assert speculative.token_ids == reference
    assert speculative.finish_reasons == ["length"] * batch_size
    assert speculative.metrics.num_drafted > 0
    assert speculative.metrics.num_target_calls <= plain.metrics.num_target_calls


@pytest.mark.parametrize("bias", [((3, 100.0), (8, 100.0)), ((3, -100.0), (7, -100.0))],
                         ids=["plus100", "minus100"])
@pytest.mark.parametrize("k", [2, 4])
def test_greedy_equals_plain_decoding_under_extreme_bias(k, bias):
    # +100 on two tokens: each context's argmax among them; -100: never those two
    target, draft = _greedy_pair(1, "noisy")
    biased = torch.zeros(target.vocab_size)
    for token, value in bias:
        biased[token] = value
    decoder = Engine.from_draft_model(target, draft)
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=k,
                              sampling=SamplingConfig(temperature=0),
                              penalty=PenaltyConfig(logit_bias=bias))
    prompts = GREEDY_PROMPTS[3]
    reference = [_greedy_reference(MarkovLM(target.table + biased), p, 40) for p in prompts]
    assert decoder.generate(prompts, config, speculative=False).token_ids == reference
    assert decoder.generate(prompts, config).token_ids == reference
    assert len({token for row in reference for token in row}) >= 2


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("order", [1, 2])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_draft_equal_to_target_accepts_every_draft_token(temperature, order, k):
    target = MarkovLM.random(10, make_generator(100 + order), order=order, zero_fraction=0.2)
    draft = MarkovLM(target.table.clone(), order=order)
    decoder = Engine.from_draft_model(target, draft)
    config = GenerationConfig(max_new_tokens=30, num_draft_tokens=k, seed=1,
                              sampling=SamplingConfig(temperature=temperature))
    metrics = decoder.generate([[1, 2], [4], [0, 9, 9]], config).metrics
    assert metrics.num_drafted > 0
    assert metrics.acceptance_rate == 1.0
    assert metrics.num_accepted == metrics.num_drafted
    assert all(rate == 1.0 for rate in metrics.per_position_acceptance)
    # k + 1 tokens per target call until the max_new_tokens clamp
    assert metrics.num_rounds == -(-30 // (k + 1))
