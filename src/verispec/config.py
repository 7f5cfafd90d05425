"""Frozen, validated configuration for sampling and generation (data only: imports errors).

Every field is checked in ``__post_init__``; a bad value raises :class:`ConfigError` naming the
field, the value and the fix. Configs are passed explicitly and never mutated: use
``dataclasses.replace`` to derive a variant for one call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from .errors import ConfigError

MAX_NUM_DRAFT_TOKENS = 32


def _require(ok: bool, field_name: str, value: object, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}={value!r} is invalid: expected {expected}.")


def check_seed(seed: object) -> None:
    """A seed torch takes as given: an int in [0, 2**63) or None (torch would wrap -1 to
    2**64 - 1, a different seed than the one asked for)."""
    if seed is not None:
        _require(_is_int(seed) and 0 <= seed < 2**63, "seed", seed,
                 "an integer in [0, 2**63) or None")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become the distribution tokens are drawn from (same for draft and target).

    temperature: 0 means greedy (a point mass on the argmax, ties to the lowest id).
    top_k: keep the k most likely tokens (None = all).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p (None = all).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        _require(
            _is_real(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
            "temperature", self.temperature, "a finite number >= 0 (0 = greedy)",
        )
        if self.top_k is not None:
            _require(_is_int(self.top_k) and self.top_k >= 1, "top_k", self.top_k,
                     "an integer >= 1, or None to disable top-k")
        if self.top_p is not None:
            _require(_is_real(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", self.top_p,
                     "a number in (0, 1], or None to disable top-p")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


@runtime_checkable
class DepthPolicyConfig(Protocol):
    """What GenerationConfig.adaptive holds: a depth policy's settings (policy/base.py's
    AdaptivePolicyConfig and its subclasses). A Protocol, so that this module needs no policy."""

    carry_over: bool

    def build(self, initial_num_draft_tokens: int, previous: Any = None) -> Any: ...


@dataclass(frozen=True)
class GenerationConfig:
    """One generation request's settings.

    num_draft_tokens: speculation depth k (1 to 32); the starting k when ``adaptive`` is set.
    stop_token_ids: generation ends at the first of these (it is emitted, nothing after it).
    min_new_tokens: no stop token is generated before this many new tokens: the target's
        distribution at those positions is renormalised without them (vLLM's min_tokens).
    seed: seeds the generation's own torch.Generator; None draws a fresh seed from the OS.
    adaptive: an adaptive-depth policy config (ThresholdPolicyConfig, GoodputPolicyConfig) or None.
    cost_ratio: c = time of one draft step / time of one target step, for the modelled speedup;
        None uses the ratio measured during the generation.
    verification: how an unseeded sampled row tests a draft model's tokens: "block" (block
        verification, Sun et al. 2025: exact, and keeps at least as many tokens a round on average) or
        "token" (token-wise rejection sampling, Leviathan et al. 2023). Deterministic drafts
        (n-gram lookup) and greedy rows compare tokens either way, and a seeded row keeps a
        draft token while it is the target's own sample at its position (spec/seeded.py).
    """

    max_new_tokens: int = 64
    num_draft_tokens: int = 4
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_token_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0
    seed: int | None = None
    adaptive: DepthPolicyConfig | None = None
    cost_ratio: float | None = None
    verification: str = "block"

    def __post_init__(self) -> None:
        _require(_is_int(self.max_new_tokens) and self.max_new_tokens >= 1, "max_new_tokens",
                 self.max_new_tokens, "an integer >= 1")
        _require(
            _is_int(self.num_draft_tokens) and 1 <= self.num_draft_tokens <= MAX_NUM_DRAFT_TOKENS,
            "num_draft_tokens", self.num_draft_tokens,
            f"an integer from 1 to {MAX_NUM_DRAFT_TOKENS}",
        )
        _require(isinstance(self.sampling, SamplingConfig), "sampling", self.sampling,
                 "a verispec.SamplingConfig")
        stops = self.stop_token_ids
        _require(isinstance(stops, tuple) and all(_is_int(t) and t >= 0 for t in stops),
                 "stop_token_ids", stops, "a tuple of non-negative token ids, e.g. (2,)")
        _require(_is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens,
                 "min_new_tokens", self.min_new_tokens,
                 f"an integer from 0 to max_new_tokens ({self.max_new_tokens})")
        check_seed(self.seed)
        if self.adaptive is not None:
            _require(isinstance(self.adaptive, DepthPolicyConfig), "adaptive", self.adaptive,
                     "ThresholdPolicyConfig(...), GoodputPolicyConfig(...) or None")
        if self.cost_ratio is not None:
            _require(_is_real(self.cost_ratio) and 0 < self.cost_ratio < math.inf, "cost_ratio",
                     self.cost_ratio, "a finite number > 0 (draft step time / target step time)")
        check_verification(self.verification)


VERIFICATION_RULES = ("block", "token")  # the first is the default
# the rules a sampled `verispec bench` row can run under: block and token verification of
# unseeded rows (their generator seeded by the bench), and "seeded": a row with a seed, whose
# tokens are races on keyed clocks (spec/seeded.py), which couples the draft to the target instead
BENCH_RULES = VERIFICATION_RULES + ("seeded",)


def check_verification(verification: object) -> None:
    """One of VERIFICATION_RULES, else ConfigError naming them."""
    _require(verification in VERIFICATION_RULES, "verification", verification,
             " or ".join(repr(rule) for rule in VERIFICATION_RULES))

