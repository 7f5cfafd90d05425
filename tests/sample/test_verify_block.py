"""sample/block.py: block verification (Sun et al., ICLR 2025).

Three layers: exact spike cases; the exact output law by enumeration over tiny vocabularies,
equal to the target's law of k+1 tokens, with negative controls that must fail it; and the
sampler (verify_block_rows) against that law by a G-test, plus reproducibility and input checks.

Fixtures are autoregressive tables: a distribution over V for every prefix of length <= k, for
the draft and the target. The algorithm's law after a draft X: P(tau = i | X) = h_i
prod_{j > i} (1 - h_j) (stop_probs h from block_weights), then the recovered or bonus token, then
the target's continuation up to k+1 tokens.

Legend: B batch, K draft tokens, V vocabulary.
"""

from __future__ import annotations

import importlib
import itertools
import re

import numpy as np
import pytest
import torch

from verispec import (
    ConfigError,
    DraftContractError,
    NonFiniteError,
    SamplingConfig,
    ShapeError,
    TokenOutOfRangeError,
)
from verispec.errors import UnsupportedFeatureError
from verispec.sample import block as verify_block
from verispec.sample.block import verify_block_rows
from verispec.sample.result import PAD_TOKEN
from verispec.sample.sampling import make_generator, to_probs

from helpers_stats import g_test
from rule_references import block_weights, verify_block_with_randomness

pytestmark = pytest.mark.usefixtures("single_thread_torch")

KINDS = ["random", "peaked", "close", "sparse_target", "disjoint", "one_hot_draft", "equal"]
# kinds made from logits by to_probs, as the engine makes them: a low temperature, a logit_bias
# of +100 on two tokens and of -100 on one (_logit_tables)
EXTREME_KINDS = ["cold_T0.01", "cold_T0.1", "bias_plus100", "bias_minus100"]
SEEDS = range(25)


def _one_hot(token: int, vocab_size: int) -> list[float]:
    return [1.0 if i == token else 0.0 for i in range(vocab_size)]


