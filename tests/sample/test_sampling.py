"""sample/sampling.py: logits -> probs (temperature, top-k, top-p) and seeded draws.

Legend: N draws, V vocabulary.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec import NonFiniteError, SamplingConfig, ShapeError, VerispecError
from verispec.sample.sampling import (
    make_generator,
    sample,
    sample_from_logits,
    sample_with_host_uniforms,
    sample_with_uniform,
    to_probs,
)

from helpers_stats import g_test
from rule_references import sample_from_logprobs

pytestmark = pytest.mark.usefixtures("single_thread_torch")

INF = float("inf")


def _logits(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=make_generator(seed)) * 2.0


# --- temperature -----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.25, 2.0, 10.0])
def test_temperature_is_softmax_of_scaled_logits(temperature):
    logits = _logits(0, (4, 3, 11))  # [B, K, V]
    probs = to_probs(logits, SamplingConfig(temperature=temperature))
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    expected = torch.softmax(logits.double() / temperature, dim=-1)  # float64 reference
    torch.testing.assert_close(probs.double(), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, 3), rtol=0, atol=1e-6)


def test_lower_temperature_sharpens_higher_flattens():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    cold = to_probs(logits, SamplingConfig(temperature=0.5))
    base = to_probs(logits, SamplingConfig(temperature=1.0))
    hot = to_probs(logits, SamplingConfig(temperature=3.0))
    assert cold[0] > base[0] > hot[0]
    assert cold[-1] < base[-1] < hot[-1]


def test_half_precision_logits_give_fp32_probs():
    logits = _logits(1, (2, 7)).to(torch.bfloat16)
    probs = to_probs(logits, SamplingConfig())
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits.float(), -1))


# --- greedy ----------------------------------------------------------------------------------


def test_greedy_is_one_hot_on_argmax():
    logits = _logits(2, (5, 9))
    probs = to_probs(logits, SamplingConfig(temperature=0))
    expected = torch.nn.functional.one_hot(logits.argmax(-1), 9).float()
    assert torch.equal(probs, expected)


def test_greedy_ties_go_to_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0],
                           [5.0, 5.0, 5.0, 5.0],
                           [-INF, 2.0, -INF, 2.0]])
    probs = to_probs(logits, SamplingConfig(temperature=0))
    assert probs.argmax(-1).tolist() == [1, 0, 1]
    assert probs.sum(-1).tolist() == [1.0, 1.0, 1.0]
    assert int((probs > 0).sum()) == 3


# --- top-k -----------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [1, 2, 3, 7])
def test_top_k_keeps_the_k_most_likely_with_renormalised_mass(top_k):
    logits = _logits(3, (6, 10))  # continuous: no ties
    probs = to_probs(logits, SamplingConfig(top_k=top_k))
    kept = probs > 0
    assert kept.sum(-1).tolist() == [top_k] * 6
    top_ids = logits.topk(top_k, dim=-1).indices
    assert bool(kept.gather(-1, top_ids).all())
    full = torch.softmax(logits, -1)
    expected = torch.where(kept, full, 0.0)
    expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(probs, expected)


def test_top_k_at_least_vocab_size_is_a_no_op():
    logits = _logits(4, (3, 5))
    for top_k in (5, 50):
        torch.testing.assert_close(to_probs(logits, SamplingConfig(top_k=top_k)),
                                   to_probs(logits, SamplingConfig()))


def test_top_k_is_applied_after_temperature_and_gives_the_same_set():
    logits = _logits(5, (2, 8))
    for temperature in (0.5, 2.0):
        probs = to_probs(logits, SamplingConfig(temperature=temperature, top_k=3))
        expected = torch.softmax(logits / temperature, -1)
        expected = torch.where(probs > 0, expected, 0.0)
        torch.testing.assert_close(probs, expected / expected.sum(-1, keepdim=True))


# --- top-p -----------------------------------------------------------------------------------

# Hand-computed: probs by id [0.1, 0.4, 0.2, 0.3]; sorted 0.4 (id 1), 0.3 (id 3), 0.2 (id 2),
# 0.1 (id 0); mass before each in that order: 0, 0.4, 0.7, 0.9. A token is kept while the mass
# before it is below top_p (the smallest set reaching top_p).
_TOP_P_PROBS = torch.tensor([0.1, 0.4, 0.2, 0.3])


@pytest.mark.parametrize("top_p, expected", [
    (0.05, [0.0, 1.0, 0.0, 0.0]),                  # the top token alone already reaches 0.05
    (0.4 - 1e-3, [0.0, 1.0, 0.0, 0.0]),
    (0.6, [0.0, 4 / 7, 0.0, 3 / 7]),               # {1, 3}: 0.4 < 0.6 <= 0.7
    (0.75, [0.0, 4 / 9, 2 / 9, 3 / 9]),            # {1, 3, 2}: 0.7 < 0.75 <= 0.9
    (0.95, [0.1, 0.4, 0.2, 0.3]),                  # all four
    (1.0, [0.1, 0.4, 0.2, 0.3]),
])
def test_top_p_keeps_smallest_set_reaching_p(top_p, expected):
    probs = to_probs(_TOP_P_PROBS.log(), SamplingConfig(top_p=top_p))
    torch.testing.assert_close(probs, torch.tensor(expected), rtol=0, atol=1e-6)


@pytest.mark.parametrize("top_p", [1e-9, 0.01, 0.2])
def test_top_p_always_keeps_the_top_token(top_p):
    logits = _logits(6, (50, 12))
    probs = to_probs(logits, SamplingConfig(top_p=top_p))
    assert bool((probs.gather(-1, logits.argmax(-1, keepdim=True)) > 0).all())
    torch.testing.assert_close(probs.sum(-1), torch.ones(50))


def test_top_p_kept_set_is_minimal_on_random_rows():
    logits = _logits(7, (200, 9))
    top_p = 0.8
    probs = to_probs(logits, SamplingConfig(top_p=top_p))
    full = torch.softmax(logits, -1)
    kept = probs > 0
    kept_mass = torch.where(kept, full, 0.0).sum(-1)
    smallest_kept = torch.where(kept, full, INF).amin(-1)
    assert bool((kept_mass >= top_p - 1e-6).all())  # reaches p
    assert bool((kept_mass - smallest_kept < top_p + 1e-6).all())  # minus its last, it does not
    # kept tokens are the most likely ones: every kept prob >= every dropped prob
    largest_dropped = torch.where(kept, -INF, full).amax(-1)
    assert bool((smallest_kept >= largest_dropped).all())


def test_top_k_and_top_p_combine():
    probs = to_probs(_TOP_P_PROBS.log(), SamplingConfig(top_k=3, top_p=0.75))
    # top-k 3 leaves [0, 4/9, 2/9, 3/9]; its top-p 0.75 set is {1, 3} (mass before id 2 is 7/9)
    torch.testing.assert_close(probs, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]), rtol=0, atol=1e-6)


# --- -inf, NaN, +inf -------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.5),
                                      SamplingConfig(top_k=2), SamplingConfig(top_p=0.9),
                                      SamplingConfig(temperature=0)])
def test_minus_inf_logits_are_allowed_and_get_zero_probability(sampling):
    logits = torch.tensor([[0.0, -INF, 1.0, -INF], [-INF, -INF, 3.0, -INF]])
    probs = to_probs(logits, sampling)
    assert bool(torch.isfinite(probs).all())
    assert probs[:, 1].tolist() == [0.0, 0.0] and probs[:, 3].tolist() == [0.0, 0.0]
    assert probs[1].tolist() == [0.0, 0.0, 1.0, 0.0]
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))


@pytest.mark.parametrize("bad_row", [[0.0, float("nan"), 1.0], [0.0, INF, 1.0], [-INF, -INF, -INF]],
                         ids=["nan", "plus_inf", "all_minus_inf"])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0),
                                      SamplingConfig(top_k=1), SamplingConfig(top_p=0.5)],
                         ids=["t1", "greedy", "top_k", "top_p"])
def test_non_finite_logits_raise(bad_row, sampling):
    logits = torch.tensor([[0.0, 1.0, 2.0], bad_row])  # one good row, one bad
    with pytest.raises(NonFiniteError, match="NaN or \\+inf"):
        to_probs(logits, sampling)


def test_non_float_logits_raise_shape_error():
    with pytest.raises(ShapeError, match="floating-point"):
        to_probs(torch.tensor([1, 2, 3]), SamplingConfig())


# --- draws -----------------------------------------------------------------------------------

_DRAW_PROBS = torch.tensor([0.05, 0.0, 0.3, 0.15, 0.0, 0.4, 0.1, 0.0])


def test_sample_frequencies_match_probs_and_never_hit_zero_probability():
    num_draws = 200_000
    draws = sample(_DRAW_PROBS.expand(num_draws, -1), make_generator(11))  # [N]
    assert draws.shape == (num_draws,) and draws.dtype == torch.int64
    counts = np.bincount(draws.numpy(), minlength=len(_DRAW_PROBS))
    assert counts[_DRAW_PROBS.numpy() == 0].sum() == 0
    result = g_test(counts, _DRAW_PROBS.double().numpy())
    assert result.p_value > 1e-3, result


def test_sample_accepts_unnormalised_probs():
    num_draws = 100_000
    draws = sample((7.0 * _DRAW_PROBS).expand(num_draws, -1), make_generator(12))
    counts = np.bincount(draws.numpy(), minlength=len(_DRAW_PROBS))
    assert g_test(counts, _DRAW_PROBS.double().numpy()).p_value > 1e-3


def test_sample_from_logprobs_matches_the_law():
    num_draws = 100_000
    logprobs = _DRAW_PROBS.log().expand(num_draws, -1)  # -inf where probs are 0
    draws = sample_from_logprobs(logprobs, make_generator(13))
    counts = np.bincount(draws.numpy(), minlength=len(_DRAW_PROBS))
    assert counts[_DRAW_PROBS.numpy() == 0].sum() == 0
    assert g_test(counts, _DRAW_PROBS.double().numpy()).p_value > 1e-3


@pytest.mark.parametrize("row", [[0.0, 0.0, 0.0], [0.5, float("nan"), 0.5]],
                         ids=["all_zero", "nan"])
def test_sample_never_returns_an_id_outside_the_vocabulary(row):
    # A degenerate row has no valid draw. The sampler may raise a typed error, but it must not
    # hand back an id the vocabulary does not have: it would be fed to a model as a token.
    try:
        token = sample(torch.tensor([row]), make_generator(0))
    except VerispecError:
        return
    assert 0 <= int(token) < len(row), f"sample() returned token id {int(token)} for V=3"


def test_sample_keeps_leading_shape():
    probs = torch.softmax(_logits(14, (3, 4, 6)), -1)
    assert sample(probs, make_generator(0)).shape == (3, 4)


def test_same_seed_same_draws_different_seed_different_draws():
    probs = torch.softmax(_logits(15, (1000, 6)), -1)
    first = sample(probs, make_generator(123))
    again = sample(probs, make_generator(123))
    other = sample(probs, make_generator(124))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_generator_advances_between_draws():
    probs = torch.softmax(_logits(16, (1000, 6)), -1)
    generator = make_generator(5)
    assert not torch.equal(sample(probs, generator), sample(probs, generator))


def test_make_generator_without_seed_is_not_the_global_rng():
    torch.manual_seed(0)
    probs = torch.softmax(_logits(17, (1000, 6)), -1)
    a = sample(probs, make_generator(None))
    torch.manual_seed(0)
    b = sample(probs, make_generator(None))
    assert not torch.equal(a, b)  # OS-seeded, independent of torch.manual_seed


def test_global_rng_state_is_untouched():
    torch.manual_seed(2024)
    before = torch.get_rng_state()
    logits = _logits(18, (64, 10))
    for sampling in (SamplingConfig(), SamplingConfig(temperature=0),
                     SamplingConfig(temperature=0.7, top_k=4, top_p=0.9)):
        probs = to_probs(logits, sampling)
        sample(probs, make_generator(1))
        sample(probs, make_generator(None))
        sample_from_logprobs(probs.log(), make_generator(2))
    assert torch.equal(torch.get_rng_state(), before)


def _reference_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The inverse-CDF draw written with tensor ops only: the reference for the host threshold."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[..., -1:]
    threshold = torch.minimum(uniforms.double()[..., None] * total,
                              torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, threshold, right=True).squeeze(-1)


@pytest.mark.parametrize("seed", range(5))
def test_sample_with_uniform_equals_the_tensor_reference(seed):
    # sample_with_uniform computes each row's threshold on the host; the tokens must be those of
    # the all-tensor formula bit for bit, including uniforms at the very top of [0, 1) and rows
    # with zero-probability tokens and unnormalised mass.
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(3 * torch.randn(4, 3, 50, generator=gen), dim=-1)
    probs[..., ::7] = 0.0
    probs[1] *= 3.0
    uniforms = torch.rand(4, 3, generator=gen, dtype=torch.float64)
    uniforms[0, 0] = 1.0 - 2.0 ** -53  # the largest double below 1
    uniforms[0, 1] = 0.0
    tokens = sample_with_uniform(probs, uniforms)
    assert tokens.tolist() == _reference_inverse_cdf(probs, uniforms).tolist()
    assert bool((probs.gather(-1, tokens[..., None]) > 0).all())
    # fp32 uniforms (as verify_with_randomness callers may pass) give the same answer as well
    as_float = uniforms.float()
    assert (sample_with_uniform(probs, as_float).tolist()
            == _reference_inverse_cdf(probs, as_float).tolist())
    # one row at a time: the single-row path searches for a host float, no threshold tensor
    for b in range(4):
        for j in range(3):
            assert sample_with_uniform(probs[b, j][None], uniforms[b, j][None]).tolist() == [
                tokens[b, j].item()]
            assert sample_with_uniform(probs[b, j], uniforms[b, j]).item() == tokens[b, j].item()
    assert sample_with_host_uniforms(probs, uniforms.reshape(-1).tolist()).tolist() == (
        tokens.tolist())


def test_sample_with_uniform_checks_the_uniforms_shape():
    with pytest.raises(ShapeError):
        sample_with_uniform(torch.ones(2, 4), torch.zeros(3))
    with pytest.raises(NonFiniteError):
        sample_with_uniform(torch.zeros(1, 4), torch.zeros(1))


def test_sample_with_host_uniforms_draws_an_empty_row_from_the_fallback():
    probs = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.1, 0.0, 0.3, 0.6]])
    fallback = torch.tensor([[0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    # row 0 has no mass: its token comes from fallback row 0; row 1 keeps its own probs
    assert sample_with_host_uniforms(probs, [0.5, 0.95], fallback=fallback).tolist() == [2, 3]
    with pytest.raises(NonFiniteError, match="total mass"):
        sample_with_host_uniforms(probs, [0.5, 0.95])


_LOGITS_SAMPLINGS = [SamplingConfig(), SamplingConfig(temperature=0.7),
                     SamplingConfig(temperature=1.3, top_k=5), SamplingConfig(top_p=0.8),
                     SamplingConfig(temperature=0.9, top_k=20, top_p=0.9)]


@pytest.mark.parametrize("sampling", _LOGITS_SAMPLINGS,
                         ids=["t1", "t0.7", "top_k", "top_p", "all_three"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_sample_from_logits_is_to_probs_then_the_inverse_cdf_draw(sampling, batch_size):
    # the draft's step: the probabilities it reports are to_probs' bit for bit, and its tokens
    # are sample_with_uniform's draws from exactly them
    for seed in range(20):
        logits = _logits(seed, (batch_size, 64))
        uniforms = torch.rand(batch_size, generator=make_generator(seed), dtype=torch.float64)
        probs, tokens = sample_from_logits(logits, sampling, uniforms.tolist())
        expected_probs = to_probs(logits, sampling)
        assert torch.equal(probs, expected_probs)
        assert tokens.tolist() == sample_with_uniform(expected_probs, uniforms).tolist()
        assert bool((probs.gather(-1, tokens[:, None]) > 0).all())


@pytest.mark.parametrize("bad_row", [[0.0, float("nan"), 1.0], [0.0, INF, 1.0], [-INF, -INF, -INF]],
                         ids=["nan", "plus_inf", "all_minus_inf"])
@pytest.mark.parametrize("sampling", _LOGITS_SAMPLINGS[2:], ids=["top_k", "top_p", "all_three"])
def test_sample_from_logits_raises_for_non_finite_logits(bad_row, sampling):
    for logits in (torch.tensor([bad_row]), torch.tensor([[0.0, 1.0, 2.0], bad_row])):
        with pytest.raises(NonFiniteError, match="NaN or \\+inf"):
            sample_from_logits(logits, sampling, [0.5] * logits.shape[0])
    with pytest.raises(NonFiniteError, match="NaN or \\+inf"):
        sample_from_logits(torch.tensor([bad_row]), SamplingConfig(), [0.5])


# ---------------------------------------------------------------------------------------------
# extreme values: the limit the math gives, never NaN (issue: temperature 1e-40 was a 500)


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324])
def test_a_vanishing_temperature_is_the_point_mass_on_the_argmax(temperature):
    logits = torch.tensor([[1.0, 3.0, -2.0, 2.5], [0.0, -1.0, 4.0, 4.0]])
    probs = to_probs(logits, SamplingConfig(temperature=temperature))
    # the limit of softmax(l / T) as T -> 0: the argmax (ties share the mass)
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]]))


def test_a_vanishing_temperature_still_refuses_non_finite_logits():
    logits = torch.tensor([[1.0, float("nan"), 0.0]])
    with pytest.raises(NonFiniteError):
        to_probs(logits, SamplingConfig(temperature=1e-40))


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 5e-324])
def test_a_top_p_below_float32_keeps_only_the_top_token(top_p):
    logits = torch.tensor([[1.0, 3.0, -2.0, 2.5]])
    probs = to_probs(logits, SamplingConfig(temperature=1.0, top_p=top_p))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
