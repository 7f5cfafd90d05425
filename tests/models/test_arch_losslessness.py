"""Sampling losslessness where the attention is not plain causal: a window and ALiBi.

The law of the first two emitted tokens (as in tests/models/test_real_losslessness.py: NUM_SAMPLES
batched rows, the exact law P(x1, x2) enumerated from fresh forwards of the target, a pooled
G-test) on:
  * a Mistral target with a sliding window of WINDOW tokens whose prompt is already past the
    window, so every token is drawn from a windowed distribution;
  * a Bloom target (ALiBi built from the attention mask).
Negative controls, which the same harness must reject: for the window, the same generation with
the window dropped from verispec's masks (the bug this adapter had: attending over the whole
cache); for ALiBi, a verification that accepts every draft token.

Legend: N samples, V vocabulary.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec import Engine, SamplingConfig
from verispec.models.hf.adapter import TransformersLM
from verispec.models.hf.masks import MaskPlan
from verispec.sample.sampling import to_probs

from arch_specs import Arch
from helpers_stats import g_test, pair_counts
from injected_rules import accept_every_draft_token, inject_verify
from real_law import first_two_tokens as real_first_two_tokens

pytestmark = [pytest.mark.usefixtures("single_thread_torch"), pytest.mark.slow]

VOCAB_SIZE = 24
WINDOW = 4
PROMPT = [3, 17, 5, 9, 20, 1, 14, 7, 22, 11]  # 10 tokens: past the window before decoding starts
SAMPLING = SamplingConfig(temperature=1.0)
K = 3
P_THRESHOLD = 1e-3
CONTROL_P_THRESHOLD = 1e-6

# (architecture, output-layer scale): random init gives near-uniform logits, the scale makes
# them peaky; Bloom's larger init makes its second layer matter (acceptance well below 1)
ARCHS = {
    "sliding-window": (Arch("Mistral", "mistral", "", dict(sliding_window=WINDOW)), 40.0),
    "alibi": (Arch("Bloom", "bloom", "", dict(n_layer=2, n_head=4, initializer_range=0.08)), 8.0),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def pair(request):
    arch, head_scale = ARCHS[request.param]
    target, draft = arch.build_pair(vocab_size=VOCAB_SIZE)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(head_scale)
        draft.get_output_embeddings().weight.copy_(target.get_output_embeddings().weight)
    return request.param, target, draft


def exact_first_two_law(model) -> np.ndarray:
    """P(x1, x2) by enumeration over x1, from fresh forwards of the model. -> [V, V] float64."""
    contexts = torch.tensor([PROMPT + [x1] for x1 in range(VOCAB_SIZE)])  # [V, T+1]
    with torch.inference_mode():
        first = model(torch.tensor([PROMPT])).logits[0, -1, :VOCAB_SIZE]  # [V]
        second = model(contexts).logits[:, -1, :VOCAB_SIZE]  # [V, V]: x1 -> logits of x2
    law = to_probs(first, SAMPLING).double()[:, None] * to_probs(second, SAMPLING).double()
    return law.numpy()


def first_two_tokens(engine: Engine, seed: int, verification: str = "block"
                     ) -> tuple[np.ndarray, float]:
    """NUM_SAMPLES batched copies of PROMPT -> tokens [N, 2], acceptance."""
    return real_first_two_tokens(engine, SAMPLING, K, seed, PROMPT, verification)


def engine_for(target, draft) -> Engine:
    return Engine.from_draft_model(TransformersLM(target), TransformersLM(draft))


def test_first_two_tokens_follow_target_law(pair):
    name, target, draft = pair
    law = exact_first_two_law(target)
    tokens, acceptance_rate = first_two_tokens(engine_for(target, draft), seed=5)
    result = g_test(pair_counts(tokens, 0, VOCAB_SIZE), law)
    print(f"{name}: {result}, acceptance rate {acceptance_rate:.3f}")
    assert 0.1 < acceptance_rate < 0.95, acceptance_rate  # both verification paths ran
    assert result.num_impossible_hits == 0, result
    assert result.p_value > P_THRESHOLD, f"{name}: {result}"


def test_negative_control_is_rejected(pair, monkeypatch):
    name, target, draft = pair
    law = exact_first_two_law(target)
    engine = engine_for(target, draft)
    if name == "sliding-window":  # the old bug: every layer attends over the whole cache
        for lm in (engine.target, engine.proposer.model):
            assert lm.mask_plan.layer_types == ("sliding_attention",)
            lm.mask_plan = MaskPlan(("full_attention",), per_layer_type=False)
    else:
        inject_verify(monkeypatch, accept_every_draft_token)  # the token-wise rule's entry
    tokens, acceptance_rate = first_two_tokens(engine, seed=99, verification="token")
    result = g_test(pair_counts(tokens, 0, VOCAB_SIZE), law)
    print(f"{name} control: {result}, acceptance rate {acceptance_rate:.3f}")
    assert result.p_value < CONTROL_P_THRESHOLD, result
