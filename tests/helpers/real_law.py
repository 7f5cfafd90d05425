"""The law of the first two tokens on a real transformers pair: its settings and its checks.

The real-model law tests (tests/models: test_real_losslessness.py, test_arch_losslessness.py,
test_llama_cpp.py, test_gpu.py) generate NUM_SAMPLES copies of PROMPT over a VOCAB_SIZE-token
model whose head is scaled by LM_HEAD_SCALE, and compare (x1, x2) with the law enumerated from
the target's own fresh forwards (exact_first_two_law) at P_THRESHOLD; a broken rule must fall
below CONTROL_P_THRESHOLD. truncation_margin guards top-k / top-p cuts near a tie.

Legend: N samples, V vocabulary, K draft tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from verispec import Engine, GenerationConfig, SamplingConfig
from verispec.sample.sampling import make_generator, to_probs

VOCAB_SIZE = 24
PROMPT = [3, 17, 5]
NUM_SAMPLES = 20_000
LM_HEAD_SCALE = 40.0  # random init gives near-uniform logits; this makes them peaky
P_THRESHOLD = 1e-3
CONTROL_P_THRESHOLD = 1e-6


def next_token_logits(model, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh forwards: logits after the prompt [V] and after prompt + [x1] for every x1 [V, V]."""
    contexts = torch.tensor([prompt + [x1] for x1 in range(VOCAB_SIZE)])  # [V, T+1]
    with torch.inference_mode():
        first = model(torch.tensor([prompt], device=model.device)).logits[0, -1]  # [V]
        second = model(contexts.to(model.device)).logits[:, -1]  # [V, V]: x1 -> logits of x2
    return first.cpu(), second.cpu()


def exact_first_two_law(model, sampling: SamplingConfig) -> np.ndarray:
    """P(x1, x2) by enumeration over x1, from the model's own distributions. -> [V, V] float64."""
    first_logits, second_logits = next_token_logits(model, PROMPT)
    first = to_probs(first_logits, sampling).double()  # [V]
    second = to_probs(second_logits, sampling).double()  # [V, V]
    return (first[:, None] * second).numpy()


def truncation_margin(logits: torch.Tensor, sampling: SamplingConfig) -> float:
    """How far the top-k / top-p cut is from a tie, over rows of logits [R, V].

    The engine's batched cached forward and the fresh forward here differ by float rounding
    (~1e-6); a cut that close to a tie could change the support and fail the test spuriously.
    """
    margins = [float("inf")]
    scaled = logits.float() / sampling.temperature
    if sampling.top_k is not None:
        top = scaled.topk(sampling.top_k + 1, dim=-1).values
        margins.append(float((top[:, -2] - top[:, -1]).min()))
    if sampling.top_p is not None:
        probs = torch.softmax(scaled, dim=-1).sort(dim=-1, descending=True).values
        mass_before = probs.cumsum(-1) - probs
        margins.append(float((mass_before - sampling.top_p).abs().min()))
    return min(margins)


def first_two_tokens(engine: Engine, sampling: SamplingConfig, k: int,
                     seed: int, prompt: list[int] = PROMPT, verification: str = "block"
                     ) -> tuple[np.ndarray, float]:
    """One batched generation of NUM_SAMPLES copies of prompt -> tokens [N, 2], acceptance.
    Unseeded rows (rejection sampling under ``verification``) from a generator seeded here."""
    config = GenerationConfig(max_new_tokens=k + 1, num_draft_tokens=k, sampling=sampling,
                              verification=verification)
    run = engine.stream([prompt] * NUM_SAMPLES, config, generator=make_generator(seed))
    for _ in run:
        if min(map(len, run.token_ids)) >= 2:
            break
    tokens = np.array([row[:2] for row in run.token_ids])  # [N, 2]
    return tokens, run.metrics.acceptance_rate
