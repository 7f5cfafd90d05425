"""Adaptive speculation depth: small policy objects the engine asks for k between rounds.

This module is the interface (RoundStats, AdaptivePolicy, AdaptivePolicyConfig) the policies
implement; policy.named_policy builds either by name:
  * threshold (threshold.py): grow k by one when the recent acceptance rate is above ``grow_above``,
    shrink it when below ``shrink_below``, always within [min, max] (a common heuristic, e.g.
    the "heuristic" schedule of Hugging Face assisted generation).
  * goodput (goodput.py): estimate the per-position acceptance rates and the costs of a round
    at each depth, and pick the k that maximises expected tokens per unit of cost (Leviathan
    et al. 2023, section 3.4); it may choose plain rounds (k = 0) where drafting does not pay.

Configs are frozen dataclasses; ``config.build(initial_k)`` makes a fresh stateful policy for
one generation, so by default no state passes between requests. With ``carry_over=True`` the
engine hands ``build`` the latest policy of the same config and batch-size bucket on the same
decoder (keyed by (config, bucket): scheduler.Scheduler._carry_key; the rows' sampling settings
are not part of the key), and the new one starts from a copy of what that one had learned: a
short request then runs at the learned depth from its first round instead of spending its
rounds on the priors. Policies never change the output law: any k gives exact samples; they
only change speed, and never what a seed gives: a seeded row's tokens are its target's samples
on clocks keyed by position (sample/seeded.py), whatever k each round has.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

from ..config import check_bool, check_int, is_int
from ..errors import ConfigError
from .costs import CostCurve


@dataclass(frozen=True)
class RoundStats:
    """What one round did, summed over the batch rows still generating.

    num_draft_tokens: k used this round (0 for a plain target step).
    num_reached[i] / num_accepted_at[i]: rows whose position i was tested / accepted (len k).
    draft_time, target_time: seconds spent proposing and scoring this round.
    other_time: the round's other seconds, paid once per round whatever k is (verification and
        bookkeeping).
    draft_timed: False when the draft's first step also fed the tokens of the plain rounds
        before it: draft_time is then no measure of k steps (a probe of k = 1 after 15 plain
        rounds would make drafting look several times dearer than it is, and keep k at 0).
    num_rows: rows in the round.
    join_time, join_tokens: seconds the draft spent prefilling the prompts of rows that joined
        since the previous round, and those rows' max_new_tokens summed: a cost drafting pays
        per request, which a batch running plain rounds defers
        (scheduler.Scheduler.defers_draft).
    catch_up_time: seconds the draft spent before this round feeding the tokens of the plain
        rounds before it and the prompts deferred meanwhile (0 after a drafting round): what
        leaving plain rounds costs, outside the round's own timings.
    timed: False when the round's timings measure a first use rather than a round: the batch
        had not yet run a round at this depth in this batch-size bucket, whose first call pays
        one-off costs (kernel and primitive set-up, first-touch memory), or its target pass
        also prefilled rows that had just joined (engine.batch.Batch.add). Its acceptance still
        counts.
    """

    num_draft_tokens: int
    num_reached: tuple[int, ...]
    num_accepted_at: tuple[int, ...]
    draft_time: float
    target_time: float
    other_time: float = 0.0
    draft_timed: bool = True  # False: the draft also caught up on plain rounds' tokens
    num_rows: int = 1
    join_time: float = 0.0
    join_tokens: int = 0
    timed: bool = True  # False: a first use (one-off costs), timings weigh first_use_weight
    catch_up_time: float = 0.0


class AdaptivePolicy:
    """Interface: called once per round with that round's stats; returns the next round's k.

    ``num_draft_tokens`` holds the current depth; at construction, the first round's k
    (the configured start, clamped to the policy's bounds).
    """

    num_draft_tokens: int

    def next_num_draft_tokens(self, stats: RoundStats) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def measuring(self, k: int) -> bool:
        """Whether a round at depth k (the one this policy returned) only measures drafting:
        a probe while the policy's own choice is plain rounds. Such a round need not keep its
        accepted draft tokens (scheduler.Scheduler._measuring)."""
        return False


@dataclass(frozen=True)
class AdaptivePolicyConfig:
    """Base of the adaptive policy configs: the bounds k stays within, and whether a generation
    starts from what the previous one on the same decoder learned (``carry_over``; see the
    module docstring)."""

    min_num_draft_tokens: int = 1
    max_num_draft_tokens: int = 16
    carry_over: bool = False
    # the fewest rows a round must have for the policy to set its k; a smaller round drafts at
    # its rows' own k (a model-free drafter that sets each row's depth itself needs no policy
    # for a lone row, whose draft costs only that row, but does in a batch, where a wide pass
    # makes every row wait)
    min_rows: int = 1
    # the lowest min_num_draft_tokens a policy accepts: 0 lets it choose plain decoding rounds
    LOWEST_MIN: ClassVar[int] = 1

    def __post_init__(self) -> None:
        lo, hi = self.min_num_draft_tokens, self.max_num_draft_tokens
        if not (is_int(lo) and is_int(hi) and self.LOWEST_MIN <= lo <= hi <= 32 and hi >= 1):
            raise ConfigError(
                f"min_num_draft_tokens={lo!r}, max_num_draft_tokens={hi!r} are invalid: expected "
                f"integers with {self.LOWEST_MIN} <= min <= max <= 32 and max >= 1.")
        check_int("min_rows", self.min_rows, 1)
        check_bool("carry_over", self.carry_over)

    def clamp(self, k: int) -> int:
        return max(self.min_num_draft_tokens, min(self.max_num_draft_tokens, k))

    def build(self, initial_num_draft_tokens: int, previous: AdaptivePolicy | None = None,
              costs: CostCurve | None = None) -> AdaptivePolicy:  # pragma: no cover
        """A policy for one generation: fresh at the (clamped) initial k, or, given the
        ``previous`` generation's policy from this same config, a copy of its state that goes
        on from the depth it had reached (the initial k is then not used). ``costs``: the
        loaded pair's measured cost curve for one row (costs.py), for a policy that prices
        rounds (None: none measured, or a bucket of more rows than the curve's one)."""
        raise NotImplementedError

    def _resume(self, previous: AdaptivePolicy) -> AdaptivePolicy:
        if getattr(previous, "config", None) != self:
            raise ConfigError("carry-over needs the previous policy of the same config; got "
                              f"{type(previous).__name__} from another one.")
        return copy.deepcopy(previous)  # the copy shares only the frozen config
