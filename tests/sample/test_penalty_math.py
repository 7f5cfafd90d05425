"""sample/penalties.py and the sampling additions (min-p, to_logprobs): worked examples by hand,
the block rule against one-position calls, bit for bit, and the config checks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec import ConfigError, GenerationConfig, PenaltyConfig, SamplingConfig
from verispec.sample.penalties import process_logits, seen_tokens
from verispec.sample.sampling import to_logprobs, to_probs


def test_worked_example_counts_draft_tokens_before_each_position():
    """The module docstring's example: frequency 1, committed [5], drafted [7, 5, 7]."""
    penalty = PenaltyConfig(frequency_penalty=1.0)
    logits = torch.zeros(4, 10)
    processed = process_logits(logits, penalty, None, [5], [7, 5, 7])
    assert processed[:, 5].tolist() == [-1.0, -1.0, -2.0, -2.0]
    assert processed[:, 7].tolist() == [0.0, -1.0, -1.0, -2.0]
    assert processed[:, 3].tolist() == [0.0] * 4


def test_order_bias_then_repetition_then_frequency_then_presence():
    """Token 1 (prompt only), token 2 (output twice), token 3 (biased, unseen)."""
    penalty = PenaltyConfig(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                            logit_bias=((1, 1.0), (3, -4.0)))
    logits = torch.tensor([[0.0, 3.0, -1.0, 2.0, 1.0]])
    prompt_seen = seen_tokens([1], 5)
    processed = process_logits(logits, penalty, prompt_seen, [2, 2])[0]
    # token 1: (3 + 1) / 2 = 2, no output count; token 2: -1 * 2 - 0.25 * 2 - 0.5 = -3
    # token 3: 2 - 4 = -2, unseen; token 4: untouched
    assert processed.tolist() == [0.0, 2.0, -3.0, -2.0, 1.0]


def test_bias_alone_ignores_history():
    penalty = PenaltyConfig(logit_bias=((0, 100.0),))
    processed = process_logits(torch.zeros(3, 4), penalty, None, [0, 0], [0, 0])
    assert processed[:, 0].tolist() == [100.0] * 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=6), st.lists(st.integers(0, 5), max_size=6),
       st.sampled_from([1.0, 1.3, 0.7]), st.floats(-2, 2), st.floats(-2, 2),
       st.integers(0, 2**31))
def test_block_positions_equal_one_position_calls_bit_for_bit(
        output, drafted, repetition, presence, frequency, seed):
    """Position j of a block == a one-position call with drafted[:j] committed: plain decoding's
    processed logits, so greedy speculation picks the same argmax."""
    penalty = PenaltyConfig(presence_penalty=presence, frequency_penalty=frequency,
                            repetition_penalty=repetition, logit_bias=((2, 0.5), (4, -1.5)))
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(drafted) + 1, 6, generator=generator) * 3
    prompt_seen = seen_tokens([0, 3], 6)
    block = process_logits(logits, penalty, prompt_seen, output, drafted)
    for j in range(len(drafted) + 1):
        one = process_logits(logits[j : j + 1], penalty, prompt_seen, output + drafted[:j])
        assert torch.equal(block[j], one[0]), j


def test_negative_logit_under_repetition_penalty_is_multiplied():
    penalty = PenaltyConfig(repetition_penalty=1.5)
    processed = process_logits(torch.tensor([[-2.0, 2.0, float("-inf")]]), penalty,
                          seen_tokens([0, 1, 2], 3), [])
    assert processed[0].tolist() == [-3.0, pytest.approx(4 / 3), float("-inf")]


def test_min_p_keeps_tokens_near_the_most_likely():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = to_probs(logits, SamplingConfig(temperature=1.0, min_p=0.25))
    # threshold 0.125: 0.05 goes, the rest renormalised
    assert probs.tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])
    assert torch.equal(to_probs(logits, SamplingConfig(temperature=1.0, min_p=0.0)),
                       to_probs(logits, SamplingConfig(temperature=1.0)))


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.7),
                                      SamplingConfig(temperature=1.3, top_k=3),
                                      SamplingConfig(temperature=1.0, top_p=0.6),
                                      SamplingConfig(temperature=0.9, min_p=0.2)])
def test_logprobs_are_those_of_the_sampled_distribution(sampling):
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(5)) * 2
    logprobs = to_logprobs(logits, sampling)
    probs = to_probs(logits, sampling)
    assert torch.equal(torch.isinf(logprobs), probs == 0)
    finite = probs > 0
    assert torch.allclose(logprobs[finite].exp(), probs[finite], rtol=1e-5, atol=1e-7)


def test_greedy_logprobs_are_the_processed_logits_at_temperature_one():
    logits = torch.randn(2, 9, generator=torch.Generator().manual_seed(2))
    allowed = torch.ones(2, 9, dtype=torch.bool)
    allowed[:, 4] = False
    logprobs = to_logprobs(logits, SamplingConfig(temperature=0.0), allowed)
    expected = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    assert torch.equal(logprobs, expected)
    assert math.isinf(float(logprobs[0, 4]))


@pytest.mark.parametrize("kwargs, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
    ({"logit_bias": ((1, 1.0), (1, 2.0))}, "logit_bias"),
])
def test_penalty_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        PenaltyConfig(**kwargs)


