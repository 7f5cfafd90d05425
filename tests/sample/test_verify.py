"""sample/rejection.py, sample/greedy.py, sample/theory.py: batched modified rejection sampling, its
temperature-0 forms, its edge cases, and the diagnostics.

Three layers: exact spike cases (hand-built distributions whose outcome is certain), the batched
op against a per-row Python reference given the same random numbers, and hypothesis properties.

Legend: B batch, K draft tokens, V vocabulary.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec import (
    ConfigError,
    DraftContractError,
    InputError,
    NonFiniteError,
    ShapeError,
    TokenOutOfRangeError,
    expected_tokens_per_step,
    optimal_num_draft_tokens,
    theoretical_speedup,
    verify,
)
from verispec.config import SamplingConfig
from verispec.sample.checks import check_stop_token_ids
from verispec.sample.greedy import verify_greedy, verify_greedy_rows, verify_greedy_tokens
from verispec.sample.rejection import (
    point_mass,
    residual_probs,
    verify_rows,
    verify_with_randomness,
)
from verispec.sample.result import PAD_TOKEN
from verispec.sample.sampling import greedy_tokens, make_generator, to_probs
from verispec.sample.theory import expected_acceptance

from rule_references import acceptance_probs

pytestmark = pytest.mark.usefixtures("single_thread_torch")


def _one_hot(token: int, vocab_size: int) -> list[float]:
    return [1.0 if i == token else 0.0 for i in range(vocab_size)]


def _near_one_hot(token: int, vocab_size: int, mass: float = 0.9) -> list[float]:
    rest = (1.0 - mass) / (vocab_size - 1)
    return [mass if i == token else rest for i in range(vocab_size)]


def _tensor(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


SEEDS = range(25)  # spike cases must hold for every seed, not just one


# --- 1. exact spike cases --------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_all_accepted_then_bonus_from_target_position_k(seed):
    draft_tokens = torch.tensor([[1, 2, 3]])
    # target >= draft at every proposed token -> ratio >= 1 -> accepted with certainty
    draft_probs = _tensor([[_near_one_hot(1, 5), _near_one_hot(2, 5), _near_one_hot(3, 5)]])
    target_probs = _tensor([[_one_hot(1, 5), _one_hot(2, 5), _one_hot(3, 5),
                             _one_hot(4, 5)]])  # position K: the bonus distribution
    result = verify(draft_tokens, draft_probs, target_probs, make_generator(seed))
    assert result.num_accepted.tolist() == [3]
    assert result.output_tokens.tolist() == [[1, 2, 3, 4]]
    assert result.num_emitted.tolist() == [4]
    assert result.first_rejection.tolist() == [3]
    assert result.all_accepted.tolist() == [True]
    assert result.next_tokens.tolist() == [4]


def test_bonus_is_a_draw_from_target_position_k():
    draft_tokens = torch.tensor([[0]])
    draft_probs = _tensor([[_one_hot(0, 4)]])
    target_probs = _tensor([[_one_hot(0, 4), [0.0, 0.5, 0.0, 0.5]]])
    bonus = {int(verify(draft_tokens, draft_probs, target_probs, make_generator(s)).next_tokens)
             for s in range(40)}
    assert bonus == {1, 3}  # both support points appear, nothing else does


@pytest.mark.parametrize("seed", SEEDS)
def test_rejection_at_position_zero_draws_from_the_residual(seed):
    # draft proposes 1; the target gives 1 probability 0 -> rejected with certainty.
    # residual = norm(max(0, target - draft)) = one-hot(3): token 2 has target mass 0.4 but is
    # covered by the draft, so resampling from the target (a classic bug) would emit 2 sometimes.
    draft_tokens = torch.tensor([[1, 0]])
    draft_probs = _tensor([[[0.0, 0.6, 0.4, 0.0, 0.0], _one_hot(0, 5)]])
    target_probs = _tensor([[[0.0, 0.0, 0.4, 0.6, 0.0], _one_hot(0, 5), _one_hot(0, 5)]])
    result = verify(draft_tokens, draft_probs, target_probs, make_generator(seed))
    assert result.num_accepted.tolist() == [0]
    assert result.output_tokens.tolist() == [[3, PAD_TOKEN, PAD_TOKEN]]
    assert result.first_rejection.tolist() == [0]
    assert result.all_accepted.tolist() == [False]
    assert result.num_emitted.tolist() == [1]


@pytest.mark.parametrize("seed", SEEDS)
def test_rejection_mid_draft(seed):
    draft_tokens = torch.tensor([[4, 1, 2, 5]])
    draft_probs = _tensor([[_near_one_hot(4, 6), _one_hot(1, 6), [0.0, 0.0, 0.5, 0.5, 0.0, 0.0],
                            _one_hot(5, 6)]])
    target_probs = _tensor([[_one_hot(4, 6), [0.2, 0.8, 0.0, 0.0, 0.0, 0.0],
                             [0.0, 0.0, 0.0, 0.5, 0.0, 0.5],  # gives 2 nothing -> rejected
                             _one_hot(5, 6), _one_hot(0, 6)]])
    # position 0 is accepted for sure (ratio 1 / 0.9), position 2 rejected for sure (ratio 0);
    # position 1 has ratio 0.8, so with a generator either outcome occurs and each must give its
    # exact output. The deterministic core below pins both with explicit uniforms.
    result = verify(draft_tokens, draft_probs, target_probs, make_generator(seed))
    n = int(result.num_accepted)
    assert n in (1, 2)
    if n == 2:  # rejected at 2: residual max(0, [0,0,0,.5,0,.5] - [0,0,.5,.5,0,0]) = one-hot(5)
        assert result.output_tokens.tolist() == [[4, 1, 5, PAD_TOKEN, PAD_TOKEN]]
    else:  # rejected at 1: residual max(0, [.2,.8,...] - one-hot(1)) = one-hot(0)
        assert result.output_tokens.tolist() == [[4, 0, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN]]
    assert result.first_rejection.tolist() == [n]

    uniforms = torch.tensor([[0.3, 0.79, 0.0, 0.0]])
    next_uniforms = torch.tensor([0.5], dtype=torch.float64)
    exact = verify_with_randomness(draft_tokens, draft_probs, target_probs, uniforms,
                                   next_uniforms)
    assert exact.output_tokens.tolist() == [[4, 1, 5, PAD_TOKEN, PAD_TOKEN]]
    uniforms = torch.tensor([[0.3, 0.81, 0.0, 0.0]])
    exact = verify_with_randomness(draft_tokens, draft_probs, target_probs, uniforms,
                                   next_uniforms)
    assert exact.output_tokens.tolist() == [[4, 0, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN]]


@pytest.mark.parametrize("seed", SEEDS)
def test_ragged_batch_with_different_outcomes_per_row(seed):
    # Worked example, V = 5, K = 3, num_draft_tokens = [3, 1, 0, 2]:
    #   row 0: 3 drafts, all accepted       -> [1, 2, 3, bonus from target[0, 3] = 4]
    #   row 1: 1 draft, accepted            -> [2, bonus from target[1, 1] = 0]  (not target[1, 3])
    #   row 2: 0 drafts                     -> [bonus from target[2, 0] = 3]
    #   row 3: 2 drafts, rejected at 1      -> [1, recovered from residual at 1 = 4]
    # Entries past each row's length are garbage (-1 and 7) and must be ignored.
    draft_tokens = torch.tensor([[1, 2, 3], [2, -1, 7], [7, 7, 7], [1, 0, -1]])
    uniform = [0.2] * 5
    draft_probs = _tensor([
        [_one_hot(1, 5), _one_hot(2, 5), _one_hot(3, 5)],
        [_one_hot(2, 5), uniform, uniform],
        [uniform, uniform, uniform],
        [_one_hot(1, 5), [0.5, 0.0, 0.0, 0.0, 0.5], uniform],
    ])
    target_probs = _tensor([
        [_one_hot(1, 5), _one_hot(2, 5), _one_hot(3, 5), _one_hot(4, 5)],
        [_one_hot(2, 5), _one_hot(0, 5), _one_hot(1, 5), _one_hot(1, 5)],
        [_one_hot(3, 5), _one_hot(0, 5), _one_hot(0, 5), _one_hot(0, 5)],
        [_one_hot(1, 5), [0.0, 0.0, 0.0, 0.0, 1.0], _one_hot(2, 5), _one_hot(2, 5)],
    ])
    num_draft_tokens = torch.tensor([3, 1, 0, 2])
    result = verify(draft_tokens, draft_probs, target_probs, make_generator(seed),
                    num_draft_tokens)
    P = PAD_TOKEN
    assert result.output_tokens.tolist() == [[1, 2, 3, 4], [2, 0, P, P], [3, P, P, P],
                                             [1, 4, P, P]]
    assert result.num_accepted.tolist() == [3, 1, 0, 1]
    assert result.num_emitted.tolist() == [4, 2, 1, 2]
    assert result.first_rejection.tolist() == [3, 1, 0, 1]
    assert result.all_accepted.tolist() == [True, True, True, False]
    assert result.next_tokens.tolist() == [4, 0, 3, 4]


@pytest.mark.parametrize("seed", SEEDS)
def test_point_mass_draft(seed):
    # draft_probs None: token x is accepted with probability target(x), and the recovered token
    # comes from the target with x removed.
    draft_tokens = torch.tensor([[2, 1], [3, 3]])
    target_probs = _tensor([
        [_one_hot(2, 4), [0.0, 0.0, 0.5, 0.5], _one_hot(0, 4)],  # 2 sure; 1 has p = 0
        [[0.0, 0.0, 0.0, 1.0], _one_hot(3, 4), _one_hot(1, 4)],  # 3 sure, 3 sure, bonus 1
    ])
    result = verify(draft_tokens, None, target_probs, make_generator(seed))
    # row 0 rejected at 1; residual = max(0, [0,0,.5,.5] - one-hot(1)) = [0,0,.5,.5]
    assert result.num_accepted.tolist() == [1, 2]
    assert result.output_tokens[0, 0] == 2 and int(result.output_tokens[0, 1]) in (2, 3)
    assert result.output_tokens[0, 2] == PAD_TOKEN
    assert result.output_tokens[1].tolist() == [3, 3, 1]


def test_point_mass_acceptance_rate_is_target_probability():
    num_rows = 4000
    draft_tokens = torch.zeros((num_rows, 1), dtype=torch.int64)
    target_probs = _tensor([[0.3, 0.7, 0.0], [1.0, 0.0, 0.0]]).expand(num_rows, 2, 3)
    result = verify(draft_tokens, None, target_probs, make_generator(3))
    rate = result.num_accepted.double().mean().item()
    assert abs(rate - 0.3) < 5 * math.sqrt(0.3 * 0.7 / num_rows)
    rejected = result.num_accepted == 0
    assert bool((result.output_tokens[rejected, 0] == 1).all())  # residual: 0 removed
    assert bool((result.output_tokens[~rejected, 1] == 0).all())  # bonus


def test_point_mass_ragged_row_ignores_out_of_vocab_padding():
    # The docstring: entries at positions >= num_draft_tokens[b] are ignored. Row 1 has one draft
    # token and garbage 99 after it (>= V). With draft_probs given this works; with a point-mass
    # draft it must work too (expected: row 1 accepts 3 and takes the bonus from target[1, 1]).
    # Regression: the point-mass residual once one-hot encoded the padding and crashed.
    draft_tokens = torch.tensor([[1, 2], [3, 99]])
    target_probs = torch.full((2, 3, 4), 0.25)
    target_probs[1, 0] = torch.tensor(_one_hot(3, 4))
    target_probs[1, 1] = torch.tensor(_one_hot(0, 4))
    uniforms, next_uniforms = torch.zeros(2, 2), torch.zeros(2, dtype=torch.float64)
    num_draft_tokens = torch.tensor([2, 1])
    with_probs = verify_with_randomness(draft_tokens, torch.full((2, 2, 4), 0.25), target_probs,
                                        uniforms, next_uniforms, num_draft_tokens)
    assert with_probs.output_tokens[1].tolist() == [3, 0, PAD_TOKEN]
    point = verify_with_randomness(draft_tokens, None, target_probs, uniforms, next_uniforms,
                                   num_draft_tokens)
    assert point.output_tokens[1].tolist() == [3, 0, PAD_TOKEN]


@pytest.mark.parametrize("seed", range(10))
def test_verify_greedy_equals_verify_on_point_masses(seed):
    # Temperature 0: target rows are point masses (to_probs of random logits), the draft is a
    # point mass; verify with any random numbers and verify_greedy (none drawn) must agree, on a
    # ragged batch where some draft tokens match the target's argmax and some do not.
    gen = torch.Generator().manual_seed(seed)
    batch_size, max_k, vocab_size = 6, 4, 5
    target_probs = to_probs(torch.randn(batch_size, max_k + 1, vocab_size, generator=gen),
                            SamplingConfig(temperature=0.0))
    argmax = target_probs.argmax(-1)[:, :max_k]
    agree = torch.rand(batch_size, max_k, generator=gen) < 0.7
    draft_tokens = torch.where(agree, argmax, (argmax + 1) % vocab_size)
    num_draft = torch.randint(0, max_k + 1, (batch_size,), generator=gen)
    expected = verify(draft_tokens, None, target_probs, make_generator(seed + 100), num_draft)
    result = verify_greedy(draft_tokens, target_probs, num_draft)
    assert result.output_tokens.tolist() == expected.output_tokens.tolist()
    assert result.num_accepted.tolist() == expected.num_accepted.tolist()
    # the engine's form: the target's tokens (greedy_tokens of the logits), no one-hot rows
    from_tokens = verify_greedy_tokens(draft_tokens, target_probs.argmax(-1), vocab_size,
                                       num_draft)
    assert from_tokens.output_tokens.tolist() == expected.output_tokens.tolist()
    assert from_tokens.num_accepted.tolist() == expected.num_accepted.tolist()
    # and the outcome is the argmax rule: accept while the draft equals the target's argmax
    for row in range(batch_size):
        n = int(result.num_accepted[row])
        assert draft_tokens[row, :n].tolist() == argmax[row, :n].tolist()
        assert int(result.output_tokens[row, n]) == int(target_probs[row, n].argmax())


def test_verify_greedy_is_not_a_verifier_for_sampled_targets():
    # Negative control for the shortcut: on a target that is NOT a point mass, verify_greedy is
    # not valid (its contract is temperature 0). Draft token 1 has p = 0.5: verify accepts it
    # about half the time, verify_greedy never (the target's argmax is token 0), so the engine
    # must only call it at temperature 0.
    draft_tokens = torch.tensor([[1]])
    target_probs = _tensor([[[0.5, 0.5], [1.0, 0.0]]])
    outcomes = {int(verify(draft_tokens, None, target_probs, make_generator(s)).num_accepted[0])
                for s in range(40)}
    assert outcomes == {0, 1}
    assert int(verify_greedy(draft_tokens, target_probs).num_accepted[0]) == 0


def test_verify_greedy_checks_its_inputs():
    with pytest.raises(ShapeError):
        verify_greedy(torch.tensor([[1, 2]]), torch.zeros(1, 2, 4))  # needs K+1 = 3 positions
    with pytest.raises(NonFiniteError):
        verify_greedy(torch.tensor([[1]]), torch.tensor([[[0.0, float("nan")], [1.0, 0.0]]]))
    with pytest.raises(TokenOutOfRangeError):
        verify_greedy(torch.tensor([[7]]), to_probs(torch.zeros(1, 2, 4),
                                                    SamplingConfig(temperature=0.0)))


def test_greedy_tokens_ties_go_to_the_lowest_id_and_non_finite_raises():
    assert greedy_tokens(torch.tensor([[0.0, 2.0, 2.0], [5.0, 5.0, 1.0]])).tolist() == [1, 0]
    with pytest.raises(NonFiniteError):
        greedy_tokens(torch.tensor([[0.0, float("nan")]]))
    with pytest.raises(NonFiniteError):
        greedy_tokens(torch.tensor([[-float("inf"), -float("inf")]]))


def test_zero_draft_tokens_is_a_plain_target_sample():
    target_probs = _tensor([[[0.0, 0.0, 1.0]], [[1.0, 0.0, 0.0]]])  # [B=2, K+1=1, V=3]
    result = verify(torch.empty((2, 0), dtype=torch.int64), None, target_probs,
                    make_generator(0))
    assert result.output_tokens.tolist() == [[2], [0]]
    assert result.num_accepted.tolist() == [0, 0]
    assert result.all_accepted.tolist() == [True, True]


# --- 2. the batched op against a per-row Python reference ------------------------------------


def reference_verify(draft_tokens, draft_probs, target_probs, uniforms, next_uniforms,
                     num_draft_tokens):
    """Leviathan et al. Algorithm 1, one row and one position at a time.

    Returns output rows (lists of emitted tokens, no padding). The acceptance ratio is computed
    on the same fp32 scalars as the batched op so that u < ratio compares identical numbers.
    """
    outputs = []
    for b in range(draft_tokens.shape[0]):
        emitted = []
        rejected_at = None
        for i in range(int(num_draft_tokens[b])):
            token = int(draft_tokens[b, i])
            target_row = target_probs[b, i]
            draft_row = (point_mass(torch.tensor(token), target_probs.shape[-1])
                         if draft_probs is None else draft_probs[b, i])
            ratio = min(1.0, float(target_row[token] / draft_row[token]))
            if float(uniforms[b, i]) < ratio:
                emitted.append(token)
                continue
            residual = (target_row - draft_row).clamp_min(0.0)
            final = residual / residual.sum() if float(residual.sum()) > 0 else target_row
            rejected_at = i
            break
        if rejected_at is None:
            final = target_probs[b, int(num_draft_tokens[b])]  # the bonus distribution
        emitted.append(_inverse_cdf(final, float(next_uniforms[b])))
        outputs.append(emitted)
    return outputs


def random_case(seed: int, point_mass_draft: bool = False):
    """A random verification problem with zeros, ragged lengths and related distributions."""
    gen = make_generator(seed)
    batch_size = int(torch.randint(1, 6, (1,), generator=gen))
    max_k = int(torch.randint(0, 7, (1,), generator=gen))
    vocab_size = int(torch.randint(2, 9, (1,), generator=gen))

    def random_probs(shape):
        logits = torch.randn(shape, generator=gen) * 2.0
        zeros = torch.rand(shape, generator=gen) < 0.35
        zeros.scatter_(-1, logits.argmax(-1, keepdim=True), False)  # keep >= 1 token per row
        return torch.softmax(logits.masked_fill(zeros, -math.inf), -1)

    target_probs = random_probs((batch_size, max_k + 1, vocab_size))
    draft_probs = random_probs((batch_size, max_k, vocab_size))
    # some rows: draft == target at some positions (residual 0), or draft = sharpened target
    mix = torch.rand((batch_size, max_k, 1), generator=gen)
    draft_probs = torch.where(mix < 0.2, target_probs[:, :max_k], draft_probs)
    draft_tokens = torch.multinomial(draft_probs.reshape(-1, vocab_size), 1, generator=gen
                                     ).reshape(batch_size, max_k) if max_k else torch.empty(
        (batch_size, 0), dtype=torch.int64)
    num_draft = torch.randint(0, max_k + 1, (batch_size,), generator=gen)
    positions = torch.arange(max_k)[None, :]
    draft_tokens = torch.where(positions < num_draft[:, None], draft_tokens, PAD_TOKEN)
    uniforms = torch.rand((batch_size, max_k), generator=gen)
    next_uniforms = torch.rand((batch_size,), generator=gen, dtype=torch.float64)
    if point_mass_draft:  # positions past num_draft keep PAD_TOKEN: verify must ignore them
        draft_probs = None
    return draft_tokens, draft_probs, target_probs, uniforms, next_uniforms, num_draft


def _inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The first token whose cumulative mass exceeds u * total, in plain Python floats."""
    values = [float(x) for x in probs.double()]
    threshold, running = u * sum(values), 0.0
    for token, value in enumerate(values):
        running += value
        if value > 0 and running > threshold:
            return token
    return max(i for i, value in enumerate(values) if value > 0)


