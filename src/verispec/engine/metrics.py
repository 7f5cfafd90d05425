"""Counters and timings of speculative decoding, per generation and cumulative.

A :class:`GenerationMetrics` holds raw counters only; every rate is a derived property, so
metrics of several generations add up exactly (``a + b``, or ``sum(..., GenerationMetrics())``).

Definitions (a "row-round" is one batch row taking part in one round):
  acceptance_rate          accepted / drafted.
  per_position_acceptance  for position i: rows that accepted i / rows whose position i was tested
                           (tested = all earlier positions accepted).
  mean_accepted_length     tokens produced per target call per row = (accepted + row-rounds) /
                           row-rounds; 1.0 for plain decoding.
  cost_ratio               c = seconds per draft step / seconds per target call (measured).
  modelled_speedup         mean_accepted_length / (mean k * c + 1): the speedup over plain
                           decoding the measured rates predict, if a target call over k+1 tokens
                           costs what one over 1 token does (Leviathan et al. 2023, eq. 3).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from ..policy.scheduler import RoundTimes

MAX_POSITIONS = 32


def _zeros() -> tuple[int, ...]:
    return (0,) * MAX_POSITIONS


@dataclass(frozen=True)
class GenerationMetrics:
    num_rounds: int = 0
    num_row_rounds: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_emitted: int = 0  # tokens returned to the caller (after stop / max_new_tokens cuts)
    num_draft_steps: int = 0  # draft forward calls (k per speculative round)
    num_target_calls: int = 0
    num_reached: tuple[int, ...] = field(default_factory=_zeros)
    num_accepted_at: tuple[int, ...] = field(default_factory=_zeros)
    draft_time: float = 0.0
    target_time: float = 0.0
    verify_time: float = 0.0
    wall_time: float = 0.0
    fixed_cost_ratio: float | None = None  # from the config, when the user gave one

    def __add__(self, other: GenerationMetrics) -> GenerationMetrics:
        summed = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "fixed_cost_ratio":  # kept when only one side has it or both agree
                summed[f.name] = b if a is None else a if (b is None or a == b) else None
            elif isinstance(a, tuple):
                summed[f.name] = tuple(x + y for x, y in zip(a, b))
            else:
                summed[f.name] = a + b
        return GenerationMetrics(**summed)

    def __radd__(self, other: object) -> GenerationMetrics:
        if other == 0:  # sum() starts from 0
            return self
        return NotImplemented

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def token_acceptance(self) -> float:
        """The per-token acceptance probability a of Leviathan et al.'s formulas, estimated.

        accepted / tested: a draft token is tested only if every token before it in its round
        was accepted, so the tokens after a rejection do not count (acceptance_rate counts
        them, which makes it fall with k even when a does not). Under the i.i.d. model this is
        the maximum-likelihood estimate of a. Example: k = 4, one round accepting 2 -> 2 / 3.
        """
        tested = sum(self.num_reached)
        return sum(self.num_accepted_at) / tested if tested else 0.0

    @property
    def per_position_acceptance(self) -> tuple[float, ...]:
        return tuple(acc / reached for acc, reached in zip(self.num_accepted_at, self.num_reached)
                     if reached > 0)

    @property
    def mean_accepted_length(self) -> float:
        if not self.num_row_rounds:
            return 0.0
        return (self.num_accepted + self.num_row_rounds) / self.num_row_rounds

    @property
    def mean_num_draft_tokens(self) -> float:
        return self.num_drafted / self.num_row_rounds if self.num_row_rounds else 0.0

    @property
    def cost_ratio(self) -> float | None:
        """Measured c; None when nothing was drafted."""
        if not self.num_draft_steps or not self.num_target_calls or self.target_time <= 0:
            return None
        return (self.draft_time / self.num_draft_steps) / (self.target_time / self.num_target_calls)

    @property
    def modelled_speedup(self) -> float | None:
        """Tokens per target call / (k c + 1): Leviathan et al.'s model with the measured rates.

        Its unit is one target call, so it assumes verifying k + 1 tokens costs what one plain
        step does. True on a GPU at small k; on a CPU a (k+1)-token pass costs more (see
        docs/benchmarks.md, column v), and this overstates the speedup. ``verispec bench`` and
        ``verispec generate --compare`` measure it.
        """
        c = self.fixed_cost_ratio if self.fixed_cost_ratio is not None else self.cost_ratio
        if c is None:
            return 1.0 if self.num_row_rounds else None
        return self.mean_accepted_length / (self.mean_num_draft_tokens * c + 1.0)

    @property
    def tokens_per_second(self) -> float:
        return self.num_emitted / self.wall_time if self.wall_time > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        """Counters and derived rates, JSON-ready (positions trimmed to those tested)."""
        raw = asdict(self)
        used = len(self.per_position_acceptance)
        raw["num_reached"] = list(self.num_reached[:used])
        raw["num_accepted_at"] = list(self.num_accepted_at[:used])
        for name in ("acceptance_rate", "token_acceptance", "per_position_acceptance",
                     "mean_accepted_length", "mean_num_draft_tokens", "cost_ratio",
                     "modelled_speedup", "tokens_per_second"):
            value = getattr(self, name)
            raw[name] = list(value) if isinstance(value, tuple) else value
        return raw


class MetricsRecorder:
    """Mutable per-generation counters, cheap to update every round; ``snapshot()`` freezes them."""

    def __init__(self, fixed_cost_ratio: float | None = None) -> None:
        self.fixed_cost_ratio = fixed_cost_ratio
        self.counts = {"num_rounds": 0, "num_row_rounds": 0, "num_drafted": 0, "num_accepted": 0,
                       "num_emitted": 0, "num_draft_steps": 0, "num_target_calls": 0}
        self.times = RoundTimes()  # summed over the rounds recorded
        self.num_reached = [0] * MAX_POSITIONS
        self.num_accepted_at = [0] * MAX_POSITIONS

    def record_round(self, num_draft_tokens: int, num_rows: int, num_accepted: int,
                     num_emitted: int, reached: list[int], accepted_at: list[int],
                     times: RoundTimes, num_drafted: int | None = None) -> None:
        """One round: reached[i] / accepted_at[i] count rows tested / accepted at position i.
        num_draft_tokens: the round's k (draft steps); num_drafted: tokens verified over the
        rows, when rows drafted fewer than k (None: k per row)."""
        counts = self.counts
        counts["num_rounds"] += 1
        counts["num_row_rounds"] += num_rows
        counts["num_drafted"] += (num_draft_tokens * num_rows if num_drafted is None
                                  else num_drafted)
        counts["num_accepted"] += num_accepted
        counts["num_emitted"] += num_emitted
        counts["num_draft_steps"] += num_draft_tokens
        counts["num_target_calls"] += 1
        for i, (r, a) in enumerate(zip(reached, accepted_at)):
            self.num_reached[i] += r
            self.num_accepted_at[i] += a
        self.times += times

    def snapshot(self) -> GenerationMetrics:
        return GenerationMetrics(**self.counts, **asdict(self.times),
                                 num_reached=tuple(self.num_reached),
                                 num_accepted_at=tuple(self.num_accepted_at),
                                 fixed_cost_ratio=self.fixed_cost_ratio)
