"""One request's settings (RequestSettings, the keywords of Decoder.generate, stream, chat and
TextBatch.add, documented once here), a prompt checked and encoded for the engine
(PreparedRow), and what a TextBatch asks of the Decoder that prepares its rows (RowPreparer:
the Decoder, text/decoder.py, which imports the batch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, Protocol, TypeVar

from ..config import GenerationConfig, PenaltyConfig, plain_number
from ..engine.constraints import ConstraintSet
from ..errors import ConfigError
from ..policy.base import AdaptivePolicyConfig
from .grammar import Grammar

S = TypeVar("S")


class UnknownSettingError(ConfigError, TypeError):
    """A keyword that is not a setting; a TypeError too, as Python's own for a bad keyword."""


@dataclass(frozen=True)
class RequestSettings:
    """One request's settings: the keywords of ``Decoder.generate``, ``stream``, ``chat``,
    ``stream_chat``, ``stream_batch`` and ``TextBatch.add``, each checked against these fields.

    max_new_tokens: the most tokens generated. Generation also stops at the tokenizer's
    end-of-generation tokens and at a stop string.
    temperature, top_k, top_p: the sampling settings (SamplingConfig); temperature 0 is greedy,
    at most 10000.
    seed: the text is then the same for any k, draft, depth policy and batch, and with
    ``speculative=False`` (each token is the target's sample on clocks keyed by the seed and its
    position, spec/seeded.py).
    stop: a string, or a list of strings, that ends the text (excluded from it).
    num_draft_tokens: the depth k of this call (the starting depth under a depth policy);
    None: the decoder's.
    speculative: False decodes with the target alone through the same code path.
    adaptive: the depth policy of this call; None: the decoder's; False: a fixed k whatever the
    decoder's default.
    ignore_eos: do not stop at end-of-generation tokens (they are generated and kept like any
    other token; for benchmarks that need a fixed length).
    min_new_tokens: no end-of-generation token before this many new tokens (the target's
    distribution there is renormalised without them, exactly, as vLLM's min_tokens); stop
    strings still apply.
    response_format: constrain the output (text.grammar.compile_response_format: a JSON
    schema, any JSON object, a regex, a Lark grammar, in OpenAI's dict shape, or a Grammar);
    draft and target are masked alike, so the output has exactly the constrained target's law.
    verification: "block" or "token", the rule that tests an unseeded sampled row's draft-model
    tokens; None: the decoder's.
    presence_penalty, frequency_penalty: OpenAI's, over the generated tokens, in [-2, 2].
    repetition_penalty: Hugging Face's, over prompt and output, in [0.01, 100] (1 = off).
    logit_bias: {token id: bias in [-100, 100]} added to the logits.
    min_p: keep tokens at least min_p times as likely as the most likely one (None = off).
    Penalties and bias are applied at every verified position counting the block's earlier
    draft tokens, so the output has exactly the penalised target's law (spec/penalties.py
    gives the order).
    logprobs: None, or N in 0..20: each new token's logprob under the distribution it was
    drawn from, with the N most likely alternatives (Completion.logprobs, TextRow.logprobs).

    A number may be a numpy scalar (np.int64(5), np.float32(0.5)): it is read as the Python
    number it holds (a bool is never a number). The values are checked where the decoder turns
    them into a GenerationConfig (Decoder.prepare), since k and the depth policy default to the
    decoder's; an error names its setting (ConfigError.field).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    num_draft_tokens: int | None = None
    speculative: bool = True
    adaptive: AdaptivePolicyConfig | Literal[False] | None = None
    ignore_eos: bool = False
    min_new_tokens: int = 0
    response_format: Mapping[str, object] | Grammar | None = None
    verification: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    min_p: float | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        check_flag("speculative", self.speculative)
        check_flag("ignore_eos", self.ignore_eos)


def penalty_config(settings: RequestSettings, vocab_size: int) -> PenaltyConfig:
    """The request's penalties and logit bias as a PenaltyConfig (checked there), with every
    logit_bias key a token id of the model's vocabulary, else ConfigError naming it."""
    bias = settings.logit_bias
    if bias is None:
        pairs: tuple[tuple[int, float], ...] = ()
    elif not isinstance(bias, Mapping):
        raise ConfigError(f"logit_bias={bias!r:.60} is invalid: expected a mapping "
                          "{token id: bias}, e.g. {50256: -100}.", field="logit_bias")
    else:
        for token in bias:
            token = plain_number(token)
            if isinstance(token, bool) or not isinstance(token, int) or not (
                    0 <= token < vocab_size):
                raise ConfigError(f"logit_bias key {token!r:.40} is invalid: expected a token "
                                  f"id of the model, an integer in [0, {vocab_size}).",
                                  field="logit_bias")
        # numpy keys as ints (PenaltyConfig refuses two keys of one id, e.g. 5 and np.int64(5))
        pairs = tuple(sorted(((plain_number(token), value) for token, value in bias.items()),
                             key=lambda pair: pair[0]))
    return PenaltyConfig(presence_penalty=settings.presence_penalty,
                         frequency_penalty=settings.frequency_penalty,
                         repetition_penalty=settings.repetition_penalty, logit_bias=pairs)


def check_flag(name: str, value: object) -> None:
    """``value`` is True or False, else ConfigError naming ``name``."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is invalid: expected True or False.", field=name)


def check_keywords(settings_class: type, caller: str, given: Mapping[str, object]) -> None:
    """Every name in ``given`` is a field of the dataclass ``settings_class``, else
    UnknownSettingError naming the keyword and the fields that exist."""
    names = [field.name for field in fields(settings_class)]
    unknown = [name for name in given if name not in names]
    if unknown:
        raise UnknownSettingError(
            f"{caller}() got an unexpected keyword argument {unknown[0]!r}; expected one of "
            f"{', '.join(names)} ({settings_class.__name__}).", field=unknown[0])


def settings_of(settings_class: type[S], caller: str, given: Mapping[str, object]) -> S:
    """``given`` (a call's keywords) as a ``settings_class`` (RequestSettings,
    DecoderOptions), checked by its __post_init__; UnknownSettingError for a keyword that is not
    one of its fields."""
    check_keywords(settings_class, caller, given)
    return settings_class(**given)


@dataclass(frozen=True)
class PreparedRow:
    """One prompt ready for the engine (Decoder.prepare): token ids, config, stop strings,
    grammar (None: unconstrained)."""

    prompt_ids: list[int]
    config: GenerationConfig
    stop: tuple[str, ...]
    constraints: ConstraintSet | None


class RowPreparer(Protocol):
    """What a TextBatch calls on its Decoder: ``prepare`` (Decoder.prepare, a prompt's checks
    and encoding) and the ``tokenizer`` its rows' text is decoded with."""

    tokenizer: Any

    def prepare(self, prompt: str | Sequence[int], settings: RequestSettings) -> PreparedRow: ...