@pytest.fixture(params=[8, 0], ids=["host_rows", "tensor_batched"])
def verify_path(request, monkeypatch):
    """Each implementation behind verify_with_randomness and verify_rows: host decisions for
    small batches, tensor ops for large ones (batches here have 1 to 5 rows; a limit of 0 sends
    them all to tensors)."""
    monkeypatch.setattr(importlib.import_module("verispec.sample.rejection"), "HOST_ROWS_MAX_BATCH",
                        request.param)


@pytest.mark.usefixtures("verify_path")
@pytest.mark.parametrize("point_mass_draft", [False, True], ids=["draft_probs", "point_mass"])
def test_batched_verify_equals_per_row_reference(point_mass_draft):
    num_rejections = num_bonus = 0
    for seed in range(400):
        case = random_case(seed, point_mass_draft)
        draft_tokens, draft_probs, target_probs, uniforms, next_uniforms, num_draft = case
        result = verify_with_randomness(*case)
        expected = reference_verify(*case)
        got = [row[:n].tolist() for row, n in zip(result.output_tokens, result.num_emitted)]
        assert got == expected, f"seed {seed}"
        assert result.num_accepted.tolist() == [len(row) - 1 for row in expected]
        assert bool((result.output_tokens[:, :][torch.arange(result.output_tokens.shape[1])
                                                 >= result.num_emitted[:, None]] == PAD_TOKEN
                     ).all())
        num_bonus += int(result.all_accepted.sum())
        num_rejections += int((~result.all_accepted).sum())
    assert num_rejections > 100 and num_bonus > 100  # both branches well exercised


