"""Statistics shared by the tests: exact laws by enumeration and a pooled G-test.

Not a test module (no test_ prefix). Everything here is deterministic and works in float64.

Legend: N samples, V vocabulary.

Exact law of generated text. The fixtures (verispec.models.fixtures) condition on at most the last
two tokens, so the law of the pair (x_{n-1}, x_n) of emitted tokens follows from a forward pass
over pair states: law_n[b, c] = sum_a law_{n-1}[a, b] * P(c | ..., a, b). For n = 2 this is the
textbook P(x1, x2) = P(x1 | prompt) * P(x2 | prompt + [x1]), which :func:`first_two_law` computes
directly; a test checks the two agree.

G-test (log-likelihood ratio test of goodness of fit). G = 2 sum_i O_i ln(O_i / E_i) is
asymptotically chi-square with (cells - 1) degrees of freedom when every expected count is large
enough. Cells are prepared so that stays valid:
  * a cell of probability exactly 0 cannot receive a sample from a correct sampler: one observed
    there makes the law certainly wrong (p-value 0); otherwise it is left out (it carries no
    information and would only inflate the degrees of freedom);
  * cells with expected count < MIN_EXPECTED are pooled into one cell; if that pool itself is
    still below MIN_EXPECTED it is merged into the smallest remaining cell.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

from verispec import SamplingConfig
from verispec.sample.sampling import to_probs

MIN_EXPECTED = 5.0  # the usual rule of thumb for the chi-square approximation


@dataclass(frozen=True)
class GTestResult:
    p_value: float
    statistic: float
    dof: int
    num_cells: int  # cells after pooling
    num_impossible_hits: int  # samples that landed on a probability-0 cell

    def __str__(self) -> str:
        return (f"G={self.statistic:.2f}, dof={self.dof}, p={self.p_value:.3g}, "
                f"impossible hits={self.num_impossible_hits}")


def g_test(observed: np.ndarray, expected_probs: np.ndarray) -> GTestResult:
    """Goodness of fit of counts ``observed`` to the law ``expected_probs`` (same shape, any)."""
    observed = np.asarray(observed, dtype=np.float64).reshape(-1)
    probs = np.asarray(expected_probs, dtype=np.float64).reshape(-1)
    assert observed.shape == probs.shape, (observed.shape, probs.shape)
    assert np.all(probs >= 0) and abs(probs.sum() - 1.0) < 1e-5, probs.sum()
    probs = probs / probs.sum()
    num_samples = observed.sum()
    assert num_samples > 0

    impossible = probs == 0
    impossible_hits = int(observed[impossible].sum())
    if impossible_hits:
        return GTestResult(0.0, float("inf"), -1, 0, impossible_hits)

    obs, exp = observed[~impossible], probs[~impossible] * num_samples
    rare = exp < MIN_EXPECTED
    cells_obs, cells_exp = list(obs[~rare]), list(exp[~rare])
    if rare.any():
        pool_obs, pool_exp = obs[rare].sum(), exp[rare].sum()
        if pool_exp >= MIN_EXPECTED or not cells_exp:
            cells_obs.append(pool_obs)
            cells_exp.append(pool_exp)
        else:  # merge the small pool into the smallest regular cell
            smallest = int(np.argmin(cells_exp))
            cells_obs[smallest] += pool_obs
            cells_exp[smallest] += pool_exp
    cells_obs_arr, cells_exp_arr = np.array(cells_obs), np.array(cells_exp)
    dof = len(cells_exp_arr) - 1
    if dof == 0:  # a single possible outcome, and every sample had it
        return GTestResult(1.0, 0.0, 0, 1, 0)
    seen = cells_obs_arr > 0
    statistic = 2.0 * float(np.sum(cells_obs_arr[seen] * np.log(cells_obs_arr[seen]
                                                                / cells_exp_arr[seen])))
    return GTestResult(float(stats.chi2.sf(statistic, dof)), statistic, dof,
                       len(cells_exp_arr), 0)


def next_token_probs(model, context: Sequence[int], sampling: SamplingConfig) -> np.ndarray:
    """The exact distribution [V] (float64) the target samples from after ``context``."""
    return to_probs(model.next_logits(list(context)), sampling).double().numpy()


def first_two_law(model, prompt: Sequence[int], sampling: SamplingConfig) -> np.ndarray:
    """P(x1, x2) = P(x1 | prompt) * P(x2 | prompt + [x1]), as a [V, V] array."""
    first = next_token_probs(model, prompt, sampling)
    law = np.zeros((len(first), len(first)))
    for x1 in np.flatnonzero(first):
        law[x1] = first[x1] * next_token_probs(model, list(prompt) + [int(x1)], sampling)
    return law


def pair_law(model, prompt: Sequence[int], sampling: SamplingConfig, n: int) -> np.ndarray:
    """The law [V, V] of (x_{n-1}, x_n), the last two of n >= 2 tokens generated after prompt.

    Exact for models that condition on at most the last two tokens (the fixtures, order 1 or 2).
    """
    assert n >= 2 and model.order <= 2
    vocab_size = model.vocab_size
    # P(c | context ending in a, b) for every pair (a, b), computed once: [V, V, V]
    contexts = [list(prompt) + [a, b] for a in range(vocab_size) for b in range(vocab_size)]
    logits = torch.stack([model.next_logits(c) for c in contexts])  # [V*V, V]
    transition = to_probs(logits, sampling).double().numpy().reshape((vocab_size,) * 3)
    # after one step: the law of (x_0, x_1) with x_0 the prompt's last token
    law = np.zeros((vocab_size, vocab_size))
    law[prompt[-1]] = next_token_probs(model, prompt, sampling)
    for _ in range(n - 1):
        law = np.einsum("ab,abc->bc", law, transition)
    return law


def pair_counts(tokens: np.ndarray, first: int, vocab_size: int) -> np.ndarray:
    """Counts [V, V] of (tokens[:, first], tokens[:, first + 1]) over the rows of tokens [N, T]."""
    codes = tokens[:, first] * vocab_size + tokens[:, first + 1]
    return np.bincount(codes, minlength=vocab_size * vocab_size).reshape(vocab_size, vocab_size)


def first_two_in_runs(engine, prompt: list[int], config, seed: int, num_samples: int,
                      rows_per_run: int) -> tuple[np.ndarray, float]:
    """(x1, x2) of num_samples unseeded rows of ``prompt`` under ``config``, rows_per_run a
    generation, run i's generator seeded with seed + i -> ([N, 2], accepted / drafted)."""
    from verispec.sample.sampling import make_generator

    samples, drafted, accepted = [], 0, 0
    for run_index in range(num_samples // rows_per_run):
        run = engine.stream([prompt] * rows_per_run, config,
                            generator=make_generator(seed + run_index))
        for _ in run:
            if min(map(len, run.token_ids)) >= 2:
                break
        samples += [row[:2] for row in run.token_ids]
        drafted += run.metrics.num_drafted
        accepted += run.metrics.num_accepted
    return np.array(samples), accepted / drafted
