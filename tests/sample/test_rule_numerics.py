"""Every verification rule on numerically extreme inputs: no exception, finite, valid tokens.

The rules (sample/block.py, sample/rejection.py in its host and tensor forms, sample/seeded.py's
race, sample/greedy.py) take ratios, residuals and normalisations of the probabilities that
sampling.to_probs makes from logits. At a low temperature or under a logit_bias of +-100 those
are near one-hot: their tails fall below 2^-53 (lost against 1 in float64), to fp32 subnormals,
or underflow to 0. This sweep builds such inputs from logits (SCENARIOS: near-certain rows that
agree or disagree, one-hot rows, biases of +-100 added by sample.penalties.process_logits, a draft
token of near-zero draft probability), processes them at every T in TEMPERATURES with and
without truncation (top-k, top-p, min-p), and runs each rule on them. It asserts: no exception;
every probability, weight and stop probability finite and in [0, 1]; num_accepted in [0, k];
the accepted tokens a prefix of the draft; every emitted token inside the support of the
target's processed distribution at its position. And the law where it is cheap: the block rule's
P(tau = i | X) sums to 1, its host decisions equal its tensor reference on the same etas, a draft
equal to the target keeps every token, and a target certain of a token the draft does not
propose emits that token.

Legend: B batch, K draft tokens, V vocabulary, P positions (K + 1).
"""

from __future__ import annotations

import math

import pytest
import torch

from verispec import PenaltyConfig, SamplingConfig
from verispec.sample import rejection
from verispec.sample.block import verify_block_rows
from verispec.sample.greedy import verify_greedy_rows
from verispec.sample.penalties import process_logits
from verispec.sample.rejection import residual_probs, verify_rows
from verispec.sample.sampling import (
    greedy_tokens,
    make_generator,
    sample_from_logits,
    sample_with_uniform,
    to_probs,
)
from verispec.sample.seeded import RaceClocks, race, stream_key

from rule_references import acceptance_probs, block_weights, verify_block_with_randomness

pytestmark = pytest.mark.usefixtures("single_thread_torch")

TEMPERATURES = (1e-6, 0.01, 0.1, 0.2, 0.5, 1.0, 2.0)
BATCH, K, VOCAB = 12, 4, 16  # B > rejection.HOST_ROWS_MAX_BATCH: both token-rule forms run
GAP = 4.0  # raw logit margin of a near-certain row: tails e^(-GAP / T), e^-400 at T = 0.01
SAMPLINGS = {"plain": {}, "truncated": {"top_k": 5, "top_p": 0.9, "min_p": 0.05}}


# --- inputs: target logits [B, P, V] and draft logits [B, K, V] ------------------------------


