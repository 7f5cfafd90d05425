"""Frozen, validated configuration for sampling and generation (data only: imports errors).

Every field is checked in ``__post_init__``; a bad value raises :class:`ConfigError` naming the
field (also as its ``field``), the value and the fix. A numeric field takes numpy's scalars as
Python's (np.int64(5) is 5, np.float32(0.5) is 0.5; a bool is never a number) and holds the
Python number. Configs are passed explicitly and never mutated: use ``dataclasses.replace`` to
derive a variant for one call.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import InitVar, dataclass, field
from typing import Any, Protocol, runtime_checkable

from .errors import ConfigError

MAX_NUM_DRAFT_TOKENS = 32


def require(ok: bool, name: str, value: object, expected: str) -> None:
    """ConfigError unless ``ok``, in the form every setting's check shares:
    "{name}={value!r} is invalid: expected {expected}." (``field`` = name)."""
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid: expected {expected}.", field=name)


def is_int(value: object) -> bool:
    """An int, never a bool (True is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or a float, never a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: object, low: int, high: int | None = None,
              note: str = "") -> None:
    """An integer >= ``low`` (and <= ``high`` where given), else ConfigError; ``note`` follows
    the range in the message: check_int("top_k", 0, 1, ", or None") -> "top_k=0 is invalid:
    expected an integer >= 1, or None."."""
    expected = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
    require(is_int(value) and low <= value and (high is None or value <= high), name, value,
            expected + note)


def check_number(name: str, value: object, low: float, high: float | None = None, *,
                 low_open: bool = False, note: str = "") -> None:
    """A real number >= ``low`` (> with ``low_open``) and <= ``high`` where given (high=inf:
    finite), else ConfigError; NaN never passes. ``note`` follows the range in the message:
    check_number("top_p", 0, 0, 1, low_open=True) -> "top_p=0 is invalid: expected a number in
    (0, 1]."."""
    ok = is_number(value) and (value > low if low_open else value >= low)
    bound = f"{'>' if low_open else '>='} {low:g}"
    if high is None:
        expected = f"a number {bound}"
    elif high == math.inf:
        ok, expected = ok and value < high, f"a finite number {bound}"
    else:
        ok = ok and value <= high
        expected = f"a number in {'(' if low_open else '['}{low:g}, {high:g}]"
    require(ok, name, value, expected + note)


def check_bool(name: str, value: object) -> None:
    """True or False, else ConfigError (1 and "yes" are not flags)."""
    require(isinstance(value, bool), name, value, "True or False")


def plain_number(value: object) -> object:
    """An integer or real scalar of another type (numpy's, a Fraction) as the Python int or
    float it holds; anything else unchanged, bools included, for the checks to judge."""
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def _make_plain(config: object, *names: str) -> None:
    """The named fields of a frozen dataclass as plain Python numbers (plain_number)."""
    for name in names:
        object.__setattr__(config, name, plain_number(getattr(config, name)))


def check_seed(seed: object) -> None:
    """A seed torch takes as given: an int in [0, 2**63) or None (torch would wrap -1 to
    2**64 - 1, a different seed than the one asked for)."""
    if seed is not None:
        require(is_int(seed) and 0 <= seed < 2**63, "seed", seed,
                "an integer in [0, 2**63) or None")


# the highest temperature: logits are divided by it in fp32, where a value past 3.4e38 is inf
# and turns a masked token's -inf into NaN; long before this bound the distribution is uniform
# over the tokens left for any logits a model gives (the lowest end is the argmax's limit,
# taken exactly by sample/sampling.py)
MAX_TEMPERATURE = 1e4


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become the distribution tokens are drawn from (same for draft and target).

    temperature: 0 means greedy (a point mass on the argmax, ties to the lowest id); at most
        10000.
    top_k: keep the k most likely tokens (None = all).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p (None = all).
    min_p: keep the tokens whose probability is at least min_p times the most likely one's,
        after temperature, top-k and top-p (None or 0 = all).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def __post_init__(self) -> None:
        _make_plain(self, "temperature", "top_k", "top_p", "min_p")
        check_number("temperature", self.temperature, 0, MAX_TEMPERATURE, note=" (0 = greedy)")
        if self.top_k is not None:
            check_int("top_k", self.top_k, 1, note=", or None to disable top-k")
        if self.top_p is not None:
            check_number("top_p", self.top_p, 0, 1, low_open=True,
                         note=", or None to disable top-p")
        if self.min_p is not None:
            check_number("min_p", self.min_p, 0, 1, note=", or None to disable min-p")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's API takes them
