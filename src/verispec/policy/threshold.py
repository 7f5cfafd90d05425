"""The threshold policy: k follows the recent acceptance rate, one step at a time.

The rate is pooled over the last ``window`` rounds; k grows by one above ``grow_above``, shrinks
by one below ``shrink_below`` and stays within the config's bounds. What this is not: the policy
interface and carry-over (base.py), or a policy that prices rounds by their costs (goodput.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import check_int, is_number
from ..errors import ConfigError
from .base import AdaptivePolicy, AdaptivePolicyConfig, RoundStats
from .costs import CostCurve


@dataclass(frozen=True)
class ThresholdPolicyConfig(AdaptivePolicyConfig):
    """Grow k when recent acceptance > grow_above, shrink when < shrink_below.

    window: how many recent rounds the acceptance rate is pooled over.
    """

    grow_above: float = 0.8
    shrink_below: float = 0.4
    window: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        below, above = self.shrink_below, self.grow_above
        if not (is_number(below) and is_number(above) and 0.0 <= below < above <= 1.0):
            raise ConfigError(
                f"shrink_below={below!r}, grow_above={above!r} are invalid: expected numbers "
                "with 0 <= shrink_below < grow_above <= 1.")
        check_int("window", self.window, 1)

    def build(self, initial_num_draft_tokens: int, previous: AdaptivePolicy | None = None,
              costs: CostCurve | None = None) -> AdaptivePolicy:
        """As AdaptivePolicyConfig.build; ``costs`` is not used: this policy follows
        acceptance alone."""
        if previous is not None:
            return self._resume(previous)
        return ThresholdPolicy(self, self.clamp(initial_num_draft_tokens))


class ThresholdPolicy(AdaptivePolicy):
    def __init__(self, config: ThresholdPolicyConfig, initial_num_draft_tokens: int) -> None:
        self.config = config
        self.num_draft_tokens = initial_num_draft_tokens
        self._recent: list[tuple[int, int]] = []  # (drafted, accepted) of recent rounds

    def next_num_draft_tokens(self, stats: RoundStats) -> int:
        if stats.num_draft_tokens == 0:
            return self.num_draft_tokens
        drafted = sum(stats.num_reached)
        accepted = sum(stats.num_accepted_at)
        self._recent = (self._recent + [(drafted, accepted)])[-self.config.window:]
        total_drafted = sum(d for d, _ in self._recent)
        rate = sum(a for _, a in self._recent) / max(total_drafted, 1)
        if rate > self.config.grow_above:
            self.num_draft_tokens = self.config.clamp(self.num_draft_tokens + 1)
        elif rate < self.config.shrink_below:
            self.num_draft_tokens = self.config.clamp(self.num_draft_tokens - 1)
        else:
            return self.num_draft_tokens
        self._recent = []  # judge the new k on its own rounds
        return self.num_draft_tokens