def test_verify_draws_uniforms_then_next_uniforms_from_the_generator():
    for seed in range(30):
        draft_tokens, draft_probs, target_probs, _, _, num_draft = random_case(seed)
        batch_size, max_k = draft_tokens.shape
        gen = make_generator(1000 + seed)
        uniforms = torch.rand((batch_size, max_k), generator=gen)
        next_uniforms = torch.rand((batch_size,), generator=gen, dtype=torch.float64)
        expected = verify_with_randomness(draft_tokens, draft_probs, target_probs, uniforms,
                                          next_uniforms, num_draft)
        got = verify(draft_tokens, draft_probs, target_probs, make_generator(1000 + seed),
                     num_draft)
        assert torch.equal(got.output_tokens, expected.output_tokens)


def _full_case(seed: int, point_mass_draft: bool):
    """random_case with every row proposing all K tokens (verify_rows' shape), drawn from the
    draft's distributions."""
    _, draft_probs, target_probs, _, _, _ = random_case(seed)
    batch_size, max_k, vocab_size = draft_probs.shape
    draft_tokens = torch.multinomial(draft_probs.reshape(-1, vocab_size), 1,
                                     generator=make_generator(seed)).reshape(
        batch_size, max_k) if max_k else torch.empty((batch_size, 0), dtype=torch.int64)
    return draft_tokens, None if point_mass_draft else draft_probs, target_probs


