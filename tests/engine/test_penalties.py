"""Penalties and logit bias keep the penalised target's law exactly under speculation.

G-tests of the joint law of the first two tokens (both inside one verified block) against the
law enumerated from the penalised / biased target, whose second token's penalty counts the
first; negative controls that shape each position of a block from the committed tokens only
(ignoring the block's earlier draft tokens, as SGLang's penalizers do) must be rejected by the
same test. Greedy: speculative == plain token for token with penalties on fixture chains, and
logprobs under speculation equal plain decoding's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import verispec.engine.batch
import verispec.engine.rows
from verispec import Engine, GenerationConfig, MarkovLM, PenaltyConfig, SamplingConfig
from verispec.proposers import DraftModelProposer
from verispec.sample.penalties import process_logits, seen_tokens
from verispec.sample.sampling import make_generator, to_probs

from helpers_stats import g_test, pair_counts
from markov_chains import PROMPTS, _noisy_draft, _target

VOCAB_SIZE = 8
PROMPT = [3, 5]
NUM_SAMPLES = 20_000
ALPHA = 1e-3
CONTROL_ALPHA = 1e-6
SAMPLING = SamplingConfig(temperature=1.0)
PENALTY = PenaltyConfig(frequency_penalty=2.0, presence_penalty=0.5)
BIAS = PenaltyConfig(logit_bias=((0, 2.5), (1, -1.0), (6, 1.5)))


def _chain() -> MarkovLM:
    return MarkovLM.random(VOCAB_SIZE, make_generator(71), order=1, sharpness=1.0)


def _processed_probs(model, context: list[int], output: list[int], penalty) -> np.ndarray:
    logits = model.next_logits(context)[None]  # [1, V]
    processed = process_logits(logits, penalty, seen_tokens(PROMPT, VOCAB_SIZE), output)
    return to_probs(processed[0], SAMPLING).double().numpy()


def _law(model, penalty) -> np.ndarray:
    """P(x1, x2) of the penalised target: x2's penalty counts x1."""
    first = _processed_probs(model, PROMPT, [], penalty)
    law = np.zeros((VOCAB_SIZE, VOCAB_SIZE))
    for x1 in range(VOCAB_SIZE):
        law[x1] = first[x1] * _processed_probs(model, PROMPT + [x1], [x1], penalty)
    return law


def _first_two(target, draft, penalty, k: int, seed: int) -> tuple[np.ndarray, float]:
    config = GenerationConfig(max_new_tokens=k + 1, num_draft_tokens=k, sampling=SAMPLING,
                              penalty=penalty)
    result = Engine(target, DraftModelProposer(draft)).generate(
        [PROMPT] * NUM_SAMPLES, config, generator=make_generator(seed))
    return np.array(result.token_ids)[:, :2], result.metrics.acceptance_rate


def _committed_only(rows, target_logits, draft_tokens, num_draft, faults):
    """The control: every position of a block processed from the committed tokens alone."""
    processed = target_logits.float().clone()
    for b, row in enumerate(rows):
        for j in range(num_draft[b] + 1):
            processed[b, j] = process_logits(target_logits[b, j : j + 1], row.config.penalty,
                                        None, row.token_ids)[0]
    return processed


@pytest.mark.parametrize("penalty", [PENALTY, BIAS], ids=["penalty", "bias"])
@pytest.mark.parametrize("draft_kind", ["same_chain", "noisy"])
@pytest.mark.parametrize("k", [1, 3])
def test_first_two_tokens_follow_the_penalised_law(penalty, draft_kind, k):
    target = _chain()
    draft = target if draft_kind == "same_chain" else _noisy_draft(target, seed=5)
    tokens, acceptance = _first_two(target, draft, penalty, k, seed=900 + k)
    result = g_test(pair_counts(tokens, 0, VOCAB_SIZE), _law(target, penalty))
    print(f"PVALUE penalties {draft_kind} k={k}: {result} acceptance {acceptance:.3f}")
    assert result.p_value > ALPHA, result
    if draft_kind == "same_chain":  # the draft processes its steps as the target: all accepted
        assert acceptance > 0.99


@pytest.mark.parametrize("penalty", [PENALTY, BIAS], ids=["penalty", "bias"])
def test_control_ignoring_draft_tokens_inside_the_block_is_rejected(monkeypatch, penalty):
    if penalty is BIAS:  # a bias has no history: the control drops it past the block's start
        def control(rows, target_logits, draft_tokens, num_draft, faults):
            processed = target_logits.float().clone()
            for b, row in enumerate(rows):
                processed[b, :1] = row.process_logits(target_logits[b, :1])
            return processed
    else:
        control = _committed_only
    monkeypatch.setattr(verispec.engine.batch, "process_target_logits", control)
    target = _chain()
    tokens, _ = _first_two(target, target, penalty, 2, seed=950)
    result = g_test(pair_counts(tokens, 0, VOCAB_SIZE), _law(target, penalty))
    print(f"PVALUE control penalties: {result}")
    assert result.p_value < CONTROL_ALPHA, result