def test_min_p_and_logprobs_are_checked():
    with pytest.raises(ConfigError, match="min_p"):
        SamplingConfig(min_p=1.5)
    with pytest.raises(ConfigError, match="logprobs"):
        GenerationConfig(logprobs=21)
    with pytest.raises(ConfigError, match="logprobs"):
        GenerationConfig(logprobs=1.5)


# --- bounds where the arithmetic needs them (a seen token's logit divided by the penalty) ------


@pytest.mark.parametrize("value", [1e-40, 1e-3, 0.0099, 100.5, 1e38, float("inf")])
def test_repetition_penalty_outside_its_bounds_is_refused_naming_the_field(value):
    with pytest.raises(ConfigError, match=r"repetition_penalty=.*\[0\.01, 100\]") as caught:
        PenaltyConfig(repetition_penalty=value)
    assert caught.value.field == "repetition_penalty"


@pytest.mark.parametrize("value", [0.01, 100.0])
def test_repetition_penalty_at_its_bounds_keeps_huge_logits_finite(value):
    """Within the bounds a seen token's logit, however large in fp32, stays finite: the largest
    fp32 magnitude, not +-inf (whose softmax is NaN); inf and NaN logits stay what they are,
    for the sampler's NonFiniteError."""
    top = torch.finfo(torch.float32).max
    logits = torch.tensor([[1e38, -1e38, 3.0, -3.0, float("inf"), float("nan"), 2.0]])
    processed = process_logits(logits, PenaltyConfig(repetition_penalty=value),
                          seen_tokens([0, 1, 2, 3, 4, 5], 7), [])[0]
    assert torch.isfinite(processed[:4]).all() and processed[6] == 2.0
    assert processed[0] == (top if value < 1 else 1e38 / value)
    assert processed[1] == (-top if value > 1 else -1e38 * value)
    assert processed[4] == float("inf") and math.isnan(processed[5])
    probs = to_probs(processed[None, [0, 1, 2, 3, 6]], SamplingConfig(temperature=1.0))
    assert torch.isfinite(probs).all()


@pytest.mark.parametrize("value", [1e4 + 1, 1e39, float("inf"), -0.5])
def test_temperature_outside_its_bounds_is_refused_naming_the_field(value):
    """fp32 holds no temperature past 3.4e38: dividing a masked token's -inf by inf is NaN.
    The highest temperature allowed keeps a masked token out."""
    with pytest.raises(ConfigError, match=r"temperature=.*\[0, 10000\]") as caught:
        SamplingConfig(temperature=value)
    assert caught.value.field == "temperature"
    probs = to_probs(torch.tensor([[1.0, 2.0, float("-inf"), 3.0]]),
                     SamplingConfig(temperature=1e4))
    assert probs[0, 2] == 0 and torch.isfinite(probs).all()


@pytest.mark.parametrize("make, field", [
    (lambda: SamplingConfig(top_k=0), "top_k"), (lambda: SamplingConfig(top_p=0.0), "top_p"),
    (lambda: SamplingConfig(min_p=1.5), "min_p"),
    (lambda: PenaltyConfig(presence_penalty=2.5), "presence_penalty"),
    (lambda: PenaltyConfig(logit_bias=((1, 1.0), (1, 2.0))), "logit_bias"),
    (lambda: GenerationConfig(seed=-1), "seed"),
    (lambda: GenerationConfig(num_draft_tokens=33), "num_draft_tokens"),
    (lambda: GenerationConfig(max_new_tokens=0), "max_new_tokens"),
    (lambda: GenerationConfig(logprobs=21), "logprobs"),
])
def test_config_errors_carry_their_field(make, field):
    with pytest.raises(ConfigError) as caught:
        make()
    assert caught.value.field == field


def test_numpy_scalars_are_read_as_python_numbers():
    numpy = pytest.importorskip("numpy")
    sampling = SamplingConfig(temperature=numpy.float32(0.5), top_k=numpy.int64(3),
                              top_p=numpy.float64(0.9), min_p=numpy.float16(0.25))
    assert sampling == SamplingConfig(temperature=0.5, top_k=3, top_p=0.9, min_p=0.25)
    assert type(sampling.temperature) is float and type(sampling.top_k) is int
    penalty = PenaltyConfig(presence_penalty=numpy.float32(0.5),
                            repetition_penalty=numpy.float64(1.25),
                            logit_bias=((numpy.int64(5), numpy.float32(-2.0)),))
    assert penalty == PenaltyConfig(presence_penalty=0.5, repetition_penalty=1.25,
                                    logit_bias=((5, -2.0),))
    config = GenerationConfig(max_new_tokens=numpy.int32(8), num_draft_tokens=numpy.int64(2),
                              seed=numpy.uint64(5), logprobs=numpy.int64(2),
                              min_new_tokens=numpy.int8(1), stop_token_ids=(numpy.int64(0),))
    assert (config.max_new_tokens, config.num_draft_tokens, config.seed, config.logprobs,
            config.min_new_tokens, config.stop_token_ids) == (8, 2, 5, 2, 1, (0,))
    assert all(type(value) is int for value in (config.seed, config.logprobs))
    for bad in ({"top_k": True}, {"top_k": numpy.bool_(True)}, {"temperature": "1"}):
        with pytest.raises(ConfigError):
            SamplingConfig(**bad)