@pytest.mark.usefixtures("verify_path")
@pytest.mark.parametrize("point_mass_draft", [False, True], ids=["draft_probs", "point_mass"])
def test_verify_rows_equals_verify_read_back(point_mass_draft):
    # the engine's form: the same random numbers in the same order, the result as host lists
    num_rejections = 0
    for seed in range(300):
        draft_tokens, draft_probs, target_probs = _full_case(seed, point_mass_draft)
        expected = verify(draft_tokens, draft_probs, target_probs, make_generator(seed))
        generator = make_generator(seed)
        num_accepted, output_tokens = verify_rows(draft_tokens, draft_probs, target_probs,
                                                  generator)
        assert num_accepted == expected.num_accepted.tolist(), f"seed {seed}"
        assert output_tokens == expected.output_tokens.tolist(), f"seed {seed}"
        # and it took exactly verify's random numbers: the generators are in the same state
        assert torch.equal(generator.get_state(), _advanced(seed, draft_tokens.shape))
        num_rejections += int((~expected.all_accepted).sum())
    assert num_rejections > 100


def _advanced(seed: int, shape: tuple[int, int]) -> torch.Tensor:
    generator = make_generator(seed)
    torch.rand(shape, generator=generator)
    torch.rand(shape[:1], generator=generator, dtype=torch.float64)
    return generator.get_state()