GREEDY_PENALTIES = [
    PenaltyConfig(frequency_penalty=1.5),
    PenaltyConfig(presence_penalty=2.0),
    PenaltyConfig(repetition_penalty=1.8),
    PenaltyConfig(logit_bias=((2, 3.0), (4, -2.0))),
    PenaltyConfig(frequency_penalty=-0.5, repetition_penalty=0.8, logit_bias=((1, 1.0),)),
]


def _plain_greedy_shaped(model, prompt: list[int], num_new: int, penalty) -> list[int]:
    context, output = list(prompt), []
    seen = seen_tokens(prompt, model.vocab_size)
    for _ in range(num_new):
        processed = process_logits(model.next_logits(context)[None], penalty, seen, output)
        token = int(processed[0].argmax())
        context.append(token)
        output.append(token)
    return output


@pytest.mark.parametrize("penalty", GREEDY_PENALTIES)
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_with_penalties_equals_plain_decoding(penalty, k):
    target = _target()
    decoder = Engine.from_draft_model(target, _noisy_draft(target))
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=k,
                              sampling=SamplingConfig(temperature=0), penalty=penalty)
    result = decoder.generate(PROMPTS, config)  # a batch of 3
    for prompt, tokens in zip(PROMPTS, result.token_ids):
        assert tokens == _plain_greedy_shaped(target, prompt, 24, penalty)
    alone = decoder.generate([PROMPTS[0]], config)
    assert alone.token_ids[0] == result.token_ids[0]


def test_penalty_changes_the_greedy_output():
    """The checks above can fail: the penalised greedy path differs from the unpenalised one."""
    target = _target()
    plain = _plain_greedy_shaped(target, PROMPTS[0], 24, PenaltyConfig())
    assert plain != _plain_greedy_shaped(target, PROMPTS[0], 24, GREEDY_PENALTIES[0])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_under_speculation_equal_plain_decoding(temperature):
    target = _target()
    decoder = Engine.from_draft_model(target, _noisy_draft(target))
    config = GenerationConfig(max_new_tokens=16, num_draft_tokens=4, seed=11, logprobs=3,
                              sampling=SamplingConfig(temperature=temperature),
                              penalty=PENALTY)
    speculative = decoder.stream([PROMPTS[0]], config)
    for _ in speculative:
        pass
    plain = Engine(target).stream([PROMPTS[0]], config)
    for _ in plain:
        pass
    spec_row, plain_row = speculative.rows[0], plain.rows[0]
    assert spec_row.token_ids == plain_row.token_ids
    assert len(spec_row.logprobs) == len(spec_row.token_ids) == 16
    for a, b in zip(spec_row.logprobs, plain_row.logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-5
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.logprob <= 0 and len(a.top) == 3 and a.top[0][1] >= a.logprob
    # the chosen token's logprob is the processed distribution's, checked at position 0
    logits = process_logits(target.next_logits(PROMPTS[0])[None], PENALTY, None, [])
    expected = torch.log_softmax(logits[0] / (temperature or 1.0), dim=-1)
    first = spec_row.logprobs[0]
    assert abs(first.logprob - float(expected[first.token_id])) < 1e-5


def test_draft_bans_the_stop_tokens_min_new_tokens_bans():
    """A draft equal to the target, with a likely stop token banned for 6 tokens: the draft
    processes its steps as the target does, so nothing it proposes is rejected (an unprocessed draft
    proposes the stop token, which the target rejects)."""
    target = _chain()
    stop = int(target.next_logits(PROMPT).argmax())
    config = GenerationConfig(max_new_tokens=6, num_draft_tokens=5, sampling=SAMPLING,
                              stop_token_ids=(stop,), min_new_tokens=6)
    result = Engine(target, DraftModelProposer(target)).generate(
        [PROMPT] * 200, config, generator=make_generator(3))
    assert all(stop not in tokens for tokens in result.token_ids)
    assert result.metrics.acceptance_rate == 1.0


def test_stop_token_ban_alone_leaves_the_draft_logits_untouched():
    """With no penalty the processed logits may be the model's own tensor (an inference tensor
    on the server): the ban must not write into it."""
    target = _chain()
    row = verispec.engine.rows.Row(PROMPT, GenerationConfig(
        max_new_tokens=4, stop_token_ids=(2,), min_new_tokens=3), make_generator(0))
    with torch.inference_mode():
        logits = target.next_logits(PROMPT)
    processed = row.process_draft(logits, [])
    assert processed[2] == float("-inf") and logits[2] != float("-inf")
