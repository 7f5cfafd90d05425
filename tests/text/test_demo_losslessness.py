"""Block verification keeps the target's law on the shipped demo pair (a real 8,192-token
vocabulary, the fast path): a G-test of the first two emitted tokens against the law
enumerated from the target's own forward, with a broken block rule rejected by the same test.

Top-k 6 at T = 1 keeps the law to 36 cells (enough samples per cell on a CPU); every sample
outside them is an impossible hit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import verispec.sample.block
from verispec import GenerationConfig, SamplingConfig
from verispec.sample.sampling import to_probs

from helpers_stats import first_two_in_runs, g_test

pytestmark = [pytest.mark.usefixtures("single_thread_torch"), pytest.mark.slow]

SAMPLING = SamplingConfig(temperature=1.0, top_k=6)
K = 2
NUM_SAMPLES = 2_000
CONTROL_SAMPLES = 500  # the control's impossible hits show at once
ROWS_PER_RUN = 500
P_THRESHOLD = 1e-3
CONTROL_P_THRESHOLD = 1e-6


@pytest.fixture(scope="module")
def prompt(demo_decoder) -> list[int]:
    return demo_decoder.tokenizer.encode("def fibonacci(n):\n    ")


@pytest.fixture(scope="module")
def law(demo_decoder, prompt) -> tuple[list[tuple[int, int]], np.ndarray]:
    """The (x1, x2) cells of the top-k law and their probabilities, from fresh forwards of
    the target's transformers model (no cache, no batching)."""
    model = demo_decoder.target.model
    with torch.inference_mode():
        first_logits = model(torch.tensor([prompt])).logits[0, -1]  # [V]
        first = to_probs(first_logits, SAMPLING).double()
        support = first.nonzero().squeeze(1).tolist()
        contexts = torch.tensor([prompt + [x1] for x1 in support])  # [S, T+1]
        second_logits = model(contexts).logits[:, -1]  # [S, V]
    _assert_clear_cut(torch.cat([first_logits[None], second_logits]))
    second = to_probs(second_logits, SAMPLING).double()
    cells, probs = [], []
    for row, x1 in enumerate(support):
        for x2 in second[row].nonzero().squeeze(1).tolist():
            cells.append((x1, x2))
            probs.append(float(first[x1] * second[row, x2]))
    return cells, np.array(probs)


def _assert_clear_cut(logits: torch.Tensor) -> None:
    """The top-k cut must be far from a tie: the cached, batched forward differs from the
    fresh one by float rounding (~1e-6), and a near-tie could move the support."""
    top = logits.float().topk(SAMPLING.top_k + 1, dim=-1).values
    margin = float((top[:, -2] - top[:, -1]).min())
    assert margin > 1e-4, f"the prompt's top-k cut is too close to a tie: margin {margin}"


def _first_two(demo_decoder, prompt, seed: int, num_samples: int = NUM_SAMPLES
               ) -> tuple[np.ndarray, float]:
    """Unseeded rows under the block rule -> (x1, x2) [N, 2], acceptance rate."""
    config = GenerationConfig(max_new_tokens=K + 1, num_draft_tokens=K, sampling=SAMPLING,
                              verification="block")
    return first_two_in_runs(demo_decoder.engine, prompt, config, seed, num_samples,
                             ROWS_PER_RUN)


def _g_test(tokens: np.ndarray, law: tuple[list[tuple[int, int]], np.ndarray]):
    """The G-test of the pairs against the law's cells, plus one cell of probability 0 that
    holds every pair outside them."""
    cells, probs = law
    index = {cell: i for i, cell in enumerate(cells)}
    observed = np.zeros(len(cells) + 1)
    for x1, x2 in tokens.tolist():
        observed[index.get((x1, x2), len(cells))] += 1
    return g_test(observed, np.append(probs / probs.sum(), 0.0))


def test_block_verification_keeps_the_target_law_on_the_demo_pair(demo_decoder, prompt, law):
    tokens, acceptance_rate = _first_two(demo_decoder, prompt, seed=4_100)
    result = _g_test(tokens, law)
    print(f"demo block: {result}, acceptance rate {acceptance_rate:.3f}")
    assert 0.2 < acceptance_rate < 0.98, acceptance_rate  # drafts kept and refused alike
    assert result.num_impossible_hits == 0 and result.dof >= 10, result
    assert result.p_value > P_THRESHOLD, result


def accept_the_whole_block(stop_probs, etas):
    """Wrong on purpose: every draft token of the block is kept."""
    return len(stop_probs) - 1


def test_the_demo_g_test_rejects_a_block_rule_that_keeps_everything(demo_decoder, prompt, law,
                                                                    monkeypatch):
    monkeypatch.setattr(verispec.sample.block, "_last_pass", accept_the_whole_block)
    tokens, acceptance_rate = _first_two(demo_decoder, prompt, seed=4_200,
                                         num_samples=CONTROL_SAMPLES)
    result = _g_test(tokens, law)
    print(f"demo block control: {result}, acceptance rate {acceptance_rate:.3f}")
    assert acceptance_rate == 1.0  # the injected bug is in effect
    assert result.p_value < CONTROL_P_THRESHOLD, result