def test_verify_rows_checks_its_inputs():
    draft_tokens, draft_probs, target_probs = _full_case(3, False)
    with pytest.raises(NonFiniteError):
        verify_rows(draft_tokens, draft_probs, torch.full_like(target_probs, float("nan")),
                    make_generator(0))
    with pytest.raises(ShapeError):
        verify_rows(draft_tokens, draft_probs, target_probs[:, :1], make_generator(0))
    with pytest.raises(TokenOutOfRangeError):
        verify_rows(torch.tensor([[5]]), None, torch.full((1, 2, 4), 0.25), make_generator(0))


def test_seeded_reproducibility():
    draft_tokens, draft_probs, target_probs, _, _, num_draft = random_case(7)
    runs = [verify(draft_tokens, draft_probs, target_probs, make_generator(42), num_draft)
            for _ in range(2)]
    assert torch.equal(runs[0].output_tokens, runs[1].output_tokens)
    assert torch.equal(runs[0].num_accepted, runs[1].num_accepted)


def test_different_seeds_give_different_outcomes():
    num_rows = 500
    draft_tokens = torch.randint(0, 4, (num_rows, 3), generator=make_generator(0))
    draft_probs = torch.full((num_rows, 3, 4), 0.25)
    target_probs = torch.softmax(torch.randn((num_rows, 4, 4), generator=make_generator(1)), -1)
    a = verify(draft_tokens, draft_probs, target_probs, make_generator(1)).output_tokens
    b = verify(draft_tokens, draft_probs, target_probs, make_generator(2)).output_tokens
    assert not torch.equal(a, b)


def test_global_rng_state_is_untouched():
    torch.manual_seed(99)
    before = torch.get_rng_state()
    case = random_case(3)
    verify(case[0], case[1], case[2], make_generator(5), case[5])
    verify(case[0], case[1], case[2], make_generator(None), case[5])
    assert torch.equal(torch.get_rng_state(), before)


# --- 3. edge cases and typed errors ----------------------------------------------------------


