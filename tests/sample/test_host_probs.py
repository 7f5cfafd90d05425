"""sample/host_probs.py: to_probs on the CPU, row by row on the calling thread, against the
tensor path (sampling._device_probs) and the whole-row top-p sort (helpers/top_p_reference).

Legend: R rows, V vocabulary.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec import NonFiniteError, SamplingConfig
from verispec.sample.host_probs import _kept_from, top_p_kept
from verispec.sample.sampling import _device_probs, _masked, greedy_tokens, make_generator, to_probs

from top_p_reference import reference_renormalised, reference_top_p_kept

pytestmark = pytest.mark.usefixtures("single_thread_torch")

VOCAB = 4096


def _rows(scenario: str, seed: int, num_rows: int = 3, vocab: int = VOCAB) -> torch.Tensor:
    """Logits [R, V] fp32 of one kind."""
    gen = make_generator(seed)
    if scenario == "random":
        return torch.randn(num_rows, vocab, generator=gen) * 3.0
    if scenario == "ties":  # a handful of values: ties everywhere, the top-p cut among them
        return torch.randint(0, 6, (num_rows, vocab), generator=gen).float()
    if scenario == "bias":  # a logit_bias of +-100 on a few tokens
        logits = torch.randn(num_rows, vocab, generator=gen) * 2.0
        logits[:, 5], logits[:, 9], logits[:, 11] = 100.0, 100.0, -100.0
        return logits
    if scenario == "masked":  # tokens a grammar or min_new_tokens masked out
        logits = torch.randn(num_rows, vocab, generator=gen) * 3.0
        return logits.masked_fill(torch.rand(num_rows, vocab, generator=gen) < 0.3, -torch.inf)
    if scenario == "flat":  # one value: every token ties
        return torch.zeros(num_rows, vocab)
    assert scenario == "peaked"  # most probabilities underflow fp32 at a low temperature
    return torch.randn(num_rows, vocab, generator=gen) * 20.0


SCENARIOS = ["random", "ties", "bias", "masked", "flat", "peaked"]
# settings whose probabilities involve no renormalising sum: the tensor path's, bit for bit
UNSUMMED = [SamplingConfig(temperature=0.7), SamplingConfig(temperature=1.0),
            SamplingConfig(temperature=0.01), SamplingConfig(temperature=1e-30),
            SamplingConfig(temperature=1e-40), SamplingConfig(temperature=0.7, top_k=1),
            SamplingConfig(temperature=1.3, top_k=40)]


@pytest.mark.parametrize("sampling", UNSUMMED, ids=lambda s: f"T{s.temperature}-k{s.top_k}")
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_host_probs_are_the_tensor_paths_bit_for_bit(scenario, sampling):
    logits = _rows(scenario, 1)
    assert torch.equal(to_probs(logits, sampling), _device_probs(logits, sampling))


def test_host_probs_take_a_grammar_mask_half_precision_and_leading_dims():
    logits = _rows("random", 2, num_rows=6).reshape(2, 3, VOCAB)  # [B, K+1, V]
    allowed = torch.rand(logits.shape, generator=make_generator(3)) < 0.5
    sampling = SamplingConfig(temperature=0.7, top_k=40)
    expected = _device_probs(_masked(logits, allowed), sampling)
    assert torch.equal(to_probs(logits, sampling, allowed), expected)
    half = logits.half()
    assert torch.equal(to_probs(half, sampling), _device_probs(half.float(), sampling))


def test_negative_control_a_reciprocal_temperature_is_not_the_same_bits():
    # the bit-for-bit comparison resolves one rounding: multiplying by 1 / T instead of
    # dividing by T (equal in exact arithmetic) already gives other probabilities
    logits = _rows("random", 4)
    shifted = logits - logits.amax(-1, keepdim=True)
    by_reciprocal = torch.softmax(shifted * (1.0 / 0.7), dim=-1)
    assert not torch.equal(to_probs(logits, SamplingConfig(temperature=0.7)), by_reciprocal)


TOP_PS = [0.9, 0.5, 1e-9, 1e-300, 0.999, 0.99995]  # 0.99995 leaves no room for candidates


@pytest.mark.parametrize("top_p", TOP_PS)
@pytest.mark.parametrize("temperature", [0.7, 0.01, 1.0])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_top_p_keeps_what_a_stable_sort_of_the_whole_row_keeps(scenario, temperature, top_p):
    logits = _rows(scenario, 5)
    softmax = to_probs(logits, SamplingConfig(temperature=temperature))  # before truncation
    probs = to_probs(logits, SamplingConfig(temperature=temperature, top_p=top_p))
    for row in range(logits.shape[0]):
        kept = reference_top_p_kept(softmax[row], top_p)
        assert top_p_kept(softmax[row].numpy(), top_p).tolist() == kept
        assert torch.equal(probs[row], reference_renormalised(softmax[row], kept))


def test_top_p_at_the_vocabulary_of_the_coder_pair():
    logits = _rows("random", 6, num_rows=2, vocab=151_936) * 2.0
    for top_p in (0.9, 0.95):
        softmax = to_probs(logits, SamplingConfig(temperature=0.7))
        for row in softmax:
            assert top_p_kept(row.numpy(), top_p).tolist() == reference_top_p_kept(row, top_p)


def test_top_p_renormalises_as_the_reference_at_the_vocabulary_of_the_coder_pair():
    logits = _rows("random", 9, num_rows=2, vocab=151_936) * 2.0
    softmax = to_probs(logits, SamplingConfig(temperature=0.7))
    probs = to_probs(logits, SamplingConfig(temperature=0.7, top_p=0.95, min_p=0.02))
    for row in range(2):
        after_top_p = reference_renormalised(
            softmax[row], reference_top_p_kept(softmax[row], 0.95))
        floor = np.float32(0.02) * after_top_p.max().numpy()
        kept = (after_top_p >= torch.from_numpy(np.asarray(floor))).nonzero().reshape(-1)
        assert torch.equal(probs[row], reference_renormalised(after_top_p, kept.tolist()))


@pytest.mark.parametrize("vocab", [VOCAB, 151_936], ids=["all-rows", "row-by-row"])
def test_a_rows_probabilities_do_not_depend_on_the_rows_beside_it(monkeypatch, vocab):
    # a small vocabulary goes through the all-rows path, a large one row by row; either way a
    # row's bits are those it gets alone, and those of the other path
    import verispec.sample.host_probs as host

    logits = _rows("ties", 10, num_rows=4, vocab=vocab) + _rows("random", 11, 4, vocab) * 0.01
    sampling = SamplingConfig(temperature=0.7, top_k=vocab // 2, top_p=0.9, min_p=0.01)
    together = to_probs(logits, sampling)
    for row in range(4):
        assert torch.equal(to_probs(logits[row:row + 1], sampling)[0], together[row])
    monkeypatch.setattr(host, "_SMALL_VOCAB", 0 if vocab <= host._SMALL_VOCAB else 10**6)
    assert torch.equal(to_probs(logits, sampling), together)


def test_negative_control_a_sum_in_fp32_is_not_the_same_bits():
    # the bit comparisons above resolve the renormalising sum's precision: the same kept values
    # summed in fp32, in the same order, give other probabilities on some rows
    softmax = to_probs(_rows("random", 12, num_rows=64), SamplingConfig(temperature=3.0))
    differ = 0
    for row in softmax:
        kept = reference_top_p_kept(row, 0.99)
        values = row[kept].numpy()
        in_fp32 = values / np.cumsum(values, dtype=np.float32)[-1]
        differ += not np.array_equal(in_fp32, reference_renormalised(row, kept)[kept].numpy())
    assert differ > 0


def test_ties_at_the_top_p_cut_go_to_the_lowest_ids():
    # ten tokens of 0.1: mass before each in id order 0, 0.1, 0.2, 0.3 (< 0.35), 0.4
    probs = to_probs(torch.zeros(10), SamplingConfig(top_p=0.35))
    assert (probs > 0).nonzero().reshape(-1).tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(probs[:4], torch.full((4,), 0.25), rtol=0, atol=1e-7)


def test_top_p_and_top_k_and_min_p_combine_as_the_reference_does():
    logits = _rows("bias", 7)
    sampling = SamplingConfig(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05)
    top_k_only = to_probs(logits, SamplingConfig(temperature=0.7, top_k=40))
    probs = to_probs(logits, sampling)
    for row in range(logits.shape[0]):
        after_top_p = reference_renormalised(
            top_k_only[row], reference_top_p_kept(top_k_only[row], 0.95))
        floor = np.float32(0.05) * after_top_p.max().numpy()
        kept = (after_top_p >= torch.from_numpy(np.asarray(floor))).nonzero().reshape(-1)
        assert torch.equal(probs[row], reference_renormalised(after_top_p, kept.tolist()))


def test_negative_control_candidates_short_of_the_cut_are_refused_not_trusted():
    # the cut of top_p = 0.9 lies past the 3 most likely tokens: deciding from them alone (as
    # if complete) keeps a wrong set; the candidate form refuses them (None) and sorts more
    softmax = to_probs(_rows("random", 8, num_rows=1)[0], SamplingConfig(temperature=1.0))
    row, limit = softmax.numpy(), np.float32(0.9)
    head = np.sort(np.argsort(-row, kind="stable")[:3])
    kept = reference_top_p_kept(softmax, 0.9)
    assert len(kept) > 3
    assert _kept_from(row, head, limit, complete=False) is None
    assert _kept_from(row, head, limit, complete=True).tolist() != kept
    assert top_p_kept(row, 0.9).tolist() == kept


def test_host_probs_refuse_rows_that_are_not_finite():
    sampling = SamplingConfig(temperature=0.7, top_p=0.9)
    for bad in (float("nan"), float("inf")):
        logits = _rows("random", 9)
        logits[1, 17] = bad
        with pytest.raises(NonFiniteError):
            to_probs(logits, sampling)
    with pytest.raises(NonFiniteError):
        to_probs(torch.full((2, VOCAB), -torch.inf), sampling)
    allowed = torch.zeros(2, VOCAB, dtype=torch.bool)  # a grammar allowing nothing
    with pytest.raises(NonFiniteError):
        to_probs(_rows("random", 9, num_rows=2), sampling, allowed)


def test_greedy_tokens_keep_the_logits_precision():
    # 1 + 1e-12 exceeds 1 in float64 and equals it in fp32: a host path that converted to fp32
    # would take id 0 (the lower of a tie); the largest logit is id 1
    logits = torch.tensor([[1.0, 1.0 + 1e-12, 0.5]], dtype=torch.float64)
    assert torch.tensor([[1.0, 1.0 + 1e-12]]).float().unique().numel() == 1
    assert greedy_tokens(logits).tolist() == [1] == logits.max(-1).indices.tolist()
    ties = _rows("ties", 10)
    assert torch.equal(greedy_tokens(ties), ties.max(-1).indices)