def _tensor(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


# --- fixture tables and the exact laws --------------------------------------------------------


def _random_dist(kind: str, role: str, vocab_size: int, gen: torch.Generator) -> torch.Tensor:
    """One distribution [V] float64 for a prefix, by fixture kind and role (draft or target)."""
    if kind == "peaked":
        return torch.softmax(4.0 * torch.randn(vocab_size, generator=gen, dtype=torch.float64), 0)
    if kind == "one_hot_draft" and role == "draft":
        return torch.tensor(_one_hot(int(torch.randint(vocab_size, (1,), generator=gen)),
                                     vocab_size), dtype=torch.float64)
    dist = -torch.rand(vocab_size, generator=gen, dtype=torch.float64).log()  # Dirichlet(1)
    if kind == "disjoint":  # draft on the lower half of the vocabulary, target on the rest
        half = torch.arange(vocab_size) < vocab_size // 2
        dist = torch.where(half if role == "draft" else ~half, dist, 0.0)
    if kind == "sparse_target" and role == "target":  # zeros, but never the whole row
        keep = torch.rand(vocab_size, generator=gen) < 0.5
        keep[dist.argmax()] = True
        dist = torch.where(keep, dist, 0.0)
    return dist / dist.sum()


def _perturbed(dist: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    noisy = dist * torch.exp(0.5 * torch.randn(dist.shape, generator=gen, dtype=dist.dtype))
    return noisy / noisy.sum()


def _tables(kind: str, vocab_size: int, k: int, seed: int) -> tuple[dict, dict]:
    """(draft, target): {prefix tuple: [V] float64} for every prefix of length <= k."""
    gen = torch.Generator().manual_seed(seed)
    prefixes = [p for n in range(k + 1) for p in itertools.product(range(vocab_size), repeat=n)]
    if kind in EXTREME_KINDS:
        return _logit_tables(kind, vocab_size, prefixes, gen)
    target = {p: _random_dist(kind, "target", vocab_size, gen) for p in prefixes}
    if kind == "equal":
        return dict(target), target
    if kind == "close":  # a realistic draft: the target with each probability off by ~50%
        return {p: _perturbed(dist, gen) for p, dist in target.items()}, target
    draft = {p: _random_dist(kind, "draft", vocab_size, gen) for p in prefixes}
    return draft, target


COLD_GAP = 8.0  # a near-certain prefix's lead in raw logits: tails e^(-GAP / T) or less
EXTREME_BIAS = {"bias_plus100": {0: 100.0, 1: 100.0}, "bias_minus100": {0: -100.0}}


def _logit_tables(kind: str, vocab_size: int, prefixes: list[tuple], gen: torch.Generator
                  ) -> tuple[dict, dict]:
    """(draft, target) tables of an EXTREME_KINDS kind: to_probs of logits (fp32), renormalised
    in float64 (so that the law is a law); the draft's logits are the target's plus noise.

    cold_T<T>: a model at a low temperature is near-certain at most positions and spread where
    its logits nearly tie. Half the prefixes lead with one token by COLD_GAP (tails below
    2^-53, fp32 subnormals or 0: draft and target both near-certain, the block rule's w = 1
    with a residual mass r ~ 0), half have logits within a few T (a spread law); the draft's
    noise is on each prefix's own scale. bias_*: logits of scale 1.5 at T = 1 shifted as
    EXTREME_BIAS says, the draft's too (the engine shapes both): +100 on tokens 0 and 1 leaves
    a law on those two with the rest near e^-100, -100 puts token 0 there."""
    temperature = float(kind.split("_T")[1]) if kind.startswith("cold") else 1.0
    bias = torch.zeros(vocab_size)
    for token, value in EXTREME_BIAS.get(kind, {}).items():
        bias[token] = value
    target_logits, draft_logits = [], []
    for _ in prefixes:
        scale = 1.0 if kind.startswith("bias") else (
            1.0 if float(torch.rand(1, generator=gen)) < 0.5 else temperature)
        logits = 1.5 * scale * torch.randn(vocab_size, generator=gen)
        if scale == 1.0 and kind.startswith("cold"):
            logits[int(torch.randint(vocab_size, (1,), generator=gen))] += COLD_GAP
        target_logits.append(logits + bias)
        draft_logits.append(logits + 0.5 * scale * torch.randn(vocab_size, generator=gen) + bias)
    sampling = SamplingConfig(temperature=temperature)
    tables = []
    for logits in (draft_logits, target_logits):
        probs = to_probs(torch.stack(logits), sampling).double()  # [prefixes, V]
        probs = probs / probs.sum(-1, keepdim=True)
        tables.append(dict(zip(prefixes, probs)))
    return tables[0], tables[1]


def _example_tables() -> tuple[dict, dict]:
    """(draft, target) tables for k = 2, V = 3 around the docstring example: after X_1 = 0 the
    weighted and the unweighted residual differ."""
    def dist(*values: float) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64)
    draft = {(): dist(0.5, 0.5, 0.0), (0,): dist(0.5, 0.4, 0.1), (1,): dist(0.2, 0.2, 0.6),
             (2,): dist(0.2, 0.2, 0.6)}
    target = {(): dist(0.25, 0.75, 0.0), (0,): dist(0.0, 0.6, 0.4), (1,): dist(0.3, 0.3, 0.4),
              (2,): dist(0.3, 0.3, 0.4)}
    target.update({(a, b): dist(0.5, 0.25, 0.25) for a in range(3) for b in range(3)})
    return draft, target


def _joint(table: dict, prefix: tuple, length: int, cache: dict) -> torch.Tensor:
    """The table's law of the next ``length`` tokens after prefix: [V] * length float64."""
    if length == 0:
        return torch.tensor(1.0, dtype=torch.float64)
    if (prefix, length) not in cache:
        dist = table[prefix]
        cache[prefix, length] = torch.stack([
            dist[y] * _joint(table, prefix + (y,), length - 1, cache) for y in range(len(dist))])
    return cache[prefix, length]


def _draft_blocks(draft: dict, target: dict, k: int, vocab_size: int):
    """Every draft block X with q(X) > 0: (draft_tokens [N, k], draft_probs [N, k, V],
    target_probs [N, k+1, V], q(X) [N]), float64."""
    blocks = [x for x in itertools.product(range(vocab_size), repeat=k)
              if all(draft[x[:i]][x[i]] > 0 for i in range(k))]
    draft_probs = torch.stack([torch.stack([draft[x[:i]] for i in range(k)]) for x in blocks])
    target_probs = torch.stack([torch.stack([target[x[:i]] for i in range(k + 1)])
                                for x in blocks])
    draft_tokens = torch.tensor(blocks, dtype=torch.int64).reshape(len(blocks), k)
    block_probs = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1).prod(-1)
    return draft_tokens, draft_probs, target_probs, block_probs


