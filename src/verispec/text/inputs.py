"""One request's settings (RequestSettings, the keywords of Decoder.generate, stream, chat and
TextBatch.add, documented once here), the options of a call's own batch (CALL_OPTIONS), a
prompt checked and encoded for the engine (PreparedRow), and what a TextBatch asks of the
Decoder that prepares its rows (RowPreparer: the Decoder, text/decoder.py, which imports the
batch).

A request carries what its text's law and length depend on, and at most a cap on its depth;
how fast it decodes is its batch's (config.BatchOptions). Decoder.generate, stream, chat and
stream_batch run a batch of their own, so they also take that batch's options (CALL_OPTIONS:
``speculative``, ``adaptive``, ...) and read ``num_draft_tokens`` as its k; a row joining a
running batch
(TextBatch.add, the server) takes the batch as it is, and a batch option it gives that differs
from the batch's is a ConfigError naming it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple, Protocol, TypeVar

from ..config import (
    VERIFICATION_RULES,
    BatchOptions,
    GenerationConfig,
    PenaltyConfig,
    SamplingConfig,
    check_bool,
    is_int,
    plain_number,
    require,
)
from ..engine.constraints import ConstraintSet
from ..errors import ConfigError
from .grammar import Grammar
from .stream import check_stop

S = TypeVar("S")


class UnknownSettingError(ConfigError, TypeError):
    """A keyword that is not a setting; a TypeError too, as Python's own for a bad keyword."""


@dataclass(frozen=True)
class RequestSettings:
    """One request's settings: the keywords of ``Decoder.generate``, ``stream``, ``chat``,
    ``stream_chat``, ``stream_batch`` and ``TextBatch.add``, each checked against these fields
    (the calls also take CALL_OPTIONS, their own batch's: see the module docstring).

    max_new_tokens: the most tokens generated. Generation also stops at the tokenizer's
    end-of-generation tokens and at a stop string.
    temperature, top_k, top_p: the sampling settings (SamplingConfig); temperature 0 is greedy,
    at most 10000.
    seed: the text is then the same for any k, draft, depth policy and batch, and with
    ``speculative=False`` (each token is the target's sample on clocks keyed by the seed and its
    position, sample/seeded.py).
    stop: a string, or a list of strings, that ends the text (excluded from it).
    num_draft_tokens: the most draft tokens the row takes a round, a cap on its batch's depth
    (None: no cap). A call that runs a batch of its own (generate, stream, chat, stream_batch)
    takes it as that batch's k instead (BatchOptions.num_draft_tokens: every round's under a
    fixed k, the first one's under a depth policy; None: the decoder's).
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
    draft tokens, so the output has exactly the penalised target's law (sample/penalties.py
    gives the order).
    logprobs: None, or N in 0..20: each new token's logprob under the distribution it was
    drawn from, with the N most likely alternatives (Completion.logprobs, TextRow.logprobs).
    fit_to_context: lower max_new_tokens (and min_new_tokens with it) to what fits in the
    models' context windows after the prompt and the first draft, at least 1, instead of
    refusing the prompt (the server's max_tokens left out).

    A number may be a numpy scalar (np.int64(5), np.float32(0.5)): it is read as the Python
    number it holds (a bool is never a number). The values are checked here, by the library's
    own configs (SamplingConfig, PenaltyConfig, GenerationConfig), save what needs the model:
    the logit bias's token ids, the grammar and the context window, checked where the decoder
    turns the settings into a GenerationConfig (Decoder.prepare). An error names its setting
    (ConfigError.field).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    num_draft_tokens: int | None = None
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
    fit_to_context: bool = False

    def __post_init__(self) -> None:
        check_flag("ignore_eos", self.ignore_eos)
        check_flag("fit_to_context", self.fit_to_context)
        GenerationConfig(
            max_new_tokens=self.max_new_tokens, num_draft_tokens=self.num_draft_tokens,
            sampling=self.sampling, min_new_tokens=self.min_new_tokens, seed=self.seed,
            verification=VERIFICATION_RULES[0] if self.verification is None
            else self.verification, logprobs=self.logprobs,
            penalty=PenaltyConfig(presence_penalty=self.presence_penalty,
                                  frequency_penalty=self.frequency_penalty,
                                  repetition_penalty=self.repetition_penalty))
        check_stop(self.stop)

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              min_p=self.min_p)


# the options of the batch a Decoder call runs on its own (generate, stream, chat, stream_batch):
# ``speculative`` (False: the target alone, through the same code path) and BatchOptions' fields
# (``adaptive``: its depth policy, None for a fixed k; cost_ratio, prefill_budget,
# max_batch_size), each absent the decoder's (Decoder.batch_options); num_draft_tokens, a
# RequestSettings field, is the call's k
CALL_OPTIONS = ("speculative",) + tuple(field.name for field in fields(BatchOptions)
                                        if field.name != "num_draft_tokens")


def penalty_config(settings: RequestSettings, vocab_size: int) -> PenaltyConfig:
    """The request's penalties and logit bias as a PenaltyConfig (checked there), with every
    logit_bias key a token id of the model's vocabulary, else ConfigError naming it."""
    bias = settings.logit_bias
    if bias is None:
        pairs: tuple[tuple[int, float], ...] = ()
    else:
        require(isinstance(bias, Mapping), "logit_bias", bias,
                "a mapping {token id: bias}, e.g. {50256: -100}")
        for token in bias:
            token = plain_number(token)
            require(is_int(token) and 0 <= token < vocab_size, "logit_bias", bias,
                    f"token ids of the model as keys, integers in [0, {vocab_size}) "
                    f"({token!r:.40} is not)")
        # numpy keys as ints (PenaltyConfig refuses two keys of one id, e.g. 5 and np.int64(5))
        pairs = tuple(sorted(((plain_number(token), value) for token, value in bias.items()),
                             key=lambda pair: pair[0]))
    return PenaltyConfig(presence_penalty=settings.presence_penalty,
                         frequency_penalty=settings.frequency_penalty,
                         repetition_penalty=settings.repetition_penalty, logit_bias=pairs)


def check_flag(name: str, value: object) -> None:
    """``value`` is True or False, else ConfigError naming ``name`` (config.check_bool)."""
    check_bool(name, value)


def check_keywords(settings_class: type, caller: str, given: Mapping[str, object],
                   extra: Sequence[str] = ()) -> None:
    """Every name in ``given`` is a field of the dataclass ``settings_class`` or one of
    ``extra``, else UnknownSettingError naming the keyword and the names that exist."""
    names = [field.name for field in fields(settings_class)] + list(extra)
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
    """One prompt ready for the engine (Decoder.prepare): token ids (checked against the
    vocabulary), config, stop strings, grammar (None: unconstrained)."""

    prompt_ids: list[int]
    config: GenerationConfig
    stop: tuple[str, ...]
    constraints: ConstraintSet | None


class PendingRow(NamedTuple):
    """A row checked and encoded (TextBatch.prepare), not yet in the batch; ``tag``: the
    caller's (an index, a request), which its TextRow keeps."""

    prepared: PreparedRow
    tag: object


class RowPreparer(Protocol):
    """What a TextBatch calls on its Decoder: ``prepare`` (Decoder.prepare, a prompt's checks
    and encoding; ``depth``: the row's first k in its batch, 0 without drafts) and the
    ``tokenizer`` its rows' text is decoded with."""

    tokenizer: Any

    def prepare(self, prompt: str | Sequence[int], settings: RequestSettings,
                depth: int) -> PreparedRow: ...
