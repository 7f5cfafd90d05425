"""The cost curve: what one row's target pass over n tokens and one draft step cost on the
loaded pair, and how a round is priced from it.

A round at depth k runs k draft steps and one target pass over k + 1 tokens, T(k). On an
accelerator T is nearly flat in k; on a CPU it depends on the weights' kernels: row-by-row
kernels make T grow about linearly with the tokens, a GEMM over the pass's tokens keeps it
nearly flat, and kernels that work on groups of rows make it uneven (a pass over 4 tokens may
cost less than one over 3). :class:`CostCurve` holds T(0 .. K) and the draft step as measured
on the loaded models (models/llama_cpp/costs.py measures and caches them); the goodput policy
(goodput.py) prices rounds from it before any round has run, and from its own timings where
rounds have measured (:func:`target_calls`). The expected tokens of a round at i.i.d.
acceptance a is E(k) = 1 + a + ... + a^k (Leviathan et al. 2023, section 3.4), so a curve gives
the depth that pays best at an assumed acceptance (:meth:`CostCurve.best_depth`).

What this is not: the measurement (models/llama_cpp/costs.py) or a policy. Nothing here changes
the output law: a curve only changes how many tokens are drafted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import is_number
from ..errors import ConfigError

# the deepest k a measured curve covers (a target pass over CURVE_DEPTH + 1 tokens); deeper, T
# is extrapolated (CostCurve.target_call). Measuring a width costs a few passes at load, once
# per model file, thread count and kernel set
CURVE_DEPTH = 8

@dataclass(frozen=True)
class CostCurve:
    """Measured seconds of one row's passes on the loaded pair.

    target_pass: seconds of a target pass over n = 1 .. len(target_pass) tokens (index n - 1),
        so that T(k), the target call of a round at depth k, is target_pass[k].
    draft_step: seconds of one draft step (a draft pass over one token); None where no draft
        model drafts (a model-free drafter's lookups are priced at 0).
    """

    target_pass: tuple[float, ...]
    draft_step: float | None = None

    def __post_init__(self) -> None:
        values = self.target_pass + (() if self.draft_step is None else (self.draft_step,))
        if not self.target_pass or not all(is_number(v) and 0 < v < math.inf for v in values):
            raise ConfigError(f"CostCurve(target_pass={self.target_pass!r}, draft_step="
                              f"{self.draft_step!r}) is invalid: expected at least one target "
                              "pass and every cost a finite number of seconds > 0.")

    @property
    def max_depth(self) -> int:
        """The deepest k whose target call was measured (a pass over k + 1 tokens)."""
        return len(self.target_pass) - 1

    @property
    def cost_ratio(self) -> float | None:
        """c = draft step / one-token target pass; None without a draft model."""
        return None if self.draft_step is None else self.draft_step / self.target_pass[0]

    def target_call(self, k: int) -> float:
        """T(k): seconds of a target pass over k + 1 tokens. Beyond the measured depths, the
        last measured pass plus the curve's mean slope per token (>= 0)."""
        if k < 0:
            raise ValueError(f"k={k} is invalid: expected a depth >= 0.")
        if k <= self.max_depth:
            return self.target_pass[k]
        slope = 0.0 if self.max_depth == 0 else max(
            0.0, (self.target_pass[-1] - self.target_pass[0]) / self.max_depth)
        return self.target_pass[-1] + slope * (k - self.max_depth)

    def round_cost(self, k: int) -> float:
        """Seconds of a round at depth k: k draft steps and T(k) (k = 0: a plain step)."""
        return k * (self.draft_step or 0.0) + self.target_call(k)

    def goodput(self, k: int, acceptance: float) -> float:
        """Expected tokens per second of rounds at depth k whose draft tokens are each
        accepted with probability ``acceptance``: E(k) / round_cost(k)."""
        return expected_tokens(k, acceptance) / self.round_cost(k)

    def best_depth(self, acceptance: float, max_depth: int | None = None) -> int:
        """The k in 1 .. max_depth (default: the measured depths) with the highest goodput at
        this acceptance; the shallowest on ties."""
        deepest = self.max_depth if max_depth is None else max_depth
        return max(range(1, max(deepest, 1) + 1),
                   key=lambda k: (self.goodput(k, acceptance), -k))

    def describe(self) -> str:
        """The curve in one line: target pass ms per n, the draft step and c, e.g.
        "target pass ms n=1..3: 70.1 93.0 107.5; draft step 38.3 ms (c = 0.55)"."""
        passes = " ".join(f"{seconds * 1e3:.1f}" for seconds in self.target_pass)
        text = f"target pass ms n=1..{len(self.target_pass)}: {passes}"
        if self.draft_step is not None:
            text += f"; draft step {self.draft_step * 1e3:.1f} ms (c = {self.cost_ratio:.2f})"
        return text


def expected_tokens(k: int, acceptance: float) -> float:
    """E(k) = 1 + a + ... + a^k: the expected tokens of a round at depth k (i.i.d. acceptance
    a), the bonus or recovered token included."""
    return sum(acceptance ** i for i in range(k + 1))


def priced_rounds(curve: CostCurve, measured: list[tuple[int, float]], plain: float | None,
                  draft_step: float | None, overhead: float,
                  max_depth: int) -> tuple[list[float], float]:
    """(seconds of a round at k = 1 .. max_depth, seconds of a plain round) from the curve and
    what rounds measured: ``measured`` (depth, mean T) points, the plain rounds' mean T and the
    mean draft step (None: not measured), the round's fixed ``overhead``. T comes from
    :func:`target_calls`; an unmeasured draft step is the curve's, at the same scale."""
    calls, scale = target_calls(curve, measured, max_depth)
    step = scale * (curve.draft_step or 0.0) if draft_step is None else draft_step
    plain_cost = overhead + (calls[0] if plain is None else plain)
    return [overhead + k * step + calls[k] for k in range(1, max_depth + 1)], plain_cost


def target_calls(curve: CostCurve, measured: list[tuple[int, float]],
                 max_depth: int) -> tuple[list[float], float]:
    """(T(0 .. max_depth), scale): a round's measured mean T where rounds measured it, the
    curve elsewhere, times the scale: the mean ratio of measured to curve over the measured
    depths (1 with none). So the curve gives the form, rounds the level: on a machine slower
    now than when the curve was measured, every depth not yet run is priced as slower too.

    Example: curve T = [1, 2, 2], measured [(0, 2.0)] -> scale 2, T = [2.0, 4.0, 4.0]."""
    ratios = [t / curve.target_call(k) for k, t in measured]
    scale = sum(ratios) / len(ratios) if ratios else 1.0
    seen = dict(measured)
    return [seen.get(k, scale * curve.target_call(k)) for k in range(max_depth + 1)], scale


def piecewise(points: list[tuple[int, float]], k: int, slope: float) -> float:
    """T at depth k from measured (depth, T) points sorted by depth: exact at a point, linear
    between neighbours, flat below the first, rising by ``slope`` after the last (the goodput
    policy's model of T without a curve).
    Example: points [(2, 1.0), (4, 2.0)], slope 0.4 -> k=1: 1.0, k=3: 1.5, k=6: 2.8."""
    below = [(d, t) for d, t in points if d <= k]
    above = [(d, t) for d, t in points if d >= k]
    if not below:
        return above[0][1]
    if not above:
        return below[-1][1] + slope * (k - below[-1][0])
    (d0, t0), (d1, t1) = below[-1], above[0]
    return t0 if d1 == d0 else t0 + (t1 - t0) * (k - d0) / (d1 - d0)


def faded(total: float, count: float, decay: float) -> tuple[float, float]:
    """Decayed sums (seconds, weight) of timings a plain round does not measure (drafting
    depths, whose weight counts rounds, and draft steps, whose weight counts steps). They fade
    as any round's do, but once they rest on a weight of one they stay there, so the mean
    stands: faded out, a bucket's drafting timings fall below any weight a few hundred plain
    rounds after its last probe (0.9^200), its model goes back to a flat T(k) = T(0), and it
    drafts deep rounds for a promised gain that costly rounds, a catch-up and rows out of step
    take back. Held at one round's weight, the next probe still counts as much as everything
    before it. Weights below one (first uses alone, first_use_weight) fade out as any do: a
    bucket's cold first round would otherwise set its T(k) slope alone for good and hold it in
    plain rounds where drafting pays (dev/LOG.md: goodput._faded)."""
    if count < 1.0:
        return total * decay, count * decay
    factor = max(decay, 1.0 / count)
    return total * factor, count * factor