def test_draft_giving_zero_probability_to_its_own_token_is_a_contract_error():
    draft_tokens = torch.tensor([[1, 2]])
    draft_probs = _tensor([[[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]])  # token 2 at position 1: p = 0
    target_probs = torch.full((1, 3, 3), 1 / 3)
    with pytest.raises(DraftContractError, match="probability 0"):
        verify(draft_tokens, draft_probs, target_probs, make_generator(0))


def test_contract_is_only_checked_within_each_rows_length():
    draft_tokens = torch.tensor([[1, 2]])
    draft_probs = _tensor([[[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]])
    target_probs = torch.full((1, 3, 3), 1 / 3)
    result = verify(draft_tokens, draft_probs, target_probs, make_generator(0),
                    torch.tensor([1]))
    assert int(result.num_emitted) in (1, 2)


def test_equal_distributions_have_zero_residual_and_never_nan():
    probs = _tensor([[0.2, 0.0, 0.8], [0.0, 1.0, 0.0]])
    residual = residual_probs(probs, probs)
    assert bool(torch.isfinite(residual).all())
    torch.testing.assert_close(residual, probs)  # falls back to the target
    # a draft a hair above the target everywhere it matters: residual 0, and if rounding rejects
    # anyway the next token is drawn from the target, finite
    draft_probs = _tensor([[[0.2 * 1.001, 0.0, 0.8 * 1.001]]])
    target_probs = _tensor([[[0.2, 0.0, 0.8], [0.0, 1.0, 0.0]]])
    for token in (0, 2):
        result = verify_with_randomness(torch.tensor([[token]]), draft_probs, target_probs,
                                        torch.tensor([[0.9999999]]),
                                        torch.tensor([0.5], dtype=torch.float64))
        assert result.num_accepted.tolist() == [0]
        assert int(result.next_tokens) in (0, 2)


def test_random_numbers_of_the_wrong_shape_raise_shape_error():
    draft_tokens, draft_probs, target_probs = torch.tensor([[1]]), torch.full((1, 1, 3), 1 / 3), \
        torch.full((1, 2, 3), 1 / 3)
    with pytest.raises(ShapeError, match="next_uniforms"):
        verify_with_randomness(draft_tokens, draft_probs, target_probs, torch.zeros(1, 1),
                               torch.ones(1, 3))  # exponential noise [B, V]: the old contract
    with pytest.raises(ShapeError, match="uniforms"):
        verify_with_randomness(draft_tokens, draft_probs, target_probs, torch.zeros(1, 2),
                               torch.zeros(1, dtype=torch.float64))


def test_equal_draft_and_target_accept_everything():
    num_rows = 300
    target_probs = torch.softmax(torch.randn((num_rows, 5, 6), generator=make_generator(4)), -1)
    draft_probs = target_probs[:, :4].clone()
    draft_tokens = torch.multinomial(draft_probs.reshape(-1, 6), 1, generator=make_generator(5)
                                     ).reshape(num_rows, 4)
    result = verify(draft_tokens, draft_probs, target_probs, make_generator(6))
    assert bool(result.all_accepted.all())
    assert result.num_accepted.tolist() == [4] * num_rows


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["target", "draft"])
def test_non_finite_probs_raise(bad, where):
    draft_tokens = torch.tensor([[0, 1]])
    draft_probs = torch.full((1, 2, 3), 1 / 3)
    target_probs = torch.full((1, 3, 3), 1 / 3)
    (target_probs if where == "target" else draft_probs)[0, 1, 2] = bad
    with pytest.raises(NonFiniteError, match=f"{where}_probs"):
        verify(draft_tokens, draft_probs, target_probs, make_generator(0))


@pytest.mark.parametrize("where", ["target", "draft"])
def test_negative_probs_raise(where):
    """A negative entry is no distribution: refused, never sampled from."""
    draft_tokens = torch.tensor([[0, 1]])
    draft_probs = torch.full((1, 2, 3), 1 / 3)
    target_probs = torch.full((1, 3, 3), 1 / 3)
    probs = target_probs if where == "target" else draft_probs
    probs[0, 1] = torch.tensor([0.6, 0.6, -0.2])  # sums to 1
    with pytest.raises(InputError, match=f"{where}_probs.*negative.*-0.2.*to_probs"):
        verify(draft_tokens, draft_probs, target_probs, make_generator(0))


def test_stop_token_ids_must_lie_in_the_vocabulary():
    check_stop_token_ids((0, 2), 3)
    with pytest.raises(TokenOutOfRangeError, match="stop_token_ids.*\\b3\\b.*\\[0, 3\\)"):
        check_stop_token_ids((0, 3), 3)


@pytest.mark.parametrize("draft_tokens, draft_probs, target_probs, num_draft, match", [
    (torch.tensor([0, 1]), None, torch.ones(1, 3, 3) / 3, None, "draft_tokens"),  # 1-D
    (torch.tensor([[0, 1]], dtype=torch.int32), None, torch.ones(1, 3, 3) / 3, None,
     "int64"),
    (torch.tensor([[0, 1]]), None, torch.ones(1, 2, 3) / 3, None, "K\\+1"),  # K, not K+1
    (torch.tensor([[0, 1]]), None, torch.ones(2, 3, 3) / 3, None, "target_probs"),  # batch
    (torch.tensor([[0, 1]]), None, torch.ones(3, 3) / 3, None, "target_probs"),  # rank 2
    (torch.tensor([[0, 1]]), torch.ones(1, 2, 4) / 4, torch.ones(1, 3, 3) / 3, None,
     "vocabulary"),
    (torch.tensor([[0, 1]]), torch.ones(1, 1, 3) / 3, torch.ones(1, 3, 3) / 3, None,
     "draft_probs"),
    (torch.tensor([[0, 1]]), None, torch.ones(1, 3, 3) / 3, torch.tensor([3]), "num_draft"),
    (torch.tensor([[0, 1]]), None, torch.ones(1, 3, 3) / 3, torch.tensor([-1]), "num_draft"),
    (torch.tensor([[0, 1]]), None, torch.ones(1, 3, 3) / 3, torch.tensor([1, 1]), "num_draft"),
], ids=["tokens_1d", "tokens_int32", "target_k", "target_batch", "target_rank",
        "draft_vocab", "draft_k", "num_draft_high", "num_draft_negative", "num_draft_len"])
def test_shape_mismatches_raise_shape_error(draft_tokens, draft_probs, target_probs, num_draft,
                                            match):
    with pytest.raises(ShapeError, match=match):
        verify(draft_tokens, draft_probs, target_probs, make_generator(0), num_draft)


@pytest.mark.parametrize("where", ["draft_tokens", "draft_probs"])
def test_inputs_on_two_devices_raise_shape_error(where):
    # meta stands for any device but the target's; tests/models/test_gpu.py does it with cuda
    draft_tokens, draft_probs = torch.tensor([[0, 1]]), torch.ones(1, 2, 3) / 3
    if where == "draft_tokens":
        draft_tokens = draft_tokens.to("meta")
    else:
        draft_probs = draft_probs.to("meta")
    with pytest.raises(ShapeError, match=f"{where} is on meta but target_probs on cpu.*"
                                         "\\.to\\(target_probs.device\\)"):
        verify(draft_tokens, draft_probs, torch.ones(1, 3, 3) / 3, make_generator(0))


@pytest.mark.parametrize("bad_token", [3, 17, -1])
def test_draft_token_out_of_range_raises(bad_token):
    draft_tokens = torch.tensor([[0, bad_token]])
    with pytest.raises(TokenOutOfRangeError, match=f"{bad_token}.*\\[0, 3\\)"):
        verify(draft_tokens, None, torch.ones(1, 3, 3) / 3, make_generator(0))


# --- 4. hypothesis properties ----------------------------------------------------------------


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 2**31 - 1), point_mass_draft=st.booleans(),
       generator_seed=st.integers(0, 2**31 - 1))