def _spread(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    return 2.0 * torch.randn(shape, generator=gen)


def _certain(gen: torch.Generator, shape: tuple[int, ...], top: torch.Tensor,
             gap: float = GAP) -> torch.Tensor:
    """Logits whose token ``top`` [...] leads the rest by at least ``gap``: near one-hot at a
    low temperature, with tails that differ from row to row."""
    logits = torch.randn(shape, generator=gen)
    return logits.scatter(-1, top[..., None], logits.amax(-1, keepdim=True) + gap)


def _biased(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """logits [B, P, V] with logit_bias added by the penalties' own code (process_logits)."""
    penalty = PenaltyConfig(logit_bias=tuple(sorted(bias.items())))
    drafted = [0] * (logits.shape[1] - 1)  # a bias does not read the history
    return torch.stack([process_logits(row, penalty, None, [], drafted) for row in logits])


def _scenario(name: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(target logits [B, P, V], draft logits [B, K, V]) of one named scenario."""
    target_shape, draft_shape = (BATCH, K + 1, VOCAB), (BATCH, K, VOCAB)
    top = torch.randint(VOCAB, (BATCH, K + 1), generator=gen)
    if name == "spread":
        target = _spread(gen, target_shape)
        return target, target[:, :K] + 0.5 * torch.randn(draft_shape, generator=gen)
    if name == "shared_certain":  # both near-certain of one token, their tails differ
        return (_certain(gen, target_shape, top),
                _certain(gen, draft_shape, top[:, :K], gap=GAP + 1.0))
    if name == "equal_certain":  # the draft is the target
        target = _certain(gen, target_shape, top)
        return target, target[:, :K].clone()
    if name == "disagree":  # each near-certain of another token
        return (_certain(gen, target_shape, top),
                _certain(gen, draft_shape, (top[:, :K] + 1) % VOCAB))
    if name == "one_hot":  # margins no temperature >= 1e-6 keeps: exact zeros after softmax
        return (_certain(gen, target_shape, top, gap=1e4),
                _certain(gen, draft_shape, top[:, :K], gap=1e4))
    if name in ("bias_plus", "bias_two_plus", "bias_minus"):
        target = _spread(gen, target_shape)
        draft = target[:, :K] + 0.5 * torch.randn(draft_shape, generator=gen)
        favourite = int(target[0, 0].argmax())
        bias = {"bias_plus": {3: 100.0}, "bias_two_plus": {3: 100.0, 11: 100.0},
                "bias_minus": {favourite: -100.0}}[name]
        return _biased(target, bias), _biased(draft, bias)
    raise KeyError(name)


SCENARIOS = ("spread", "shared_certain", "equal_certain", "disagree", "one_hot", "bias_plus",
             "bias_two_plus", "bias_minus", "rare_draft")


def _round(name: str, temperature: float, sampling_name: str, seed: int):
    """One verification round's inputs: (target logits [B, P, V], target_probs [B, P, V],
    draft_tokens [B, K], draft_probs [B, K, V], sampling). The draft tokens are drawn as a
    sampling draft draws them (sample_from_logits); "rare_draft" proposes instead each row's
    least likely token of positive draft probability (as likely as the draft says, never 0)."""
    gen = make_generator(seed)
    target_logits, draft_logits = _scenario(
        "shared_certain" if name == "rare_draft" else name, gen)
    sampling = SamplingConfig(temperature=temperature, **SAMPLINGS[sampling_name])
    target_probs = to_probs(target_logits, sampling)  # [B, P, V] fp32
    uniforms = torch.rand(BATCH * K, generator=gen, dtype=torch.float64).tolist()
    draft_probs, draft_tokens = sample_from_logits(draft_logits.reshape(-1, VOCAB), sampling,
                                                   uniforms)
    draft_probs = draft_probs.reshape(BATCH, K, VOCAB)
    draft_tokens = draft_tokens.reshape(BATCH, K)
    if name == "rare_draft":
        draft_tokens = draft_probs.masked_fill(draft_probs == 0, 2.0).argmin(-1)
    return target_logits, target_probs, draft_tokens, draft_probs, sampling


CASES = [pytest.param(name, t, s, id=f"{name}-T{t:g}-{s}")
         for name in SCENARIOS for t in TEMPERATURES for s in SAMPLINGS]


# --- assertions ----------------------------------------------------------------------------


def _assert_probs(name: str, probs: torch.Tensor) -> None:
    assert bool(torch.isfinite(probs).all()), f"{name} is not finite"
    assert float(probs.min()) >= 0.0 and float(probs.max()) <= 1.0, name


def _assert_valid_rows(draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                       num_accepted: list[int], output_tokens: list[list[int]],
                       num_draft: list[int]) -> None:
    """Accepted tokens are the draft's, every emitted token has target probability > 0 at its
    position, then padding."""
    for b, (n, row) in enumerate(zip(num_accepted, output_tokens)):
        assert 0 <= n <= num_draft[b]
        assert row[:n] == draft_tokens[b, :n].tolist()
        for position, token in enumerate(row[: n + 1]):
            assert 0 <= token < VOCAB and float(target_probs[b, position, token]) > 0.0, (
                b, position, token)
        assert all(token == -1 for token in row[n + 1:])


def _assert_cheap_law(name: str, temperature: float, target_probs: torch.Tensor,
                      draft_tokens: torch.Tensor, num_accepted: list[int],
                      output_tokens: list[list[int]], num_draft: list[int]) -> None:
    """A draft equal to the target keeps every token; a target row at position 0 that is
    certain (fp32 probability 1) of a token other than the draft's emits that token."""
    if name == "equal_certain":
        assert num_accepted == num_draft
    if name in ("disagree", "one_hot") and temperature <= 0.1:
        for b, row in enumerate(output_tokens):
            top_prob, top = target_probs[b, 0].max(-1)
            if float(top_prob) == 1.0 and int(draft_tokens[b, 0]) != int(top):
                assert row[0] == int(top), (b, row)


# --- the sweep ------------------------------------------------------------------------------


@pytest.mark.parametrize("name, temperature, sampling_name", CASES)
def test_the_block_rule_is_finite_and_exact_on_extreme_inputs(name, temperature,
                                                              sampling_name):
    _, target_probs, draft_tokens, draft_probs, _ = _round(name, temperature, sampling_name, 1)
    _assert_probs("target_probs", target_probs)
    _assert_probs("draft_probs", draft_probs)
    num_draft = [K, K, 3, 2, 1, 0] + [K] * (BATCH - 6)  # ragged rows too
    weights, stop_probs = block_weights(draft_tokens, draft_probs, target_probs,
                                        torch.tensor(num_draft))  # the tensor reference
    _assert_probs("weights", weights)
    _assert_probs("stop_probs", stop_probs)
    after = torch.cat([(1 - stop_probs[:, 1:]).flip(1).cumprod(1).flip(1),
                       torch.ones(BATCH, 1)], 1)  # prod_{j > i} (1 - h_j) [B, P]
    torch.testing.assert_close(stop_probs.mul(after).sum(1), torch.ones(BATCH))
    for seed in range(3):
        num_accepted, output_tokens = verify_block_rows(
            draft_tokens, draft_probs, target_probs, make_generator(seed), num_draft)
        _assert_valid_rows(draft_tokens, target_probs, num_accepted, output_tokens, num_draft)
        if seed == 0:
            _assert_cheap_law(name, temperature, target_probs, draft_tokens, num_accepted,
                              output_tokens, num_draft)
    etas = torch.rand(BATCH, K, generator=make_generator(9))  # host decisions == reference
    result = verify_block_with_randomness(draft_tokens, draft_probs, target_probs, etas,
                                          torch.rand(BATCH, dtype=torch.float64),
                                          torch.tensor(num_draft))
    passes = torch.cat([torch.ones(BATCH, 1, dtype=torch.bool), etas < stop_probs[:, 1:]], 1)
    assert result.num_accepted.tolist() == (passes * torch.arange(K + 1)).amax(1).tolist()


@pytest.mark.parametrize("name, temperature, sampling_name", CASES)
def test_the_token_rule_is_finite_and_exact_on_extreme_inputs(name, temperature,
                                                              sampling_name):
    _, target_probs, draft_tokens, draft_probs, _ = _round(name, temperature, sampling_name, 2)
    _assert_probs("acceptance_probs", acceptance_probs(draft_probs, target_probs[:, :K]))
    residual = residual_probs(draft_probs, target_probs[:, :K])
    _assert_probs("residual_probs", residual)
    assert bool((residual.sum(-1) > 0).all())
    num_draft = [K, 3, 0, 1] + [K] * (BATCH - 4)
    host_rows = rejection.HOST_ROWS_MAX_BATCH
    for seed in range(3):
        for probs in (draft_probs, None):  # a sampling draft, and a point-mass proposal
            for rows in (host_rows, BATCH):  # host decisions, then tensor ops over the batch
                num_accepted, output_tokens = verify_rows(
                    draft_tokens[:rows], None if probs is None else probs[:rows],
                    target_probs[:rows], make_generator(seed), num_draft[:rows])
                _assert_valid_rows(draft_tokens, target_probs, num_accepted, output_tokens,
                                   num_draft)
                if seed == 0 and probs is not None and rows == BATCH:
                    _assert_cheap_law(name, temperature, target_probs, draft_tokens,
                                      num_accepted, output_tokens, num_draft)


@pytest.mark.parametrize("name, temperature, sampling_name", CASES)
def test_the_seeded_race_is_finite_and_exact_on_extreme_inputs(name, temperature,
                                                               sampling_name):
    _, target_probs, _, draft_probs, _ = _round(name, temperature, sampling_name, 3)
    for b in range(BATCH):
        key = stream_key(1_000 + b)
        for position in range(K + 1):
            clocks = RaceClocks(key, position, VOCAB)
            token = race(target_probs[b, position], clocks)
            assert float(target_probs[b, position, token]) > 0.0, (b, position, token)
            top_prob, top = target_probs[b, position].max(-1)
            if float(top_prob) == 1.0 and temperature <= 0.1:  # certain: the law is that token
                assert token == int(top)
            if position < K:  # the draft races its own distribution on the same clocks
                assert float(draft_probs[b, position, race(draft_probs[b, position],
                                                            clocks)]) > 0.0


@pytest.mark.parametrize("name", SCENARIOS[:-1])
def test_the_greedy_rule_is_valid_on_extreme_inputs(name):
    target_logits, draft_logits = _scenario(name, make_generator(4))
    target_tokens = greedy_tokens(target_logits)  # [B, P]
    draft_tokens = greedy_tokens(draft_logits)  # [B, K]: a greedy draft
    point_masses = to_probs(target_logits, SamplingConfig(temperature=0.0))
    assert torch.equal(point_masses.argmax(-1), target_tokens)
    num_accepted, output_tokens = verify_greedy_rows(draft_tokens.tolist(),
                                                     target_tokens.tolist(), VOCAB)
    _assert_valid_rows(draft_tokens, point_masses, num_accepted, output_tokens, [K] * BATCH)
    if name == "bias_plus":  # +100 on token 3 makes it every position's argmax
        assert all(row[n] == 3 for row, n in zip(output_tokens, num_accepted))
    if name == "equal_certain":
        assert num_accepted == [K] * BATCH


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_a_draft_step_reports_finite_normalised_probs_on_extreme_logits(temperature):
    # the draft's side of every rule: the distribution it reports is the one it drew from
    for name in SCENARIOS[:-1]:
        _, draft_logits = _scenario(name, make_generator(5))
        for truncation in SAMPLINGS.values():
            sampling = SamplingConfig(temperature=temperature, **truncation)
            uniforms = torch.rand(BATCH * K, generator=make_generator(6),
                                  dtype=torch.float64)
            probs, tokens = sample_from_logits(draft_logits.reshape(-1, VOCAB), sampling,
                                               uniforms.tolist())
            _assert_probs(f"{name} draft probs", probs)
            assert all(math.isclose(total, 1.0, abs_tol=1e-5) for total in probs.sum(-1).tolist())
            assert bool((probs.gather(-1, tokens[:, None]) > 0).all())
            assert torch.equal(tokens, sample_with_uniform(probs, uniforms))