# a repetition penalty lies in [1/100, 100]: far past the values in use (1.1 to 1.5; below 1
# rewards repeats), and a seen token's logit divided or multiplied by it stays finite in fp32
# for any logit below 3e36 in magnitude (sample/penalties.py saturates the rest)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_LOGIT_BIAS = 100.0  # a bias lies in [-100, 100], as OpenAI's API takes it
MAX_TOP_LOGPROBS = 20  # the most alternatives a token's logprobs list, as OpenAI's API


@dataclass(frozen=True)
class PenaltyConfig:
    """What reshapes a row's logits from its own history, before temperature (sample/penalties.py
    applies it, at every verified position counting the block's earlier draft tokens).

    presence_penalty: subtracted once from each token generated so far (OpenAI's).
    frequency_penalty: subtracted per occurrence of each token generated so far (OpenAI's).
    repetition_penalty: Hugging Face's, over prompt and output: a seen token's positive logit is
        divided by it, a negative one multiplied (1 = off; > 1 discourages repeats), in
        [0.01, 100].
    logit_bias: (token id, bias) pairs, each bias added to its token's logit; sorted by id.
    """

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        _make_plain(self, "presence_penalty", "frequency_penalty", "repetition_penalty")
        if isinstance(self.logit_bias, tuple):
            object.__setattr__(self, "logit_bias", tuple(
                tuple(plain_number(x) for x in pair) if isinstance(pair, tuple) else pair
                for pair in self.logit_bias))
        for name in ("presence_penalty", "frequency_penalty"):
            check_number(name, getattr(self, name), -MAX_PENALTY, MAX_PENALTY, note=" (0 = off)")
        check_number("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY,
                     MAX_REPETITION_PENALTY, note=" (1 = off; > 1 discourages repeats)")
        self._check_logit_bias()

    def _check_logit_bias(self) -> None:
        """Each pair on its own, so the error names the token and the bias that are wrong."""
        bias = self.logit_bias
        require(isinstance(bias, tuple) and all(isinstance(pair, tuple) and len(pair) == 2
                                                 for pair in bias),
                 "logit_bias", bias, "a tuple of (token id, bias) pairs")
        for token, value in bias:
            require(is_int(token) and token >= 0, "logit_bias", {token: value},
                    "token ids that are integers >= 0")
            require(is_number(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS,
                    "logit_bias", {token: value},
                    f"a bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] for each token")
        require(len({token for token, _ in bias}) == len(bias), "logit_bias", bias,
                "each token id once")

    @property
    def uses_history(self) -> bool:
        """Whether a token's processed logit depends on the tokens before it."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def active(self) -> bool:
        return self.uses_history or bool(self.logit_bias)


@runtime_checkable
class DepthPolicyConfig(Protocol):
    """What BatchOptions.adaptive holds: a depth policy's settings (policy/base.py's
    AdaptivePolicyConfig and its subclasses). A Protocol, so that this module needs no policy."""

    carry_over: bool

    def build(self, initial_num_draft_tokens: int, previous: Any = None,
              costs: Any = None) -> Any: ...


@dataclass(frozen=True)
class GenerationConfig:
    """One row's settings: what its text's law and length depend on, and a cap on its depth.
    How fast the row decodes (the depth policy, the batch's k, the cost ratio, the prefill
    budget) is its batch's: BatchOptions.

    num_draft_tokens: the most draft tokens this row takes a round (1 to 32), a cap on its
        batch's depth; None: no cap. A run of its own (Engine.generate without
        ``options``) takes it as the run's k.
    stop_token_ids: generation ends at the first of these (it is emitted, nothing after it).
    min_new_tokens: no stop token is generated before this many new tokens: the target's
        distribution at those positions is renormalised without them (vLLM's min_tokens).
    seed: seeds the generation's own torch.Generator; None draws a fresh seed from the OS.
    penalty: presence, frequency and repetition penalties and logit_bias (PenaltyConfig).
    logprobs: None, or how many alternatives (0 to 20) each emitted token's logprob comes with
        (engine/rows.py TokenLogprob: of the distribution the token was drawn from).
    verification: how an unseeded sampled row tests a draft model's tokens: "block" (block
        verification, Sun et al. 2025: exact, and keeps at least as many tokens a round on average)
        or "token" (token-wise rejection sampling, Leviathan et al. 2023). Deterministic drafts
        (n-gram lookup) and greedy rows compare tokens either way, and a seeded row keeps a draft
        token while it is the target's own sample at its position (sample/seeded.py).
    adaptive, cost_ratio: options of the batch, not of a row: given here, a ConfigError names
        where they go (BatchOptions).
    """

    max_new_tokens: int = 64
    num_draft_tokens: int | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_token_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0
    seed: int | None = None
    adaptive: InitVar[object] = None
    cost_ratio: InitVar[object] = None
    verification: str = "block"
    penalty: PenaltyConfig = field(default_factory=PenaltyConfig)
    logprobs: int | None = None

    def __post_init__(self, adaptive: object, cost_ratio: object) -> None:
        for name, value in (("adaptive", adaptive), ("cost_ratio", cost_ratio)):
            if value is not None:
                raise ConfigError(
                    f"{name}={value!r:.60} is an option of the batch, not of a row: pass "
                    f"options=BatchOptions({name}=...) to Engine.generate, stream "
                    "or batch (Decoder.generate takes adaptive= itself).", field=name)
        _make_plain(self, "max_new_tokens", "num_draft_tokens", "min_new_tokens", "seed",
                    "logprobs")
        if isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids",
                               tuple(plain_number(t) for t in self.stop_token_ids))
        require(is_int(self.max_new_tokens) and self.max_new_tokens >= 1, "max_new_tokens",
                self.max_new_tokens, "an integer >= 1")
        if self.num_draft_tokens is not None:
            check_int("num_draft_tokens", self.num_draft_tokens, 1, MAX_NUM_DRAFT_TOKENS,
                      ", or None for the batch's depth")
        require(isinstance(self.sampling, SamplingConfig), "sampling", self.sampling,
                "a verispec.SamplingConfig")
        stops = self.stop_token_ids
        require(isinstance(stops, tuple) and all(is_int(t) and t >= 0 for t in stops),
                "stop_token_ids", stops, "a tuple of non-negative token ids, e.g. (2,)")
        require(is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens,
                "min_new_tokens", self.min_new_tokens,
                f"an integer from 0 to max_new_tokens ({self.max_new_tokens})")
        check_seed(self.seed)
        check_verification(self.verification)
        require(isinstance(self.penalty, PenaltyConfig), "penalty", self.penalty,
                "a verispec.PenaltyConfig")
        if self.logprobs is not None:
            require(is_int(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
                    "logprobs", self.logprobs,
                    f"an integer from 0 to {MAX_TOP_LOGPROBS} (alternatives per token), or None")


DEFAULT_PREFILL_BUDGET = 512


@dataclass(frozen=True)
class BatchOptions:
    """How a batch decodes, shared by all its rows and never a part of what they emit (a row's
    own settings are its GenerationConfig). One object from the CLI's flags to the scheduler:
    ``--adaptive``, ``--k``, ``--prefill-budget`` and ``--max-batch-size`` set adaptive,
    num_draft_tokens, prefill_budget and max_batch_size; ``load(adaptive=, num_draft_tokens=)``
    set a decoder's defaults
    (Decoder.batch_options), and a Decoder.generate call's ``adaptive`` and
    ``num_draft_tokens`` set its own batch's.

    adaptive: the depth policy that sets k each round (ThresholdPolicyConfig(),
        GoodputPolicyConfig(); policy/), one per batch-size bucket; None: a fixed k.
    num_draft_tokens: the depth k (1 to 32): every round's under a fixed k, the first one's
        under a policy (a goodput policy given the pair's cost curve starts where the curve
        prices best). A row's GenerationConfig.num_draft_tokens caps it for that row.
    cost_ratio: c = time of one draft step / time of one target step, for the modelled speedup
        in the metrics; None: the ratio measured as rounds go.
    prefill_budget: the most prompt tokens prefilled in one gap between rounds while rows run
        (at least one row joins a gap): a burst of joining prompts goes in over several gaps,
        and a prompt longer than what is left is prefilled apart, a chunk a gap, before its row
        joins (text/admission.py, engine/prefill.py).
    max_batch_size: the most rows the batch runs, prefilling ones included (None: no limit);
        the others wait their turn.
    """

    adaptive: DepthPolicyConfig | None = None
    num_draft_tokens: int = 4
    cost_ratio: float | None = None
    prefill_budget: int = DEFAULT_PREFILL_BUDGET
    max_batch_size: int | None = None

    def __post_init__(self) -> None:
        _make_plain(self, "num_draft_tokens", "cost_ratio", "prefill_budget", "max_batch_size")
        if self.adaptive is not None:
            require(isinstance(self.adaptive, DepthPolicyConfig), "adaptive", self.adaptive,
                    "ThresholdPolicyConfig(...), GoodputPolicyConfig(...), or None for a fixed k")
        check_int("num_draft_tokens", self.num_draft_tokens, 1, MAX_NUM_DRAFT_TOKENS)
        if self.cost_ratio is not None:
            check_number("cost_ratio", self.cost_ratio, 0, math.inf, low_open=True,
                         note=" (draft step time / target step time)")
        check_int("prefill_budget", self.prefill_budget, 1, note=" (prompt tokens a gap)")
        if self.max_batch_size is not None:
            check_int("max_batch_size", self.max_batch_size, 1, note=", or None")


# llama.cpp's weight kernels (LlamaCppConfig.repack, --repack; models/llama_cpp/kernels.py)
REPACK_MODES = ("auto", "on", "off")
# the pair's measured pass costs (LlamaCppConfig.cost_curve, --cost-curve; policy/costs.py):
# measured once and then read from the cache, measured afresh (and cached), or not measured
COST_CURVE_MODES = ("cached", "measure", "off")
VERIFICATION_RULES = ("block", "token")  # the first is the default
# the depth policies the CLI's and the server's --adaptive name (policy.named_policy builds
# them); "goodput-plain" may also choose plain rounds (k = 0)
POLICY_NAMES = ("goodput", "goodput-plain", "threshold")
# what a hybrid proposer looks up before its draft model (--hybrid-lookup; proposers/hybrid.py):
# prompt lookup of the last 2-3 tokens, or the suffix drafter; the first is the default
HYBRID_LOOKUPS = ("ngram", "suffix")
# how a draft of another tokenizer proposes (--cross-vocab; proposers/cross_vocab.py): "string"
# re-tokenizes the draft's text into target tokens, verified as a point mass; "intersection"
# draws over the tokens both vocabularies share, verified by the ratio test; "auto" picks by
# the pair's shared vocabulary (docs/cross_vocab.md)
CROSS_VOCAB_RULES = ("string", "intersection")  # the first works for every pair
CROSS_VOCAB_MODES = ("auto", *CROSS_VOCAB_RULES)
# the rules a sampled `verispec bench` row can run under: block and token verification of
# unseeded rows (their generator seeded by the bench), and "seeded": a row with a seed, whose
# tokens are races on keyed clocks (sample/seeded.py), which couples the draft to the target instead
BENCH_RULES = VERIFICATION_RULES + ("seeded",)


def check_verification(verification: object) -> None:
    """One of VERIFICATION_RULES, else ConfigError naming them."""
    require(verification in VERIFICATION_RULES, "verification", verification,
            " or ".join(repr(rule) for rule in VERIFICATION_RULES))


def check_draft_p_min(draft_p_min: object) -> None:
    """A draft model's confidence floor (``--draft-p-min``; proposers/draft_model.py): a number
    in [0, 1], 0 for none, else ConfigError naming it."""
    require(is_number(draft_p_min) and 0.0 <= draft_p_min <= 1.0, "draft_p_min", draft_p_min,
            "a number from 0 to 1 (0: no floor), e.g. 0.75")

