"""Acceptance and speedup diagnostics: what a draft is expected to buy, in closed form.

Reference: Leviathan, Kalman, Matias 2023, section 3 (expected tokens per target call, and the
walltime improvement (1 - a^(k+1)) / ((1 - a)(k c + 1)) for acceptance rate a, k draft tokens and
cost ratio c). Pure functions of numbers or distributions: no models, no random numbers. The
verification rule itself is in rejection.py.

Legend: V vocabulary. Probabilities are fp32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..errors import ConfigError
from .checks import as_index


def expected_acceptance(draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """alpha = sum_x min(p_draft(x), p_target(x)) = 1 - TV: the chance a draft token is accepted.

    Shapes: [..., V] each -> [...] fp32.
    """
    return torch.minimum(draft_probs, target_probs).sum(dim=-1)


def expected_tokens_per_step(acceptance_rates: Sequence[float] | torch.Tensor) -> float:
    """Expected tokens emitted per target call, given per-position acceptance rates.

    acceptance_rates[i] is the chance position i is accepted given positions < i were. A round
    emits 1 + sum_i prod_{j <= i} rates[j] tokens in expectation (the accepted prefix plus one).
    Example: rates (0.8, 0.5) -> 1 + 0.8 + 0.8 * 0.5 = 2.2.
    """
    rates = torch.as_tensor(acceptance_rates, dtype=torch.float64).reshape(-1)
    if not bool(((rates >= 0) & (rates <= 1)).all()):  # NaN fails both comparisons
        raise ConfigError(f"acceptance_rates={rates.tolist()!r:.80} is invalid: expected "
                          "probabilities in [0, 1].")
    return float(1.0 + torch.cumprod(rates, dim=0).sum())


def theoretical_speedup(acceptance_rate: float, num_draft_tokens: int, cost_ratio: float) -> float:
    """Leviathan et al. eq. for walltime improvement: (1 - a^(k+1)) / ((1 - a)(k c + 1)).

    acceptance_rate a (per-token, assumed i.i.d.), k = num_draft_tokens, c = draft step time /
    target step time. At a = 1 the limit (k + 1) / (k c + 1) is used.
    """
    a, k, c = float(acceptance_rate), as_index(num_draft_tokens), float(cost_ratio)
    if not 0.0 <= a <= 1.0:
        raise ConfigError(f"acceptance_rate={acceptance_rate!r} is invalid: expected a "
                          "probability in [0, 1].")
    if k is None or k < 0:
        raise ConfigError(f"num_draft_tokens={num_draft_tokens!r} is invalid: expected an "
                          "integer >= 0.")
    if not (0.0 <= c < math.inf):
        raise ConfigError(f"cost_ratio={cost_ratio!r} is invalid: expected a finite number >= 0 "
                          "(draft step time / target step time).")
    expected_tokens = k + 1.0 if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
    return expected_tokens / (k * c + 1.0)


def optimal_num_draft_tokens(acceptance_rate: float, cost_ratio: float,
                             max_num_draft_tokens: int = 32) -> tuple[int, float]:
    """The k in [1, max] maximising :func:`theoretical_speedup`, and that speedup."""
    if (as_index(max_num_draft_tokens) or 0) < 1:
        raise ConfigError(f"max_num_draft_tokens={max_num_draft_tokens!r} is invalid: expected "
                          "an integer >= 1.")
    best = max(range(1, max_num_draft_tokens + 1),
               key=lambda k: theoretical_speedup(acceptance_rate, k, cost_ratio))
    return best, theoretical_speedup(acceptance_rate, best, cost_ratio)