def _tau_law(stop_probs: torch.Tensor, rule: str) -> torch.Tensor:
    """P(tau = i | X) [N, k+1] from stop_probs [N, k+1]. rule "last": the largest passing i
    (the algorithm); "first": stop before the first failing i (a negative control)."""
    if rule == "last":  # h_i prod_{j > i} (1 - h_j)
        after = torch.cat([(1 - stop_probs[:, 1:]).flip(1).cumprod(1).flip(1),
                           torch.ones_like(stop_probs[:, :1])], 1)  # prod_{j > i} [N, k+1]
        return stop_probs * after
    fail_next = torch.cat([1 - stop_probs[:, 1:], torch.ones_like(stop_probs[:, :1])], 1)
    return stop_probs.cumprod(1) * fail_next  # prod_{j <= i} h_j (1 - h_{i+1})


def _block_law(draft: dict, target: dict, k: int, vocab_size: int, rule: str = "last",
               residual: str = "weighted") -> tuple[torch.Tensor, float]:
    """(the law [V] * (k+1) of the first k+1 tokens, E[tau]) for the block rule; residual
    "token_wise" uses max(0, p - q) (a negative control) instead of max(0, w p - q)."""
    draft_tokens, draft_probs, target_probs, block_probs = _draft_blocks(draft, target, k,
                                                                         vocab_size)
    weights, stop_probs = block_weights(draft_tokens, draft_probs, target_probs)
    tau_law = _tau_law(stop_probs, rule)  # [N, k+1]
    law = torch.zeros((vocab_size,) * (k + 1), dtype=torch.float64)
    cache: dict = {}
    for n, block in enumerate(draft_tokens.tolist()):
        for tau in range(k + 1):
            prefix = tuple(block[:tau])
            if tau == k:  # bonus
                next_probs = target[prefix]
            else:  # recovered
                scale = weights[n, tau] if residual == "weighted" else 1.0
                next_probs = (scale * target[prefix] - draft[prefix]).clamp_min(0.0)
                next_probs = next_probs / next_probs.sum() if next_probs.sum() > 0 else target[
                    prefix]
            mass = block_probs[n] * tau_law[n, tau]
            for y in range(vocab_size):
                law[prefix + (y,)] += mass * next_probs[y] * _joint(target, prefix + (y,),
                                                                     k - tau, cache)
    expected_tau = float((block_probs[:, None] * tau_law * torch.arange(k + 1)).sum())
    return law, expected_tau


def _token_wise_expected_accepted(draft: dict, target: dict, k: int, vocab_size: int) -> float:
    """E[num_accepted] of rejection.py's rule: sum_X q(X) sum_i prod_{j <= i} min(1, p_j / q_j)."""
    draft_tokens, draft_probs, target_probs, block_probs = _draft_blocks(draft, target, k,
                                                                         vocab_size)
    index = draft_tokens[..., None]
    ratios = target_probs[:, :k].gather(-1, index) / draft_probs.gather(-1, index)  # [N, k, 1]
    return float((block_probs * ratios.squeeze(-1).clamp(max=1.0).cumprod(1).sum(1)).sum())


def _law_error(draft: dict, target: dict, k: int, **rule) -> float:
    """L1 distance between the rule's law of k+1 tokens and the target's."""
    vocab_size = len(target[()])
    law, _ = _block_law(draft, target, k, vocab_size, **rule)
    return float((law - _joint(target, (), k + 1, {})).abs().sum())