def test_properties_on_random_distributions_with_zeros(seed, point_mass_draft, generator_seed):
    draft_tokens, draft_probs, target_probs, _, _, num_draft = random_case(seed, point_mass_draft)
    vocab_size = target_probs.shape[-1]
    result = verify(draft_tokens, draft_probs, target_probs, make_generator(generator_seed),
                    num_draft)
    out = result.output_tokens
    assert out.shape == (draft_tokens.shape[0], draft_tokens.shape[1] + 1)
    assert bool((result.num_accepted >= 0).all() & (result.num_accepted <= num_draft).all())
    assert torch.equal(result.first_rejection, result.num_accepted)
    assert torch.equal(result.num_emitted, result.num_accepted + 1)
    assert torch.equal((out != PAD_TOKEN).sum(1), result.num_accepted + 1)
    assert torch.equal(result.all_accepted, result.num_accepted == num_draft)
    real = out != PAD_TOKEN
    assert bool(((out[real] >= 0) & (out[real] < vocab_size)).all())
    for b in range(out.shape[0]):
        n = int(result.num_accepted[b])
        assert torch.equal(out[b, :n], draft_tokens[b, :n])  # an accepted prefix of the draft
        assert bool((out[b, n + 1:] == PAD_TOKEN).all())
        # the next token always has positive target probability at its position
        assert float(target_probs[b, n, out[b, n]]) > 0


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_diagnostics_are_finite_and_consistent(seed):
    _, draft_probs, target_probs, _, _, _ = random_case(seed)
    max_k = draft_probs.shape[1]
    target = target_probs[:, :max_k]
    accept = acceptance_probs(draft_probs, target)
    residual = residual_probs(draft_probs, target)
    alpha = expected_acceptance(draft_probs, target)
    for tensor in (accept, residual, alpha):
        assert bool(torch.isfinite(tensor).all())
    assert bool(((accept >= 0) & (accept <= 1)).all())
    assert bool(((alpha >= -1e-6) & (alpha <= 1 + 1e-6)).all())
    torch.testing.assert_close(residual.sum(-1), torch.ones_like(alpha), rtol=0, atol=1e-5)
    # sum_x q(x) min(1, p(x)/q(x)) = sum_x min(p, q) = alpha
    torch.testing.assert_close((draft_probs * accept).sum(-1), alpha, rtol=0, atol=1e-5)


# --- 5. diagnostics on examples --------------------------------------------------------------


def test_acceptance_probs_example():
    draft_probs = _tensor([[[0.5, 0.25, 0.25, 0.0]]])
    target_probs = _tensor([[[0.25, 0.5, 0.0, 0.25]]])
    torch.testing.assert_close(acceptance_probs(draft_probs, target_probs),
                               _tensor([[[0.5, 1.0, 0.0, 1.0]]]))  # q = 0 -> 1 by convention


def test_residual_probs_example():
    draft_probs = _tensor([0.5, 0.25, 0.25, 0.0])
    target_probs = _tensor([0.25, 0.5, 0.0, 0.25])
    # max(0, p - q) = [0, .25, 0, .25] -> normalised [0, .5, 0, .5]
    torch.testing.assert_close(residual_probs(draft_probs, target_probs),
                               _tensor([0.0, 0.5, 0.0, 0.5]))


@pytest.mark.parametrize("draft, target", [
    ([0.5, 0.25, 0.25, 0.0], [0.25, 0.5, 0.0, 0.25]),
    ([1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]),  # disjoint: TV = 1
    ([0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4]),  # equal: TV = 0
    ([0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]),
])
def test_expected_acceptance_is_one_minus_total_variation(draft, target):
    draft_probs, target_probs = _tensor(draft), _tensor(target)
    total_variation = 0.5 * (draft_probs - target_probs).abs().sum()
    assert float(expected_acceptance(draft_probs, target_probs)) == pytest.approx(
        1 - float(total_variation), abs=1e-6)


def test_expected_acceptance_matches_observed_rate():
    num_rows = 20_000
    draft = _tensor([0.7, 0.1, 0.1, 0.1])
    target = _tensor([0.25, 0.25, 0.25, 0.25])
    alpha = float(expected_acceptance(draft, target))  # 0.55
    draft_tokens = torch.multinomial(draft, num_rows, replacement=True, generator=make_generator(1))
    result = verify(draft_tokens[:, None], draft.expand(num_rows, 1, 4),
                    target.expand(num_rows, 2, 4), make_generator(2))
    rate = result.num_accepted.double().mean().item()
    assert abs(rate - alpha) < 5 * math.sqrt(alpha * (1 - alpha) / num_rows)


def test_expected_tokens_per_step():
    assert expected_tokens_per_step((0.8, 0.5)) == pytest.approx(2.2)
    assert expected_tokens_per_step(()) == pytest.approx(1.0)
    assert expected_tokens_per_step(torch.tensor([1.0, 1.0, 1.0])) == pytest.approx(4.0)
    assert expected_tokens_per_step([0.0, 0.9]) == pytest.approx(1.0)


