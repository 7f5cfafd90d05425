"""Sampling losslessness on real transformers models: the law of the first two emitted tokens.

The statistical tests in tests/engine/test_losslessness.py use fixture LMs with closed-form laws;
this one runs the whole stack on a real LlamaForCausalLM target and a smaller real Llama draft (the
target's first layer, embeddings and head: clearly different distributions, acceptance ~0.6), over a
24-token vocabulary, on the CPU and (marked gpu) on CUDA. One batched generation of NUM_SAMPLES
identical prompts (the adapter runs all rows in one forward per step) gives NUM_SAMPLES i.i.d. draws
of (x1, x2); the exact law P(x1, x2) = P(x1 | prompt) P(x2 | prompt + [x1]) is enumerated from the
target alone with verispec.sample.sampling.to_probs and the same SamplingConfig, and compared with a
pooled G-test (tests/helpers/helpers_stats.py). A negative control swaps in a verification that
accepts every draft token; the same harness must reject it.

Why max_new_tokens = k + 1 and not 2: the engine never drafts past max_new_tokens (it uses
k' = min(k, remaining - 1)), so with max_new_tokens = 2 every k would run as k = 1. With k + 1
the first round really drafts k tokens, and both emitted tokens we test can come from accepted
draft positions 1 and 2, a recovered token, or a bonus. Generation stops as soon as every row
has 2 tokens.

Legend: N samples, V vocabulary, K draft tokens.
"""

from __future__ import annotations

import pytest
import torch

import verispec.sample.block
from verispec import Engine, SamplingConfig
from verispec.models.hf.adapter import TransformersLM

from helpers_stats import g_test, pair_counts
from injected_rules import accept_every_draft_token, inject_verify
from real_law import (
    CONTROL_P_THRESHOLD,
    LM_HEAD_SCALE,
    P_THRESHOLD,
    PROMPT,
    VOCAB_SIZE,
    exact_first_two_law,
    first_two_tokens,
    next_token_logits,
    truncation_margin,
)
from tiny_models import layer_dropped_draft, untied_llama

pytestmark = [pytest.mark.usefixtures("single_thread_torch"), pytest.mark.slow]

# the whole stack on each device; on CUDA the 20k-row batch takes verification's tensor path
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.fixture(scope="module", params=DEVICES)
def models(request):
    target = untied_llama(VOCAB_SIZE, seed=11, hidden=32, layers=2, max_positions=64)
    with torch.no_grad():
        target.lm_head.weight.mul_(LM_HEAD_SCALE)
    draft = layer_dropped_draft(target, num_layers=1)
    return target.to(request.param), draft.to(request.param)


@pytest.fixture(scope="module")
def engine(models):
    target, draft = models
    return Engine.from_draft_model(TransformersLM(target), TransformersLM(draft))


CASES = {  # sampling, k, verification rule
    "t1-k2": (SamplingConfig(temperature=1.0), 2, "block"),
    "t1-k4": (SamplingConfig(temperature=1.0), 4, "token"),
    "t1-k4-block": (SamplingConfig(temperature=1.0), 4, "block"),
    "topk5-k4": (SamplingConfig(temperature=1.0, top_k=5), 4, "block"),
    "topp08-k2": (SamplingConfig(temperature=1.0, top_p=0.8), 2, "token"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_first_two_tokens_follow_target_law(models, engine, case):
    sampling, k, verification = CASES[case]
    target, _ = models
    first_logits, second_logits = next_token_logits(target, PROMPT)
    margin = truncation_margin(torch.cat([first_logits[None], second_logits]), sampling)
    assert margin > 1e-4, f"fixture too close to a top-k/top-p tie: margin {margin}"
    law = exact_first_two_law(target, sampling)
    tokens, acceptance_rate = first_two_tokens(engine, sampling, k, seed=sum(map(ord, case)),
                                               verification=verification)
    result = g_test(pair_counts(tokens, 0, VOCAB_SIZE), law)
    print(f"{case}: {result}, acceptance rate {acceptance_rate:.3f}")
    # the pair is a meaningful test: drafts are often accepted and often rejected
    assert 0.2 < acceptance_rate < 0.95, acceptance_rate
    assert result.num_impossible_hits == 0, result
    assert result.p_value > P_THRESHOLD, f"{case}: {result}"


def test_negative_control_wrong_verification_is_detected(models, engine, monkeypatch):
    sampling, k = SamplingConfig(temperature=1.0), 2
    target, _ = models
    law = exact_first_two_law(target, sampling)
    inject_verify(monkeypatch, accept_every_draft_token)  # the token-wise rule's entry
    tokens, acceptance_rate = first_two_tokens(engine, sampling, k, seed=99,
                                               verification="token")
    result = g_test(pair_counts(tokens, 0, VOCAB_SIZE), law)
    print(f"control: {result}, acceptance rate {acceptance_rate:.3f}")
    assert acceptance_rate == 1.0  # the injected bug is in effect
    assert result.p_value < CONTROL_P_THRESHOLD, result


def first_failure_stop(stop_probs, etas):
    """Wrong on purpose: block verification's tau taken as the prefix before the first
    position whose test fails (the token-wise habit), not the last position that passes."""
    for i in range(1, len(stop_probs)):
        if not etas[i - 1] < stop_probs[i]:
            return i - 1
    return len(stop_probs) - 1


def test_negative_control_block_rule_stopping_at_the_first_failure_is_detected(
        models, engine, monkeypatch):
    sampling, k = SamplingConfig(temperature=1.0), 4
    target, _ = models
    law = exact_first_two_law(target, sampling)
    monkeypatch.setattr(verispec.sample.block, "_last_pass", first_failure_stop)
    tokens, acceptance_rate = first_two_tokens(engine, sampling, k, seed=98)
    result = g_test(pair_counts(tokens, 0, VOCAB_SIZE), law)
    print(f"block control: {result}, acceptance rate {acceptance_rate:.3f}")
    assert result.p_value < CONTROL_P_THRESHOLD, result