def _fixture_errors(kind: str, k: int, **rule) -> list[float]:
    """_law_error on six fixtures of a kind: V = 3 for even seeds, 4 for odd."""
    return [_law_error(*_tables(kind, 3 + seed % 2, k, seed), k, **rule) for seed in range(6)]


# --- 1. exact spike cases ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_all_accepted_then_bonus_from_target_position_k(seed):
    draft_tokens = torch.tensor([[1, 2, 3]])
    near = [[0.05, 0.8, 0.05, 0.05, 0.05], [0.05, 0.05, 0.8, 0.05, 0.05],
            [0.05, 0.05, 0.05, 0.8, 0.05]]
    target_probs = _tensor([[_one_hot(1, 5), _one_hot(2, 5), _one_hot(3, 5), _one_hot(4, 5)]])
    assert verify_block_rows(draft_tokens, _tensor([near]), target_probs,
                             make_generator(seed)) == ([3], [[1, 2, 3, 4]])


@pytest.mark.parametrize("seed", SEEDS)
def test_rejection_at_position_zero_draws_from_the_residual(seed):
    # target gives the first token 0: w stays 0, so every h is 0 and tau = 0; the residual
    # max(0, p_1 - q_1) is one-hot(3) (resampling the target would emit 2 sometimes)
    draft_tokens = torch.tensor([[1, 0]])
    draft_probs = _tensor([[[0.0, 0.6, 0.4, 0.0, 0.0], _one_hot(0, 5)]])
    target_probs = _tensor([[[0.0, 0.0, 0.4, 0.6, 0.0], _one_hot(0, 5), _one_hot(0, 5)]])
    assert verify_block_rows(draft_tokens, draft_probs, target_probs,
                             make_generator(seed)) == ([0], [[3, PAD_TOKEN, PAD_TOKEN]])


@pytest.mark.parametrize("seed", SEEDS)
def test_equal_draft_and_target_accept_everything(seed):
    gen = make_generator(seed)
    probs = torch.softmax(torch.randn(3, 4, 7, generator=gen), -1)  # [B, K+1, V]
    draft_tokens = torch.multinomial(probs[:, :3].reshape(-1, 7), 1, generator=gen).reshape(3, 3)
    num_accepted, output_tokens = verify_block_rows(draft_tokens, probs[:, :3].contiguous(),
                                                    probs, make_generator(seed), [3, 1, 0])
    assert num_accepted == [3, 1, 0]
    assert [row[:n] for row, n in zip(output_tokens, num_accepted)] == [
        row[:n] for row, n in zip(draft_tokens.tolist(), num_accepted)]


def _example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module docstring's worked example: draft_tokens, draft_probs, target_probs."""
    draft_probs = torch.tensor([[[0.5, 0.5, 0.0], [0.5, 0.4, 0.1]]], dtype=torch.float64)
    target_probs = torch.tensor([[[0.25, 0.75, 0.0], [0.0, 0.6, 0.4], [1.0, 0.0, 0.0]]],
                                dtype=torch.float64)
    return torch.tensor([[0, 1]]), draft_probs, target_probs


def test_the_docstring_example():
    draft_tokens, draft_probs, target_probs = _example()
    weights, stop_probs = block_weights(draft_tokens, draft_probs, target_probs)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 0.5, 0.75]], dtype=torch.float64))
    torch.testing.assert_close(stop_probs, torch.tensor([[1.0, 1 / 6, 0.75]],
                                                        dtype=torch.float64))
    # next uniform .2: the weighted residual [0, 0, 1] gives 2, the unweighted [0, .4, .6] 1
    next_uniforms = torch.tensor([0.2], dtype=torch.float64)
    result = verify_block_with_randomness(draft_tokens, draft_probs, target_probs,
                                          torch.tensor([[0.1, 0.9]]), next_uniforms)
    assert result.output_tokens.tolist() == [[0, 2, PAD_TOKEN]]
    assert result.num_accepted.tolist() == [1] and result.all_accepted.tolist() == [False]
    later = verify_block_with_randomness(draft_tokens, draft_probs, target_probs,
                                         torch.tensor([[0.9, 0.5]]), next_uniforms)
    assert later.output_tokens.tolist() == [[0, 1, 0]] and later.all_accepted.tolist() == [True]