@pytest.mark.parametrize("a", [0.0, 0.3, 0.6, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("k", [0, 1, 4, 8])
@pytest.mark.parametrize("c", [0.0, 0.05, 0.5])
def test_theoretical_speedup_closed_form(a, k, c):
    expected_tokens = k + 1 if a == 1.0 else (1 - a ** (k + 1)) / (1 - a)
    assert theoretical_speedup(a, k, c) == pytest.approx(expected_tokens / (k * c + 1))
    # and it agrees with expected_tokens_per_step for i.i.d. rates
    assert expected_tokens == pytest.approx(expected_tokens_per_step([a] * k))


def test_theoretical_speedup_at_full_acceptance():
    assert theoretical_speedup(1.0, 4, 0.25) == pytest.approx(5 / 2)
    assert theoretical_speedup(1.0, 0, 0.25) == pytest.approx(1.0)


@pytest.mark.parametrize("a, k, c, field", [
    (-0.1, 2, 0.1, "acceptance_rate"), (1.1, 2, 0.1, "acceptance_rate"),
    (math.nan, 2, 0.1, "acceptance_rate"), (0.5, -1, 0.1, "num_draft_tokens"),
    (0.5, 2.5, 0.1, "num_draft_tokens"), (0.5, True, 0.1, "num_draft_tokens"),
    (0.5, 2, -0.1, "cost_ratio"), (0.5, 2, math.inf, "cost_ratio"),
    (0.5, 2, math.nan, "cost_ratio")])
def test_theoretical_speedup_rejects_bad_arguments(a, k, c, field):
    """A ConfigError (still a ValueError) naming the argument; 2.5 draft tokens used to be
    truncated to 2 silently, and an infinite cost ratio gave a speedup of 0."""
    with pytest.raises(ConfigError, match=f"^{field}="):
        theoretical_speedup(a, k, c)


def test_theoretical_speedup_takes_numpy_integers():
    numpy = pytest.importorskip("numpy")
    assert theoretical_speedup(0.7, numpy.int64(2), 0.3) == theoretical_speedup(0.7, 2, 0.3)


@pytest.mark.parametrize("rates", [[0.5, 1.5], [-0.1], [math.nan]])
def test_expected_tokens_per_step_rejects_rates_outside_0_1(rates):
    with pytest.raises(ConfigError, match="acceptance_rates"):
        expected_tokens_per_step(rates)


def test_optimal_num_draft_tokens_rejects_a_bad_bound():
    for bound in (0, -3, 2.0):
        with pytest.raises(ConfigError, match="max_num_draft_tokens"):
            optimal_num_draft_tokens(0.7, 0.3, bound)


@pytest.mark.parametrize("generator", [None, 0, "seed"])
def test_verify_needs_an_explicit_generator(generator):
    """No silent fallback to the global RNG: a ConfigError, not an AttributeError."""
    draft_tokens, probs = torch.tensor([[1]]), torch.full((1, 1, 4), 0.25)
    target_probs = torch.full((1, 2, 4), 0.25)
    for verify_fn in (verify, verify_rows):
        with pytest.raises(ConfigError, match="torch.Generator"):
            verify_fn(draft_tokens, probs, target_probs, generator)


@pytest.mark.parametrize("a", [0.1, 0.5, 0.7, 0.8, 0.9, 0.95, 1.0])
@pytest.mark.parametrize("c", [0.01, 0.05, 0.2, 1.0])
def test_optimal_num_draft_tokens_is_the_argmax(a, c):
    best, speedup = optimal_num_draft_tokens(a, c, max_num_draft_tokens=16)
    by_k = {k: (1 - a ** (k + 1)) / (1 - a) / (k * c + 1) if a < 1 else (k + 1) / (k * c + 1)
            for k in range(1, 17)}
    assert 1 <= best <= 16
    assert speedup == pytest.approx(by_k[best])
    assert speedup >= max(by_k.values()) * (1 - 1e-12)


def test_optimal_num_draft_tokens_examples():
    assert optimal_num_draft_tokens(0.1, 1.0)[0] == 1  # hopeless draft: the minimum
    assert optimal_num_draft_tokens(1.0, 0.0, max_num_draft_tokens=8)[0] == 8  # free, perfect


def test_verify_greedy_tokens_checks_its_inputs():
    with pytest.raises(ShapeError):  # needs K+1 = 3 target tokens
        verify_greedy_tokens(torch.tensor([[1, 2]]), torch.tensor([[1, 2]]), 4)
    with pytest.raises(ShapeError):  # target tokens are ids, not probabilities
        verify_greedy_tokens(torch.tensor([[1]]), torch.tensor([[0.0, 1.0]]), 4)
    with pytest.raises(TokenOutOfRangeError):
        verify_greedy_tokens(torch.tensor([[7]]), torch.tensor([[1, 2]]), 4)
    with pytest.raises(TokenOutOfRangeError):  # the target's tokens are range-checked too
        verify_greedy_tokens(torch.tensor([[1]]), torch.tensor([[1, 4]]), 4)
    with pytest.raises(ShapeError):
        verify_greedy_tokens(torch.tensor([[1]]), torch.tensor([[1, 2]]), 0)
    with pytest.raises(ShapeError):
        verify_greedy_tokens(torch.tensor([[1]]), torch.tensor([[1, 2]]), 4, torch.tensor([2]))
    # a token past its row's num_draft_tokens is not proposed, so it is not range-checked
    result = verify_greedy_tokens(torch.tensor([[1, 9]]), torch.tensor([[1, 3, 0]]), 4,
                                  torch.tensor([1]))
    assert result.output_tokens.tolist() == [[1, 3, PAD_TOKEN]]


@pytest.mark.parametrize("seed", range(10))
def test_verify_greedy_rows_equals_verify_greedy_tokens(seed):
    # The engine's host form against the tensor form (its reference), on batches where some
    # draft tokens match the target's and some do not, for K = 0 (plain decoding) to 4.
    gen = torch.Generator().manual_seed(seed)
    batch_size, vocab_size = 5, 6
    for max_k in range(5):
        target_tokens = torch.randint(0, vocab_size, (batch_size, max_k + 1), generator=gen)
        agree = torch.rand(batch_size, max_k, generator=gen) < 0.7
        draft_tokens = torch.where(agree, target_tokens[:, :max_k],
                                   (target_tokens[:, :max_k] + 1) % vocab_size)
        expected = verify_greedy_tokens(draft_tokens, target_tokens, vocab_size)
        num_accepted, output_tokens = verify_greedy_rows(draft_tokens.tolist(),
                                                         target_tokens.tolist(), vocab_size)
        assert num_accepted == expected.num_accepted.tolist()
        assert output_tokens == expected.output_tokens.tolist()


def test_verify_greedy_rows_example_and_errors():
    assert verify_greedy_rows([[7, 8, 9]], [[7, 5, 9, 2]], 10) == ([1], [[7, 5, PAD_TOKEN,
                                                                          PAD_TOKEN]])
    assert verify_greedy_rows([[7, 8]], [[7, 8, 2]], 10) == ([2], [[7, 8, 2]])  # bonus
    with pytest.raises(ShapeError):  # needs K+1 = 3 target tokens
        verify_greedy_rows([[1, 2]], [[1, 2]], 4)
    with pytest.raises(ShapeError):  # one target row per draft row
        verify_greedy_rows([[1], [2]], [[1, 2]], 4)
    with pytest.raises(TokenOutOfRangeError):
        verify_greedy_rows([[7]], [[1, 2]], 4)
    with pytest.raises(TokenOutOfRangeError):  # the target's tokens are range-checked too
        verify_greedy_rows([[1]], [[1, -1]], 4)
    with pytest.raises(ShapeError):
        verify_greedy_rows([[1]], [[1, 2]], 0)