def _near_certain(temperature: float, tail: float) -> torch.Tensor:
    """to_probs at ``temperature`` of 8 logits: token 5 at 4, token 0 at ``tail``, the rest
    at -5. [V] fp32: at T = 0.1, token 0 has e^((tail - 4) / T) and the rest e^-90."""
    logits = torch.full((8,), -5.0)
    logits[5], logits[0] = 4.0, tail
    return to_probs(logits, SamplingConfig(temperature=temperature))


@pytest.mark.parametrize("seed", SEEDS)
def test_a_residual_mass_below_float64_resolution_stops_with_probability_one(seed):
    # Draft and target both near-certain of token 5 (T = 0.1), the target's tail on token 0
    # above the draft's: w_1 = 1 and r_1 = p_2(0) - q_2(0) ~ 4e-18, below 2^-53. The stop
    # probability is r_1 / (r_1 + (1 - w_1)) = 1, the limit; evaluated as (r_1 + 1) - w_1 it
    # divided by 0 (ZeroDivisionError on the host, inf in the tensor form).
    target_row, draft_row = _near_certain(0.1, 0.0), _near_certain(0.1, -2.0)
    assert 0 < float(target_row[0]) < 2.0 ** -53 and float(target_row[5]) == 1.0
    draft_tokens = torch.tensor([[5, 5]])
    draft_probs, target_probs = draft_row.expand(1, 2, 8), target_row.expand(1, 3, 8)
    weights, stop_probs = block_weights(draft_tokens, draft_probs, target_probs)
    assert weights.tolist() == [[1.0, 1.0, 1.0]] and stop_probs.tolist() == [[1.0, 1.0, 1.0]]
    assert verify_block_rows(draft_tokens, draft_probs, target_probs,
                             make_generator(seed)) == ([2], [[5, 5, 5]])


def test_weights_stay_0_after_a_zero_target_probability_before_a_near_0_draft_one():
    # X_1 has target probability 0 (w_1 = 0); X_2 has draft probability 1e-45 (a subnormal
    # fp32), so p_2(X_2) / q_2(X_2) overflows fp32 to inf: w_1 times it would be NaN. Taken
    # as (w_1 p_2(X_2)) / q_2(X_2) it is 0.
    tiny = 2.0 ** -149  # the smallest fp32 subnormal, ~1.4e-45
    draft_probs = _tensor([[[0.5, 0.5, 0.0], [1.0 - tiny, tiny, 0.0]]])
    target_probs = _tensor([[[0.0, 0.5, 0.5], [0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]])
    draft_tokens = torch.tensor([[0, 1]])
    weights, stop_probs = block_weights(draft_tokens, draft_probs, target_probs)
    assert weights.tolist() == [[1.0, 0.0, 0.0]] and stop_probs.tolist() == [[1.0, 0.0, 0.0]]
    num_accepted, output_tokens = verify_block_rows(draft_tokens, draft_probs, target_probs,
                                                    make_generator(0))
    assert num_accepted == [0] and output_tokens[0][0] in (1, 2)


def test_a_ragged_batch_reads_each_rows_own_positions():
    # row 0: k=3, all accepted -> bonus 4; row 1: k=1, rejected (target gives 0) -> residual 2;
    # row 2: k=0 -> a plain draw from target_probs[2, 0]; row 3: k=2, bonus from position 2.
    # Positions past a row's k hold out-of-range ids and NaN-free junk that must not be read.
    junk = [0.0, 0.0, 0.0, 0.0, 1.0]
    draft_tokens = torch.tensor([[1, 2, 3], [1, 99, 99], [99, 99, 99], [0, 0, 99]])
    draft_probs = _tensor([
        [_one_hot(1, 5), _one_hot(2, 5), _one_hot(3, 5)],
        [_one_hot(1, 5), junk, junk],
        [junk, junk, junk],
        [_one_hot(0, 5), _one_hot(0, 5), junk]])
    target_probs = _tensor([
        [_one_hot(1, 5), _one_hot(2, 5), _one_hot(3, 5), _one_hot(4, 5)],
        [[0.0, 0.0, 1.0, 0.0, 0.0], junk, junk, junk],
        [_one_hot(3, 5), junk, junk, junk],
        [_one_hot(0, 5), _one_hot(0, 5), _one_hot(1, 5), junk]])
    num_accepted, output_tokens = verify_block_rows(draft_tokens, draft_probs, target_probs,
                                                    make_generator(0), [3, 1, 0, 2])
    assert num_accepted == [3, 0, 0, 2]
    assert output_tokens == [[1, 2, 3, 4], [2, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN],
                             [3, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN], [0, 0, 1, PAD_TOKEN]]


# --- 2. the exact law, by enumeration ---------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("kind", KINDS + EXTREME_KINDS)
def test_block_rule_has_the_target_law_exactly(kind, k):
    assert max(_fixture_errors(kind, k)) < 1e-9


def test_block_rule_has_the_target_law_exactly_on_the_example():
    assert _law_error(*_example_tables(), 2) < 1e-9


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("kind", KINDS + EXTREME_KINDS)
def test_block_keeps_at_least_as_many_tokens_as_token_wise(kind, k):
    for seed in range(6):
        vocab_size = 3 + seed % 2
        draft, target = _tables(kind, vocab_size, k, seed)
        _, block_expected = _block_law(draft, target, k, vocab_size)
        token_wise_expected = _token_wise_expected_accepted(draft, target, k, vocab_size)
        assert block_expected >= token_wise_expected - 1e-12, (kind, k, seed)
        if kind == "equal":
            assert block_expected == pytest.approx(k, abs=1e-12)


def test_block_keeps_strictly_more_tokens_on_some_fixture():
    gains = []
    for seed in range(6):
        draft, target = _tables("random", 3, 3, seed)
        gains.append(_block_law(draft, target, 3, 3)[1]
                     - _token_wise_expected_accepted(draft, target, 3, 3))
    assert max(gains) > 0.01, gains


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("kind", ["random", "close"])
def test_the_enumeration_rejects_stopping_at_the_first_failure(kind, k):
    # tau = the position before the first failing one, instead of the last passing one
    errors = _fixture_errors(kind, k, rule="first")
    assert min(errors) > 0.04, errors


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("kind", EXTREME_KINDS)
def test_the_enumeration_rejects_stopping_at_the_first_failure_at_extremes(kind, k):
    # some cold fixtures are near-certain at every prefix, where any rule is right: on some
    errors = _fixture_errors(kind, k, rule="first")
    assert max(errors) > 0.1, errors


def test_the_enumeration_rejects_the_unweighted_residual():
    # recovering from max(0, p - q) instead of max(0, w p - q): wrong wherever the block stops
    # with 0 < w < 1 and r > 0 (not on every fixture: with w small, r is often 0)
    assert _law_error(*_example_tables(), 2, residual="token_wise") > 0.03
    assert max(_fixture_errors("random", 3, residual="token_wise")) > 0.01
    # near-certain rows give w in {0, 1} mostly, where the two residuals agree; still wrong
    # by far more than the 1e-9 the rule keeps (not under +100 on two of 3-4 tokens, where
    # they never differ)
    for kind in ("cold_T0.01", "cold_T0.1", "bias_minus100"):
        assert max(_fixture_errors(kind, 3, residual="token_wise")) > 1e-4, kind


# --- 3. the sampler against the exact law -----------------------------------------------------


def _first_failure(stop_probs: list[float], etas: list[float]) -> int:
    """The negative control's tau: the position before the first failing one."""
    tau = 0
    while tau + 1 < len(stop_probs) and etas[tau] < stop_probs[tau + 1]:
        tau += 1
    return tau


def _sampled_counts(kind: str, vocab_size: int, k: int, seed: int, num_rows: int,
                    rows_per_call: int = 100) -> np.ndarray:
    """Counts [V] * (k+1) of the first k+1 tokens: draft blocks drawn from the draft table,
    verify_block_rows with a fresh seed per call, the target's continuation after."""
    draft, target = _tables(kind, vocab_size, k, seed)
    gen = make_generator(seed + 1000)
    blocks = [[] for _ in range(num_rows)]
    for _ in range(k):  # draw the draft blocks position by position
        probs = torch.stack([draft[tuple(b)] for b in blocks]).float()
        for b, token in zip(blocks, torch.multinomial(probs, 1, generator=gen)[:, 0].tolist()):
            b.append(token)
    rows = []
    for start in range(0, num_rows, rows_per_call):
        chunk = blocks[start:start + rows_per_call]
        draft_probs = torch.stack([torch.stack([draft[tuple(b[:i])] for i in range(k)])
                                   for b in chunk]).float()
        target_probs = torch.stack([torch.stack([target[tuple(b[:i])] for i in range(k + 1)])
                                    for b in chunk]).float()
        num_accepted, output = verify_block_rows(torch.tensor(chunk), draft_probs, target_probs,
                                                 make_generator(start))
        rows += [row[:n + 1] for row, n in zip(output, num_accepted)]
    for _ in range(k):  # the target's continuation, up to k+1 tokens
        short = [row for row in rows if len(row) < k + 1]
        if short:
            probs = torch.stack([target[tuple(row)] for row in short]).float()
            for row, token in zip(short, torch.multinomial(probs, 1, generator=gen)[:, 0]
                                  .tolist()):
                row.append(token)
    codes = np.ravel_multi_index(np.array(rows).T, (vocab_size,) * (k + 1))
    return np.bincount(codes, minlength=vocab_size ** (k + 1))


def _exact_law(kind: str, vocab_size: int, k: int, seed: int) -> np.ndarray:
    draft, target = _tables(kind, vocab_size, k, seed)
    return _block_law(draft, target, k, vocab_size)[0].reshape(-1).numpy()


# (kind, fixture seed, rows): the cold fixtures' seeds have spread prefixes (a law of 9 and 13
# cells), where the others are certain at every prefix
SAMPLER_CASES = [("close", 0, 12_000), ("cold_T0.01", 1, 6_000), ("cold_T0.1", 2, 6_000),
                 ("bias_plus100", 0, 6_000), ("bias_minus100", 0, 6_000)]


@pytest.mark.parametrize("kind, seed, num_rows", SAMPLER_CASES)
def test_sampler_matches_the_exact_law(kind, seed, num_rows):
    counts = _sampled_counts(kind, 3, 2, seed=seed, num_rows=num_rows)
    result = g_test(counts, _exact_law(kind, 3, 2, seed=seed))
    assert result.dof >= 2 and result.p_value > 1e-3, str(result)


@pytest.mark.parametrize("kind, seed, num_rows", SAMPLER_CASES)
def test_sampler_with_the_first_failure_rule_is_rejected(monkeypatch, kind, seed, num_rows):
    monkeypatch.setattr(verify_block, "_last_pass", _first_failure)
    counts = _sampled_counts(kind, 3, 2, seed=seed, num_rows=num_rows)
    result = g_test(counts, _exact_law(kind, 3, 2, seed=seed))
    assert result.p_value < 1e-6, str(result)


def test_fast_rows_match_the_reference_rule():
    # verify_block_with_randomness decides on host floats; block_weights is the tensor
    # reference. Same etas -> the same tau, over random pairs and ragged rows.
    gen = make_generator(7)
    for _ in range(20):
        draft_probs = torch.softmax(2 * torch.randn(6, 4, 5, generator=gen), -1)
        target_probs = torch.softmax(2 * torch.randn(6, 5, 5, generator=gen), -1)
        draft_tokens = torch.multinomial(draft_probs.reshape(-1, 5), 1,
                                         generator=gen).reshape(6, 4)
        num_draft = torch.randint(0, 5, (6,), generator=gen)
        etas = torch.rand(6, 4, generator=gen)
        result = verify_block_with_randomness(draft_tokens, draft_probs, target_probs, etas,
                                              torch.rand(6, generator=gen, dtype=torch.float64),
                                              num_draft)
        _, stop_probs = block_weights(draft_tokens, draft_probs, target_probs, num_draft)
        passes = torch.cat([torch.ones(6, 1, dtype=torch.bool), etas < stop_probs[:, 1:]], 1)
        expected = (passes * torch.arange(5)).amax(1)
        assert result.num_accepted.tolist() == expected.tolist()


# --- 4. reproducibility and input checks ------------------------------------------------------


def _random_batch(batch_size: int, seed: int):
    gen = make_generator(seed)
    draft_probs = torch.softmax(torch.randn(batch_size, 3, 6, generator=gen), -1)
    target_probs = torch.softmax(torch.randn(batch_size, 4, 6, generator=gen), -1)
    draft_tokens = torch.multinomial(draft_probs.reshape(-1, 6), 1, generator=gen).reshape(
        batch_size, 3)
    return draft_tokens, draft_probs, target_probs


def test_a_seed_reproduces_its_round_and_matches_replay():
    draft_tokens, draft_probs, target_probs = _random_batch(4, 0)
    first = verify_block_rows(draft_tokens, draft_probs, target_probs, make_generator(5))
    assert first == verify_block_rows(draft_tokens, draft_probs, target_probs, make_generator(5))
    gen = make_generator(5)  # one generator: etas [B, K] fp32, then next_uniforms [B] fp64
    etas = torch.rand((4, 3), generator=gen)
    next_uniforms = torch.rand((4,), generator=gen, dtype=torch.float64)
    replay = verify_block_with_randomness(draft_tokens, draft_probs, target_probs, etas,
                                          next_uniforms)
    assert first == (replay.num_accepted.tolist(), replay.output_tokens.tolist())


def test_a_row_with_its_own_generator_ignores_its_batch_mates():
    draft_tokens, draft_probs, target_probs = _random_batch(3, 1)
    outcomes = set()
    for seed in range(30):
        alone = verify_block_rows(draft_tokens[:1], draft_probs[:1], target_probs[:1],
                                  [make_generator(seed)])
        mates = [make_generator(seed), make_generator(100 + seed), make_generator(100 + seed)]
        shared = verify_block_rows(draft_tokens, draft_probs, target_probs, mates, [3, 2, 1])
        assert (shared[0][0], shared[1][0]) == (alone[0][0], alone[1][0])
        outcomes.add(tuple(alone[1][0]))
    assert len(outcomes) > 1  # the seeds do matter


def test_bad_inputs_raise_typed_errors():
    draft_tokens, draft_probs, target_probs = _random_batch(2, 2)
    gen = make_generator(0)
    with pytest.raises(UnsupportedFeatureError, match="verify_rows"):
        verify_block_rows(draft_tokens, None, target_probs, gen)
    with pytest.raises(ShapeError):
        verify_block_rows(draft_tokens, draft_probs, target_probs[:, :3], gen)
    with pytest.raises(ShapeError):
        verify_block_rows(draft_tokens, draft_probs, target_probs, gen, [3])
    with pytest.raises(ConfigError, match="torch.Generator"):
        verify_block_rows(draft_tokens, draft_probs, target_probs, None)
    with pytest.raises(NonFiniteError):
        verify_block_rows(draft_tokens, draft_probs, target_probs.clone().fill_(float("nan")), gen)
    with pytest.raises(TokenOutOfRangeError):
        verify_block_rows(draft_tokens.clone().fill_(6), draft_probs, target_probs, gen)
    zero_at_draft = draft_probs.clone().scatter_(-1, draft_tokens[..., None], 0.0)
    with pytest.raises(DraftContractError):
        verify_block_rows(draft_tokens, zero_at_draft, target_probs, gen)
    for verify_fn in (lambda: verify_block_rows(draft_tokens, zero_at_draft, target_probs, gen),
                      lambda: block_weights(draft_tokens, zero_at_draft, target_probs)):
        with pytest.raises(DraftContractError):
            verify_fn()


def test_point_mass_error_names_a_function_that_exists():
    # the error sends the caller to the token-wise rule: the dotted name it gives must import
    draft_tokens, _, target_probs = _random_batch(2, 2)
    with pytest.raises(UnsupportedFeatureError) as raised:
        verify_block_rows(draft_tokens, None, target_probs, make_generator(0))
    names = re.findall(r"verispec(?:\.\w+)+", str(raised.value))
    assert names, str(raised.value)
    for name in names:
        module, attribute = name.rsplit(".", 1)
        assert hasattr(importlib.import_module(module), attribute), name
